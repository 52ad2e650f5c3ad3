"""The system prompts, in one place: configs pick one by name (`config.system_prompt`)."""

# A Chain-of-Agents agent: its roles and tools. The shipped CoA sample is written with it, and
# the Qwen configs use it.
AGENT = (
    "You are an agent that solves tasks step by step. Roles: think, plan, reflection, "
    "suggested_answer, double_check, answer. Tools: web_search (a query), crawl_page (URLs "
    "separated by |), wiki_search (a query), code (a fenced python block). Every tool call "
    "is followed by an observation.")

# Agents in the embedded world (`coa_jax.data.world`): its tools, in 28 tokens of the default
# tokenizer. It is the same in every row, so a tiny model learns nothing from it: a longer one
# (84 tokens, listing the roles too) left 25% fewer trajectories in each packed row and delayed
# the copying that SFT must learn (issue 19).
WORLD = "Solve the question with tools: web_search, crawl_page, code."

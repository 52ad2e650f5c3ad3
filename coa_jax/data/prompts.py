"""The system prompts, in one place: configs pick one by name (`config.system_prompt`), or
build one from their declared tools (`for_tools`)."""

from typing import Mapping

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


def for_tools(tools_spec: Mapping[str, Mapping], preamble: str = "Solve the question with tools:"
              ) -> str:
  """Returns a system prompt listing the tools a config's `tools` spec declares, one line each:
  its tag, what its tag holds and, for an MCP tool, what a call's body holds (`ToolDecl.body`,
  the form its arguments are parsed in: its one string argument as plain text, nothing, or a
  JSON object of its input schema; an MCP server is started to list its tools)."""
  from tools_env.registry import declare

  lines = [preamble]
  for tool in declare(tools_spec):
    body = f" Body: {tool.body}." if tool.body else ""
    lines.append(f"{tool.tag}: {tool.description.rstrip('.')}.{body}")
  return "\n".join(lines)

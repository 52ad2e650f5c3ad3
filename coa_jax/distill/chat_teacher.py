"""A teacher system on a real model: the same agents as role prompts on any OpenAI-compatible
chat endpoint (`ChatTeacher`), a controller routing between them, a tool agent per declared
tool; its traces are the scripted teacher's (`teacher.Trace`)."""

from __future__ import annotations

import json
import re
from typing import Any, Sequence

from coa_jax.data import coa_format
from coa_jax.distill.teacher import Activation, Message, Trace
from tools_env.registry import ToolDecl, ToolRegistry, TrajectoryTools
from tools_env.remote import ChatClient


CHAT_AGENTS = {
    "planner": ("plan", "You are the planner. Break the question into numbered steps that "
                        "name the facts to look up and the computations to run."),
    "search_agent": ("web_search", "You are the search agent. Reply with only a search query "
                                   "for the current step."),
    "crawl_agent": ("crawl_page", "You are the crawl agent. Reply with only the URL (or URLs "
                                  "separated by |) to read, taken from earlier search results."),
    "code_agent": ("code", "You are the code agent. Reply with only a ```python block that "
                           "prints the result of the current step."),
    "thinker": ("think", "You are the thinker. State briefly what the results so far establish."),
    "reflector": ("reflection", "You are the reflector. Say what went wrong or is missing so "
                                "far and how to proceed."),
    "proposer": ("suggested_answer", "You are the proposer. Reply with only the answer the "
                                     "results support."),
    "verifier": ("double_check", "You are the verifier. Check the proposed answer against the "
                                 "evidence and end with 'Score: N' (1 = wrong, 4 = certain)."),
    "answerer": ("answer", "You are the answerer. Reply with only the final answer."),
}
CONTROLLER_PROMPT = (
    "You coordinate a team of agents solving a question with tools: {agents}. Given the "
    "transcript so far, reply with only a JSON object {{\"agent\": <name>, \"instruction\": "
    "<what it should do>}} naming the next agent. Propose an answer (proposer) only when the "
    "evidence supports it; the answerer ends the task.")


def chat_agents(declared: Sequence[ToolDecl] | None = None) -> dict[str, tuple[str, str]]:
  """Returns the chat teacher's agents: the role agents, and one tool agent per declared tool
  (None: the built-in search, crawl and code agents); a declared tool's agent is prompted
  with its description and, an MCP tool's, what the body of a call holds (`ToolDecl.body`:
  the form the call's arguments are parsed in)."""
  if declared is None:
    return CHAT_AGENTS
  agents = {agent: value for agent, value in CHAT_AGENTS.items()
            if value[0] in coa_format.ROLE_TAGS}
  builtin = {step: (agent, prompt) for agent, (step, prompt) in CHAT_AGENTS.items()
             if step not in coa_format.ROLE_TAGS}
  for tool in declared:
    body = f": {tool.body}" if tool.body else ""
    agent, prompt = builtin.get(tool.tag) or (
        f"{tool.tag}_agent", f"You are the {tool.tag} agent: {tool.description.rstrip('.')}. "
                             f"Reply with only the body of the call{body}.")
    agents[agent] = (tool.tag, prompt)
  return agents


class ChatTeacher:
  """The multi-agent system on a chat model: a controller routes the task between role agents
  (each a role prompt over the shared transcript) until the answerer speaks. `declared`: the
  config's tools (`tools_env.registry.declare`), each a tool agent (`chat_agents`)."""

  def __init__(self, tools: ToolRegistry, client: ChatClient, max_activations: int = 24,
               declared: Sequence[ToolDecl] | None = None):
    self.tools, self.client, self.max_activations = tools, client, max_activations
    self.agents = chat_agents(declared)

  def _ask(self, system: str, transcript: str) -> str:
    return self.client.complete([{"role": "system", "content": system},
                                 {"role": "user", "content": transcript}]).strip()

  def next_agent(self, transcript: str, previous: str | None) -> tuple[str, str]:
    """Returns (agent, instruction) from the controller; the verifier always follows the
    proposer, and an unreadable decision goes to the reflector."""
    if previous == "proposer":
      return "verifier", "Check the proposed answer."
    if previous == "verifier":
      return "answerer", "Give the final answer."
    reply = self._ask(CONTROLLER_PROMPT.format(agents=", ".join(self.agents)), transcript)
    found = re.search(r"\{.*\}", reply, re.DOTALL)
    try:
      decision = json.loads(found.group(0)) if found else {}
    except json.JSONDecodeError:
      decision = {}
    agent = decision.get("agent") if isinstance(decision, dict) else None
    if agent not in self.agents or agent == "verifier":
      return "reflector", f"The controller's reply could not be used: {reply[:200]!r}."
    return agent, str(decision.get("instruction", ""))

  def run(self, task: dict[str, Any]) -> Trace:
    """Solves one task record with the chat model and real tool calls; returns its Trace.
    Raises ToolFailure when the endpoint fails (after its retries)."""
    trace = Trace(str(task["id"]), task["question"], task_data=dict(task.get("metadata", {})))
    tools = TrajectoryTools(self.tools, goal=task["question"])
    board = [Message("user", "planner", task["question"])]
    agent, instruction = "planner", "Plan how to answer the question."
    for _ in range(self.max_activations):
      step, role = self.agents[agent]
      transcript = "\n\n".join(f"[{m.sender}] {m.content}" for m in board)
      inputs = [Message("orchestrator", agent, instruction)]
      content = self._ask(role, f"{transcript}\n\n[orchestrator] {instruction}")
      activation = Activation(agent, step, list(board[-2:]) + inputs,
                              Message(agent, "orchestrator", content))
      if step not in coa_format.ROLE_TAGS:  # a tool agent
        activation.tool_call = content
        result = tools.call(step, content)
        activation.tool_result, activation.tool_ok = result.observation, result.ok
      trace.activations.append(activation)
      board.append(activation.output)
      if activation.tool_result is not None:
        board.append(Message(step, agent, activation.tool_result))
      if agent == "answerer":
        trace.answer = content
        break
      agent, instruction = self.next_agent("\n\n".join(f"[{m.sender}] {m.content}"
                                                       for m in board), agent)
    return trace

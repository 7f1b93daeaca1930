"""An agent harness on a real framework: the OpenAI Agents SDK (`openai-agents`) with a calculator tool.

    ./launch.sh output_dir=runs/agents max_response_length=256 max_prompt_length=512 \
        actor_rollout_ref.rollout.agent.default_agent_loop=external \
        external.harness=pipegen.examples.agents_calculator:harness

The agent runs unchanged against the session's base URL (the chat-completions dialect); the gateway renders the
tool's schema with the model's chat template and parses the model's tool calls with verl's parser (hermes for
Qwen-style models). It returns nothing: the unit is scored like any other (the task's ground truth).
"""

from __future__ import annotations

import ast
import operator
from typing import Any

from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
from openai import AsyncOpenAI

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.USub: operator.neg}


def _eval(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.left), _eval(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.operand))
    raise ValueError("only numbers and + - * / // % are allowed")


@function_tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression such as '2 + 3 * 4'."""
    try:
        return str(_eval(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError) as e:
        return f"error: {e}"


async def harness(row: dict[str, Any], base_url: str, api_key: str) -> None:
    set_tracing_disabled(True)  # nothing leaves the machine
    model = OpenAIChatCompletionsModel(model="pipegen", openai_client=AsyncOpenAI(base_url=base_url, api_key=api_key))
    agent = Agent(name="calculator agent", model=model, tools=[calculator],
                  instructions="Solve the problem. Use the calculator for arithmetic. End with '#### <number>'.")
    question = row["raw_prompt"][-1]["content"]
    await Runner.run(agent, question, max_turns=6)

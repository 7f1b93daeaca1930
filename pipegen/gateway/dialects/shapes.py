"""What the three dialects share (gateway/dialects/): the one internal shape every request becomes
(`ChatRequest`) and every answer is (`Reply`, its `Choice`s and `ToolCall`s), messages in the chat-template form
(`canonical`), the reading of settings every dialect has (numbers, stops, tool_choice, settings refused rather
than ignored), server-sent events, OpenAI's error shape (its two dialects share it), and `Dialect`, what one dialect module gives the server.

Owns: the internal shape and the chat-template form of a message.
Must never: read or write a dialect's own request or reply fields (each dialect's module does), tokenize, or generate.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import orjson


class BadRequest(ValueError):
    """A request the gateway cannot serve as asked: HTTP 400 with this one line."""


@dataclass
class ChatRequest:
    dialect: str  # "chat" | "responses" | "messages"
    messages: list[dict[str, Any]]  # canonical chat messages
    tools: list[dict[str, Any]] | None  # OpenAI function-tool schemas, as chat templates take them
    parse_tools: bool = True  # False: tool_choice none (the reply is text)
    n: int = 1
    stop: list[str] = field(default_factory=list)
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    stream: bool = False
    include_usage: bool = False
    model: str = "pipegen"
    previous_response_id: str | None = None


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as the model wrote it (re-serialized by the parser)


@dataclass
class Choice:
    content: str
    tool_calls: list[ToolCall]
    finish: str  # "stop" | "length" | "tool_calls"
    reasoning: str | None = None
    stop_sequence: str | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    pieces: list[str] = field(default_factory=list)  # each token's text, for the logprobs answer


@dataclass
class Reply:
    id: str
    model: str
    choices: list[Choice]
    prompt_tokens: int
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)


# ---- canonical messages

TEXT_PARTS = ("text", "input_text", "output_text")


def text_of(content: Any, where: str) -> str:
    """A message's content as text: a string, or text parts joined (anything else is refused)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and part.get("type") in TEXT_PARTS:
                texts.append(str(part.get("text") or ""))
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise BadRequest(f"{where}: content part of type {kind!r} is not supported (text only)")
        return "".join(texts)
    raise BadRequest(f"{where}: content must be a string or a list of text parts")


def arguments_value(arguments: Any) -> Any:
    """Tool-call arguments as the chat template takes them: the parsed JSON object when they parse."""
    if isinstance(arguments, str):
        try:
            return orjson.loads(arguments)
        except orjson.JSONDecodeError:
            return arguments
    return arguments


def canonical_tool_call(name: str, arguments: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": str(name), "arguments": arguments_value(arguments)}}


def canonical(message: Any, where: str) -> dict[str, Any]:
    """An OpenAI chat message in the chat-template form. Tool-call ids are left out (they are not the model's
    tokens); reasoning is left out (a harness that does not send it back has not edited what the model saw:
    the trajectory keeps the sampled ids)."""
    if not isinstance(message, dict) or "role" not in message:
        raise BadRequest(f"{where}: every message needs a role")
    role = "system" if message["role"] == "developer" else str(message["role"])
    if role not in ("system", "user", "assistant", "tool"):
        raise BadRequest(f"{where}: role {role!r} is not supported (system, developer, user, assistant, tool)")
    out: dict[str, Any] = {"role": role, "content": text_of(message.get("content"), where)}
    if role == "assistant" and message.get("tool_calls"):
        calls = []
        for call in message["tool_calls"]:
            fn = (call or {}).get("function") or {}
            if "name" not in fn:
                raise BadRequest(f"{where}: a tool call needs function.name")
            calls.append(canonical_tool_call(fn["name"], fn.get("arguments", "{}")))
        out["tool_calls"] = calls
    if role == "tool":
        out["tool_call_id"] = str(message.get("tool_call_id") or "")
    if message.get("name") and role in ("user", "tool"):
        out["name"] = str(message["name"])
    return out


def reply_message(choice: Choice) -> dict[str, Any]:
    """The assistant message a harness holds after this choice, in the canonical form."""
    out: dict[str, Any] = {"role": "assistant", "content": choice.content}
    if choice.tool_calls:
        out["tool_calls"] = [canonical_tool_call(c.name, c.arguments) for c in choice.tool_calls]
    return out


def function_tools(tools: Any, where: str) -> list[dict[str, Any]] | None:
    """OpenAI chat `tools` (function tools only) as chat templates take them."""
    if not tools:
        return None
    out = []
    for tool in tools:
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or "function" not in tool:
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise BadRequest(f"{where}: tool of type {kind!r} is not supported (function tools only)")
        fn = tool["function"]
        out.append({"type": "function", "function": {k: fn[k] for k in ("name", "description", "parameters")
                                                      if k in fn}})
    return out


def number(body: dict, key: str, kind: type = float) -> Any:
    value = body.get(key)
    if value is None:
        return None
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise BadRequest(f"{key}={value!r} is not a number") from None


def refuse_unsupported(body: dict, settings: Iterable[tuple[str, Any]]) -> None:
    """Settings that change what is sampled and that the gateway cannot honour: refused, never ignored."""
    for key, neutral in settings:
        value = body.get(key)
        if value is not None and value != neutral and value != {} and value != []:
            raise BadRequest(f"{key}={orjson.dumps(value).decode()[:80]} is not supported by pipegen's gateway "
                             f"(leave it out)")


def tool_choice_parses(choice: Any, where: str) -> bool:
    """Whether tool calls are parsed: auto (default) and none are honoured; a forced call cannot be (no
    constrained decoding) and is refused."""
    if choice is None or choice in ("auto", "none"):
        return choice != "none"
    if isinstance(choice, dict) and choice.get("type") in ("auto", "none"):  # Anthropic's form
        return choice["type"] != "none"
    raise BadRequest(f"{where}: tool_choice={orjson.dumps(choice).decode()[:80]} cannot be enforced by pipegen's "
                     "gateway (no constrained decoding); send auto or none: smolagents OpenAIServerModel(..., "
                     "tool_choice='auto'); pydantic-ai profile=OpenAIModelProfile(supports_forced_tool_choice=False); "
                     "LangChain bind_tools without tool_choice")


def stops(value: Any) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else list(value)
    if not all(isinstance(s, str) and s for s in stops):
        raise BadRequest("stop must be a non-empty string or a list of them")
    return stops


def sse(data: Any, event: str | None = None) -> bytes:
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + orjson.dumps(data) + b"\n\n"


def openai_error(status: int, message: str) -> dict[str, Any]:
    """An error in OpenAI's shape (chat completions and responses; the SDK reads the message from it)."""
    kind = {400: "invalid_request_error", 401: "invalid_api_key", 404: "not_found"}.get(status, "server_error")
    return {"error": {"message": message, "type": kind, "param": None, "code": kind}}


@dataclass(frozen=True)
class Dialect:
    """One dialect as the server uses it: how a request is read, how its reply is written whole and as a
    stream, and how an error is shaped."""

    read: Callable[[dict[str, Any]], ChatRequest]
    whole: Callable[..., dict[str, Any]]
    stream: Callable[[Reply, ChatRequest], list[bytes]]
    error: Callable[[int, str], dict[str, Any]]

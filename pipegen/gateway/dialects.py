"""The three dialects a harness may speak, to and from one internal shape.

- OpenAI chat completions (`/v1/chat/completions`): tools, tool_choice, n, stop, max_tokens /
  max_completion_tokens, temperature, top_p, logprobs / top_logprobs, stream (chunks, `[DONE]`);
- OpenAI responses (`/v1/responses`): input items (messages, function_call, function_call_output),
  instructions, previous_response_id, tools, max_output_tokens, stream (typed events);
- Anthropic messages (`/v1/messages`): system, content blocks (text, tool_use, tool_result), tools,
  tool_choice, stop_sequences, max_tokens, temperature, top_p, top_k, stream (typed events).

Every request becomes a `ChatRequest` whose messages are in the chat-template form (`canonical`): the form the
model's chat template renders and the form two conversations are compared in. Every answer is a `Reply`,
written back in the dialect it was asked in. Streams are synthesized from the finished reply (the capture never
depends on a stream reaching the client).
Owns: the dialects' field names and shapes. Must never: tokenize, generate, or accept a setting it cannot honour
(a request pipegen cannot serve as asked is refused with one line naming the setting: `BadRequest`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterable

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


# ------------------------------------------------------------------------------------------ canonical messages

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


def _number(body: dict, key: str, kind: type = float) -> Any:
    value = body.get(key)
    if value is None:
        return None
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise BadRequest(f"{key}={value!r} is not a number") from None


def _refuse_unsupported(body: dict, settings: Iterable[tuple[str, Any]]) -> None:
    """Settings that change what is sampled and that the gateway cannot honour: refused, never ignored."""
    for key, neutral in settings:
        value = body.get(key)
        if value is not None and value != neutral and value != {} and value != []:
            raise BadRequest(f"{key}={orjson.dumps(value).decode()[:80]} is not supported by pipegen's gateway "
                             f"(leave it out)")


def _tool_choice(choice: Any, where: str) -> bool:
    """Whether tool calls are parsed: auto (default) and none are honoured; a forced call cannot be (no
    constrained decoding) and is refused."""
    if choice is None or choice in ("auto", "none"):
        return choice != "none"
    if isinstance(choice, dict) and choice.get("type") in ("auto", "none"):  # Anthropic's form
        return choice["type"] != "none"
    raise BadRequest(f"{where}: tool_choice={orjson.dumps(choice).decode()[:80]} cannot be enforced by pipegen's "
                     "gateway (no constrained decoding); use auto or none")


def _stops(value: Any) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else list(value)
    if not all(isinstance(s, str) and s for s in stops):
        raise BadRequest("stop must be a non-empty string or a list of them")
    return stops


# ------------------------------------------------------------------------------------- OpenAI chat completions

CHAT_UNSUPPORTED = (("frequency_penalty", 0), ("presence_penalty", 0), ("logit_bias", None),
                    ("response_format", {"type": "text"}), ("audio", None), ("prediction", None))


def chat_request(body: dict[str, Any]) -> ChatRequest:
    _refuse_unsupported(body, CHAT_UNSUPPORTED)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages: a non-empty list is required")
    n = _number(body, "n", int) or 1
    if n < 1:
        raise BadRequest("n must be at least 1")
    max_tokens = _number(body, "max_completion_tokens", int)
    if max_tokens is None:
        max_tokens = _number(body, "max_tokens", int)
    return ChatRequest(
        dialect="chat",
        messages=[canonical(m, f"messages[{i}]") for i, m in enumerate(messages)],
        tools=function_tools(body.get("tools"), "tools"),
        parse_tools=_tool_choice(body.get("tool_choice"), "chat"),
        n=n, stop=_stops(body.get("stop")), max_tokens=max_tokens,
        temperature=_number(body, "temperature"), top_p=_number(body, "top_p"),
        logprobs=bool(body.get("logprobs")), top_logprobs=_number(body, "top_logprobs", int) or 0,
        stream=bool(body.get("stream")),
        include_usage=bool((body.get("stream_options") or {}).get("include_usage")),
        model=str(body.get("model") or "pipegen"),
    )


def _chat_message(choice: Choice) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": choice.content if (choice.content or not choice.tool_calls)
                           else None, "refusal": None}
    if choice.reasoning is not None:
        msg["reasoning_content"] = choice.reasoning
    if choice.tool_calls:
        msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                             for c in choice.tool_calls]
    return msg


def _chat_logprobs(choice: Choice, req: ChatRequest) -> dict[str, Any] | None:
    if not req.logprobs or choice.logprobs is None:
        return None
    return {"content": [{"token": p, "logprob": lp, "bytes": list(p.encode()), "top_logprobs": []}
                        for p, lp in zip(choice.pieces, choice.logprobs)], "refusal": None}


def _usage(reply: Reply) -> dict[str, int]:
    return {"prompt_tokens": reply.prompt_tokens, "completion_tokens": reply.completion_tokens,
            "total_tokens": reply.prompt_tokens + reply.completion_tokens}


def chat_response(reply: Reply, req: ChatRequest) -> dict[str, Any]:
    return {
        "id": reply.id, "object": "chat.completion", "created": reply.created, "model": reply.model,
        "choices": [{"index": i, "message": _chat_message(c), "finish_reason": c.finish,
                     "logprobs": _chat_logprobs(c, req)} for i, c in enumerate(reply.choices)],
        "usage": _usage(reply),
    }


def sse(data: Any, event: str | None = None) -> bytes:
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + orjson.dumps(data) + b"\n\n"


def chat_stream(reply: Reply, req: ChatRequest) -> list[bytes]:
    """The reply as OpenAI chunks: per choice its role, its content, each tool call whole, its finish."""
    def chunk(choices: list, usage: Any = None) -> bytes:
        data = {"id": reply.id, "object": "chat.completion.chunk", "created": reply.created, "model": reply.model,
                "choices": choices}
        if req.include_usage:
            data["usage"] = usage
        return sse(data)

    events = []
    for i, c in enumerate(reply.choices):
        events.append(chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                              "logprobs": None}]))
        if c.content:
            events.append(chunk([{"index": i, "delta": {"content": c.content}, "finish_reason": None,
                                  "logprobs": _chat_logprobs(c, req)}]))
        for k, call in enumerate(c.tool_calls):
            events.append(chunk([{"index": i, "delta": {"tool_calls": [{
                "index": k, "id": call.id, "type": "function",
                "function": {"name": call.name, "arguments": call.arguments}}]}, "finish_reason": None,
                "logprobs": None}]))
        events.append(chunk([{"index": i, "delta": {}, "finish_reason": c.finish, "logprobs": None}]))
    if req.include_usage:
        events.append(chunk([], _usage(reply)))
    events.append(b"data: [DONE]\n\n")
    return events


# --------------------------------------------------------------------------------------------- OpenAI responses

RESPONSES_UNSUPPORTED = (("text", {"format": {"type": "text"}}), ("reasoning", None), ("truncation", "disabled"),
                         ("include", None), ("background", False), ("conversation", None), ("prompt", None))


def _responses_items(items: Any) -> list[dict[str, Any]]:
    """Responses input items as OpenAI chat messages (consecutive function calls join one assistant turn)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise BadRequest("input must be a string or a list of items")
    out: list[dict[str, Any]] = []
    for k, item in enumerate(items):
        if not isinstance(item, dict):
            raise BadRequest(f"input[{k}]: an item must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            out.append({"role": item.get("role"), "content": text_of(item.get("content"), f"input[{k}]")})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            if out and out[-1]["role"] == "assistant":  # the calls of one turn follow its message
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                        "content": output if isinstance(output, str) else text_of(output, f"input[{k}]")})
        elif kind == "reasoning":
            continue  # the model's own reasoning: its sampled ids are kept by the session already
        else:
            raise BadRequest(f"input[{k}]: item type {kind!r} is not supported")
    return out


def responses_request(body: dict[str, Any]) -> ChatRequest:
    _refuse_unsupported(body, RESPONSES_UNSUPPORTED)
    messages = []
    if body.get("instructions"):
        messages.append({"role": "system", "content": text_of(body["instructions"], "instructions")})
    messages += _responses_items(body.get("input"))
    tools = None
    if body.get("tools"):
        tools = []
        for t in body["tools"]:
            if not isinstance(t, dict) or t.get("type") != "function":
                kind = t.get("type") if isinstance(t, dict) else type(t).__name__
                raise BadRequest(f"tools: tool of type {kind!r} is not supported (function tools only)")
            tools.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")
                                                          if k in t}})
    return ChatRequest(
        dialect="responses",
        messages=[canonical(m, f"input[{i}]") for i, m in enumerate(messages)],
        tools=tools, parse_tools=_tool_choice(body.get("tool_choice"), "responses"),
        max_tokens=_number(body, "max_output_tokens", int),
        temperature=_number(body, "temperature"), top_p=_number(body, "top_p"),
        stream=bool(body.get("stream")), model=str(body.get("model") or "pipegen"),
        previous_response_id=body.get("previous_response_id"),
    )


def _responses_output(reply: Reply) -> list[dict[str, Any]]:
    c = reply.choices[0]
    out: list[dict[str, Any]] = []
    if c.content or not c.tool_calls:
        out.append({"type": "message", "id": f"msg_{reply.id}", "status": "completed", "role": "assistant",
                    "content": [{"type": "output_text", "text": c.content, "annotations": [], "logprobs": []}]})
    for call in c.tool_calls:
        out.append({"type": "function_call", "id": f"fc_{call.id}", "call_id": call.id, "name": call.name,
                    "arguments": call.arguments, "status": "completed"})
    return out


def responses_response(reply: Reply, req: ChatRequest, status: str = "completed",
                       output: list | None = None) -> dict[str, Any]:
    c = reply.choices[0]
    return {
        "id": reply.id, "object": "response", "created_at": reply.created, "status": status, "model": reply.model,
        "output": _responses_output(reply) if output is None else output,
        "parallel_tool_calls": True, "tool_choice": "auto" if req.parse_tools else "none",
        "tools": [{"type": "function", **t["function"], "strict": False} for t in req.tools or []],
        "temperature": req.temperature, "top_p": req.top_p, "max_output_tokens": req.max_tokens,
        "previous_response_id": req.previous_response_id, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if c.finish == "length" else None,
        "usage": {"input_tokens": reply.prompt_tokens, "output_tokens": reply.completion_tokens,
                  "total_tokens": reply.prompt_tokens + reply.completion_tokens,
                  "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}},
    }


def responses_stream(reply: Reply, req: ChatRequest) -> list[bytes]:
    seq = iter(range(1 << 30))
    events = []

    def emit(kind: str, **data: Any) -> None:
        events.append(sse({"type": kind, "sequence_number": next(seq), **data}, kind))

    emit("response.created", response=responses_response(reply, req, "in_progress", []))
    emit("response.in_progress", response=responses_response(reply, req, "in_progress", []))
    for index, item in enumerate(_responses_output(reply)):
        if item["type"] == "message":
            emit("response.output_item.added", output_index=index, item={**item, "status": "in_progress",
                                                                         "content": []})
            part = item["content"][0]
            emit("response.content_part.added", output_index=index, item_id=item["id"], content_index=0,
                 part={**part, "text": ""})
            if part["text"]:
                emit("response.output_text.delta", output_index=index, item_id=item["id"], content_index=0,
                     delta=part["text"], logprobs=[])
            emit("response.output_text.done", output_index=index, item_id=item["id"], content_index=0,
                 text=part["text"], logprobs=[])
            emit("response.content_part.done", output_index=index, item_id=item["id"], content_index=0, part=part)
        else:
            emit("response.output_item.added", output_index=index, item={**item, "status": "in_progress",
                                                                         "arguments": ""})
            emit("response.function_call_arguments.delta", output_index=index, item_id=item["id"],
                 delta=item["arguments"])
            emit("response.function_call_arguments.done", output_index=index, item_id=item["id"],
                 arguments=item["arguments"], name=item["name"])
        emit("response.output_item.done", output_index=index, item=item)
    emit("response.completed", response=responses_response(reply, req))
    return events


# ------------------------------------------------------------------------------------------ Anthropic messages

ANTHROPIC_STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def _anthropic_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    system = body.get("system")
    if system:
        out.append({"role": "system", "content": text_of(system, "system")})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages: a non-empty list is required")
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise BadRequest(f"{where}: role must be user or assistant")
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": m["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise BadRequest(f"{where}: content must be a string or a list of blocks")
        texts: list[str] = []
        calls: list[dict] = []
        results: list[dict] = []
        for block in content:
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                texts.append(str(block.get("text") or ""))
            elif kind == "tool_use" and m["role"] == "assistant":
                calls.append({"id": block.get("id"), "type": "function",
                              "function": {"name": block.get("name"), "arguments": block.get("input") or {}}})
            elif kind == "tool_result" and m["role"] == "user":
                results.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                                "content": text_of(block.get("content"), where)})
            elif kind in ("thinking", "redacted_thinking") and m["role"] == "assistant":
                continue  # the model's reasoning: its sampled ids are kept by the session already
            else:
                raise BadRequest(f"{where}: content block of type {kind!r} is not supported")
        if m["role"] == "assistant":
            msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
        else:
            out.extend(results)
            if texts or not results:
                out.append({"role": "user", "content": "".join(texts)})
    return out


def anthropic_request(body: dict[str, Any]) -> ChatRequest:
    _refuse_unsupported(body, (("thinking", {"type": "disabled"}),))
    tools = None
    if body.get("tools"):
        tools = []
        for t in body["tools"]:
            if not isinstance(t, dict) or "input_schema" not in t or t.get("type") not in (None, "custom"):
                kind = t.get("type") if isinstance(t, dict) else type(t).__name__
                raise BadRequest(f"tools: tool of type {kind!r} is not supported (custom tools with input_schema)")
            tools.append({"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                                          "parameters": t["input_schema"]}})
    if body.get("max_tokens") is None:
        raise BadRequest("max_tokens is required")
    messages = _anthropic_messages(body)
    return ChatRequest(
        dialect="messages",
        messages=[canonical(m, f"messages[{i}]") for i, m in enumerate(messages)],
        tools=tools, parse_tools=_tool_choice(body.get("tool_choice"), "messages"),
        stop=_stops(body.get("stop_sequences")), max_tokens=_number(body, "max_tokens", int),
        temperature=_number(body, "temperature"), top_p=_number(body, "top_p"), top_k=_number(body, "top_k", int),
        stream=bool(body.get("stream")), model=str(body.get("model") or "pipegen"),
    )


def _anthropic_content(c: Choice) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if c.content or not c.tool_calls:
        blocks.append({"type": "text", "text": c.content})
    for call in c.tool_calls:
        value = arguments_value(call.arguments)
        blocks.append({"type": "tool_use", "id": call.id, "name": call.name,
                       "input": value if isinstance(value, dict) else {"arguments": call.arguments}})
    return blocks


def anthropic_response(reply: Reply, req: ChatRequest) -> dict[str, Any]:
    c = reply.choices[0]
    return {"id": reply.id, "type": "message", "role": "assistant", "model": reply.model,
            "content": _anthropic_content(c),
            "stop_reason": "stop_sequence" if c.stop_sequence else ANTHROPIC_STOP[c.finish],
            "stop_sequence": c.stop_sequence,
            "usage": {"input_tokens": reply.prompt_tokens, "output_tokens": reply.completion_tokens}}


def anthropic_stream(reply: Reply, req: ChatRequest) -> list[bytes]:
    whole = anthropic_response(reply, req)
    events = [sse({"type": "message_start", "message": {**whole, "content": [], "stop_reason": None,
                                                        "stop_sequence": None,
                                                        "usage": {**whole["usage"], "output_tokens": 0}}},
                  "message_start")]
    for index, block in enumerate(whole["content"]):
        if block["type"] == "text":
            events.append(sse({"type": "content_block_start", "index": index,
                               "content_block": {"type": "text", "text": ""}}, "content_block_start"))
            if block["text"]:
                events.append(sse({"type": "content_block_delta", "index": index,
                                   "delta": {"type": "text_delta", "text": block["text"]}}, "content_block_delta"))
        else:
            events.append(sse({"type": "content_block_start", "index": index,
                               "content_block": {**block, "input": {}}}, "content_block_start"))
            events.append(sse({"type": "content_block_delta", "index": index,
                               "delta": {"type": "input_json_delta",
                                         "partial_json": orjson.dumps(block["input"]).decode()}},
                              "content_block_delta"))
        events.append(sse({"type": "content_block_stop", "index": index}, "content_block_stop"))
    events.append(sse({"type": "message_delta", "delta": {"stop_reason": whole["stop_reason"],
                                                          "stop_sequence": whole["stop_sequence"]},
                       "usage": {"output_tokens": whole["usage"]["output_tokens"]}}, "message_delta"))
    events.append(sse({"type": "message_stop"}, "message_stop"))
    return events


# the dialects by route: how a request is read, how its reply is written whole and as a stream
DIALECTS = {
    "chat": (chat_request, chat_response, chat_stream),
    "responses": (responses_request, responses_response, responses_stream),
    "messages": (anthropic_request, anthropic_response, anthropic_stream),
}


def error_body(dialect: str, status: int, message: str) -> dict[str, Any]:
    """An error in the dialect's own shape (the SDKs read the message from it)."""
    if dialect == "messages":
        kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}.get(
            status, "api_error")
        return {"type": "error", "error": {"type": kind, "message": message}}
    kind = {400: "invalid_request_error", 401: "invalid_api_key", 404: "not_found"}.get(status, "server_error")
    return {"error": {"message": message, "type": kind, "param": None, "code": kind}}

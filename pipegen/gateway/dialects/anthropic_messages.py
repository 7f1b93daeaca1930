"""Anthropic messages (`/v1/messages`): system, content blocks (text, tool_use, tool_result), tools,
tool_choice, stop_sequences, max_tokens, temperature, top_p, top_k, stream (typed events), to and from
shapes.py's `ChatRequest` / `Reply`.

Owns: this dialect's field names and shapes, and Anthropic's error shape.
Must never: accept a setting it cannot honour (refused in one line naming it: `BadRequest`).
"""

from __future__ import annotations

from typing import Any

import orjson

from pipegen.gateway.dialects.shapes import (
    BadRequest, ChatRequest, Choice, Dialect, Reply, arguments_value, canonical, number, refuse_unsupported,
    sse, stops, text_of, tool_choice_parses,
)

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
    refuse_unsupported(body, (("thinking", {"type": "disabled"}),))
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
        tools=tools, parse_tools=tool_choice_parses(body.get("tool_choice"), "messages"),
        stop=stops(body.get("stop_sequences")), max_tokens=number(body, "max_tokens", int),
        temperature=number(body, "temperature"), top_p=number(body, "top_p"), top_k=number(body, "top_k", int),
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


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    """An error in Anthropic's shape (the SDK reads the message from it)."""
    kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}.get(
        status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


DIALECT = Dialect(anthropic_request, anthropic_response, anthropic_stream, anthropic_error)

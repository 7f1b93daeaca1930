"""OpenAI responses (`/v1/responses`): input items (messages, function_call, function_call_output),
instructions, previous_response_id, tools, max_output_tokens, stream (typed events), to and from shapes.py's
`ChatRequest` / `Reply`.

Owns: this dialect's field names and shapes (its errors are OpenAI's, shapes.py's `openai_error`).
Must never: accept a setting it cannot honour (refused in one line naming it: `BadRequest`).
"""

from __future__ import annotations

from typing import Any

from pipegen.gateway.dialects.shapes import (
    BadRequest, ChatRequest, Dialect, Reply, canonical, number, openai_error, refuse_unsupported, sse, text_of,
    tool_choice_parses,
)

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
    refuse_unsupported(body, RESPONSES_UNSUPPORTED)
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
        tools=tools, parse_tools=tool_choice_parses(body.get("tool_choice"), "responses"),
        max_tokens=number(body, "max_output_tokens", int),
        temperature=number(body, "temperature"), top_p=number(body, "top_p"),
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


DIALECT = Dialect(responses_request, responses_response, responses_stream, openai_error)

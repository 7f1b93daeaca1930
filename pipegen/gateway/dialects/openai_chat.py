"""OpenAI chat completions (`/v1/chat/completions`): tools, tool_choice, n, stop, max_tokens /
max_completion_tokens, temperature, top_p, logprobs / top_logprobs, stream (chunks, `[DONE]`), to and from
shapes.py's `ChatRequest` / `Reply`.

Owns: this dialect's field names and shapes (its errors are OpenAI's, shapes.py's
`openai_error`).
Must never: accept a setting it cannot honour (refused in one line naming it: `BadRequest`).
"""

from __future__ import annotations

from typing import Any

from pipegen.gateway.dialects.shapes import (
    BadRequest, ChatRequest, Choice, Dialect, Reply, canonical, function_tools, number, openai_error,
    refuse_unsupported, sse, stops, tool_choice_parses,
)

CHAT_UNSUPPORTED = (("frequency_penalty", 0), ("presence_penalty", 0), ("logit_bias", None),
                    ("response_format", {"type": "text"}), ("audio", None), ("prediction", None))


def chat_request(body: dict[str, Any]) -> ChatRequest:
    refuse_unsupported(body, CHAT_UNSUPPORTED)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages: a non-empty list is required")
    n = number(body, "n", int) or 1
    if n < 1:
        raise BadRequest("n must be at least 1")
    max_tokens = number(body, "max_completion_tokens", int)
    if max_tokens is None:
        max_tokens = number(body, "max_tokens", int)
    return ChatRequest(
        dialect="chat",
        messages=[canonical(m, f"messages[{i}]") for i, m in enumerate(messages)],
        tools=function_tools(body.get("tools"), "tools"),
        parse_tools=tool_choice_parses(body.get("tool_choice"), "chat"),
        n=n, stop=stops(body.get("stop")), max_tokens=max_tokens,
        temperature=number(body, "temperature"), top_p=number(body, "top_p"),
        logprobs=bool(body.get("logprobs")), top_logprobs=number(body, "top_logprobs", int) or 0,
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


DIALECT = Dialect(chat_request, chat_response, chat_stream, openai_error)

"""Agent harnesses for the gateway tests, written as users write them: the official `openai` and `anthropic`
SDKs against a base URL and a key, nothing pipegen-specific. One callable (`harness`) picks its scenario from
the prompt's last word, so one run exercises many of them; `command` runs the same as a subprocess
(`external.command='python tests/gateway_harnesses.py'`).

Scenarios: chat / chat_stream / responses / responses_stream / anthropic / anthropic_stream (a calculator
tool round until the model answers), n2 (n=2), retry (a real SDK retry: the first answer is lost on the way
back), edit (the history is edited between calls), probe (calls a finished unit's session and its own with a
wrong key), feedback (answer, check, retry with feedback), crash / hang / silent / required (failures).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import httpx

TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]


def calc(arguments) -> str:
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    return str(eval(args["expression"], {"__builtins__": {}}))  # test code: the scripted model's expressions


def scenario(row: dict) -> str:
    return row["raw_prompt"][-1]["content"].split()[-1]


def openai_client(base_url: str, api_key: str, **kw):
    from openai import OpenAI

    return OpenAI(base_url=base_url, api_key=api_key, **kw)


def chat_round(client, messages: list, stream: bool, **kw) -> dict:
    """One chat completion; the assistant message as the SDK user appends it to the history."""
    if not stream:
        msg = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, **kw).choices[0].message
        return msg.model_dump(exclude_none=True, exclude={"refusal", "annotations", "audio", "function_call"})
    content, calls = "", {}
    for chunk in client.chat.completions.create(model="m", messages=messages, tools=TOOLS, stream=True,
                                                stream_options={"include_usage": True}, **kw):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for c in delta.tool_calls or []:
            entry = calls.setdefault(c.index, {"id": c.id, "type": "function",
                                               "function": {"name": "", "arguments": ""}})
            entry["function"]["name"] += c.function.name or ""
            entry["function"]["arguments"] += c.function.arguments or ""
    msg = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"] = [calls[k] for k in sorted(calls)]
    return msg


def chat(row, base_url, api_key, stream=False):
    client = openai_client(base_url, api_key)
    messages = [dict(m) for m in row["raw_prompt"]]
    for turn in range(6):
        msg = chat_round(client, messages, stream)
        messages.append(msg)
        if not msg.get("tool_calls"):
            return {"turns": turn + 1}
        for call in msg["tool_calls"]:
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": calc(call["function"]["arguments"])})
    raise RuntimeError("no final answer in 6 turns")


def responses(row, base_url, api_key, stream=False):
    client = openai_client(base_url, api_key)
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    items: list = [{"role": m["role"], "content": m["content"]} for m in row["raw_prompt"]]
    for turn in range(6):
        if stream:
            with client.responses.stream(model="m", input=items, tools=tools) as s:
                for _ in s:
                    pass
                response = s.get_final_response()
        else:
            response = client.responses.create(model="m", input=items, tools=tools)
        calls = [o for o in response.output if o.type == "function_call"]
        items += [o.model_dump(exclude_none=True) for o in response.output]
        if not calls:
            return {"turns": turn + 1, "text": response.output_text}
        for c in calls:
            items.append({"type": "function_call_output", "call_id": c.call_id, "output": calc(c.arguments)})
    raise RuntimeError("no final answer in 6 turns")


def anthropic(row, base_url, api_key, stream=False):
    from anthropic import Anthropic

    client = Anthropic(base_url=base_url.removesuffix("/v1"), api_key=api_key)
    messages = [{"role": m["role"], "content": m["content"]} for m in row["raw_prompt"]]
    for turn in range(6):
        if stream:
            with client.messages.stream(model="m", max_tokens=160, messages=messages, tools=ANTHROPIC_TOOLS) as s:
                message = s.get_final_message()
        else:
            message = client.messages.create(model="m", max_tokens=160, messages=messages, tools=ANTHROPIC_TOOLS)
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]})
        uses = [b for b in message.content if b.type == "tool_use"]
        if not uses:
            return {"turns": turn + 1, "stop_reason": message.stop_reason}
        messages.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": b.id,
                                                      "content": calc(b.input)} for b in uses]})
    raise RuntimeError("no final answer in 6 turns")


class LoseFirstAnswer(httpx.HTTPTransport):
    """The first answer is lost on its way back (the server did the work): the SDK retries on its own."""

    def __init__(self):
        super().__init__()
        self.lost = False

    def handle_request(self, request):
        response = super().handle_request(request)
        if not self.lost:
            self.lost = True
            response.read()
            raise httpx.ReadTimeout("answer lost", request=request)
        return response


def retry(row, base_url, api_key):
    client = openai_client(base_url, api_key, http_client=httpx.Client(transport=LoseFirstAnswer()), max_retries=2)
    msg = chat_round(client, [dict(m) for m in row["raw_prompt"]], False)
    return {"turns": 1, "content": msg.get("content", "")}


def n2(row, base_url, api_key):
    client = openai_client(base_url, api_key)
    r = client.chat.completions.create(model="m", messages=row["raw_prompt"], n=2)
    return {"choices": len(r.choices)}


def edit(row, base_url, api_key):
    """Call, then send the history back with the tool call rewritten: a branch, never a splice."""
    client = openai_client(base_url, api_key)
    messages = [dict(m) for m in row["raw_prompt"]]
    msg = chat_round(client, messages, False)
    edited = json.loads(json.dumps(msg))
    edited["tool_calls"][0]["function"]["arguments"] = json.dumps({"expression": "1 + 4"})
    messages += [edited, {"role": "tool", "tool_call_id": edited["tool_calls"][0]["id"], "content": "5"}]
    chat_round(client, messages, False)
    return {"turns": 2}


def probe(row, base_url, api_key):
    """Knock on doors that must stay shut: a finished unit's session (its own key), this session with a
    wrong key, and an unknown session. Then make one honest call."""
    found = {}
    shared = Path(os.environ["GATEWAY_TEST_DIR"])
    deadline = time.monotonic() + 120
    while not list(shared.glob("session-*.json")) and time.monotonic() < deadline:
        time.sleep(0.2)  # the unit that leaves its session's URL runs beside this one
    other = json.loads(sorted(shared.glob("session-*.json"))[0].read_text())
    time.sleep(1.0)  # ... and finishes right after leaving it
    found["finished"] = _status(other["base_url"], other["api_key"])
    found["wrong_key"] = _status(base_url, api_key + "x")
    found["unknown"] = _status(base_url.rsplit("/s/", 1)[0] + "/s/nosuchsession/v1", api_key)
    chat_round(openai_client(base_url, api_key), [dict(m) for m in row["raw_prompt"]], False)
    return found


def _status(base_url: str, api_key: str) -> int:
    r = httpx.post(f"{base_url}/chat/completions", headers={"Authorization": f"Bearer {api_key}"},
                   json={"model": "m", "messages": [{"role": "user", "content": "hi"}]}, timeout=30)
    return r.status_code


def remember(row, base_url, api_key):
    """A plain call; leaves its session's URL and key where a later unit's probe finds them."""
    chat_round(openai_client(base_url, api_key), [dict(m) for m in row["raw_prompt"]], False)
    shared = Path(os.environ["GATEWAY_TEST_DIR"])
    (shared / f"session-{row['extra_info']['index']}.json").write_text(
        json.dumps({"base_url": base_url, "api_key": api_key}))
    return {"turns": 1}


def feedback(row, base_url, api_key):
    """Answer, check, and retry with feedback once: one continued conversation."""
    client = openai_client(base_url, api_key)
    messages = [dict(m) for m in row["raw_prompt"]]
    answer = client.chat.completions.create(model="m", messages=messages, max_tokens=12).choices[0].message
    messages += [{"role": "assistant", "content": answer.content},
                 {"role": "user", "content": "Check your answer and give it again."}]
    client.chat.completions.create(model="m", messages=messages, max_tokens=12)
    return None


SCENARIOS = {
    "chat": chat, "chat_stream": lambda *a: chat(*a, stream=True),
    "responses": responses, "responses_stream": lambda *a: responses(*a, stream=True),
    "anthropic": anthropic, "anthropic_stream": lambda *a: anthropic(*a, stream=True),
    "retry": retry, "n2": n2, "edit": edit, "probe": probe, "remember": remember, "feedback": feedback,
}


def harness(row, base_url, api_key):
    return SCENARIOS[scenario(row)](row, base_url, api_key)


def main() -> int:
    """external.command: the row from PIPEGEN_ROW, the URLs and keys from the SDKs' own variables."""
    row = json.loads(Path(os.environ["PIPEGEN_ROW"]).read_text())
    name = scenario(row)
    if name == "crash":
        print("about to fail", file=sys.stderr)
        return 3
    if name == "hang":
        time.sleep(3600)
    if name == "silent":
        print("warning: no model configured, skipping", file=sys.stderr)  # exit 0: its stderr is the reason
        print(json.dumps({"reward": 1.0}))
        return 0
    if name == "required":  # smolagents' ToolCallingAgent forces a tool call; the gateway refuses it
        from openai import BadRequestError, OpenAI

        try:
            OpenAI().chat.completions.create(model="m", messages=row["raw_prompt"], max_tokens=16, tool_choice="required",
                                             tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
        except BadRequestError:
            pass  # a harness that swallows the error, as agent frameworks often do
        return 0
    if name == "anthropic_env":
        from anthropic import Anthropic

        Anthropic().messages.create(model="m", max_tokens=16, messages=row["raw_prompt"])
        print(json.dumps({"reward": 0.25, "via": "anthropic"}))
        return 0
    from openai import OpenAI

    OpenAI().chat.completions.create(model="m", messages=row["raw_prompt"], max_tokens=16)
    print("log line")
    print(json.dumps({"reward": 0.5, "via": "openai"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Protocol conformance of pipegen's CPU reference server: a real subprocess on a loopback port, real HTTP.

Covers SGLang 0.5.12's behaviour wherever a client can see it: field names and shapes, meta_info key order,
finish reasons, max_new_tokens default / null / 0, batch and n > 1 ordering and rids, the context-length and
sampling errors with SGLang's texts, the unknown-key 400, text-only rejection, /health_generate 503 then 200, /abort_request prefix semantics,
client disconnect = abort, a streamed answer (the answer so far, or with --incremental-streaming-output its new
tokens, every 50 ms), fault knobs, determinism, and that concurrent requests really share forward passes.
All servers start at once (module fixture) so their startup overlaps; everything binds 127.0.0.1 only.
"""

from __future__ import annotations

import http.client
import json
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from pipegen.launch.servers import ServerProcess

REPO = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"
CTX = 256  # the fake servers' context length, small so the context errors are cheap to provoke
EOS = 2002  # tiny-qwen's <|im_end|> (config.json eos); generation_config adds 2000
FAKE_ENGINE = "pipegen.bench.doubles.fake_backend:FakeBackend"

META_KEYS_NO_LOGPROB = ["id", "finish_reason", "prompt_tokens", "weight_version", "num_retractions",
                        "reasoning_tokens", "completion_tokens", "cached_tokens", "cached_tokens_details",
                        "dp_rank", "e2e_latency", "response_sent_to_client_ts"]
META_KEYS_LOGPROB = META_KEYS_NO_LOGPROB[:5] + ["input_token_logprobs", "output_token_logprobs",
                                                "output_token_logprobs_length"] + META_KEYS_NO_LOGPROB[5:]



class Server(ServerProcess):
    """The shared ServerProcess, plus /pipegen_stats and what two endpoints answered right after binding."""

    def __init__(self, name: str, tmp: Path, *args: str) -> None:
        port_file = tmp / f"{name}.port"
        argv = [sys.executable, "-m", "pipegen.cpu_server", "--host", HOST, "--port", "0",
                "--port-file", str(port_file), "--stats-interval", "0", *args]
        super().__init__(argv, tmp / f"{name}.log", host=HOST, port_file=port_file, cwd=REPO,
                         env={"OMP_NUM_THREADS": "1"})
        self.first_seen: dict[str, int] = {}  # status of some endpoints as soon as the port is up

    def wait_port(self, timeout: float = 30) -> int:
        """Wait for the bound port and probe two endpoints at once: the model is loaded only after binding."""
        if not self.first_seen:
            wait_until(lambda: self.port is not None or not self.alive, timeout, "a bound port")
            assert self.port is not None, f"server exited:\n{self.log_tail()}"
            self.first_seen["health_generate"] = call(self, "GET", "/health_generate")[0]
            self.first_seen["get_model_info"] = call(self, "GET", "/get_model_info")[0]
        return self.port

    def wait_ready(self, timeout_s: float = 60, poll_s: float = 0.05) -> "Server":
        self.wait_port()
        super().wait_ready(timeout_s, poll_s)
        return self

    def stats(self) -> dict:
        return call(self, "GET", "/pipegen_stats")[1]


def call(server: Server, method: str, path: str, body: Any = None, timeout: float = 20) -> tuple[int, Any, str]:
    """(status, parsed JSON or None, raw text). Connection problems raise."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"{server.url}{path}", data=data, method=method,
                                 headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw, ctype = resp.status, resp.read(), resp.headers.get("Content-Type", "")
    except urllib.error.HTTPError as err:
        status, raw, ctype = err.code, err.read(), err.headers.get("Content-Type", "")
    text = raw.decode("utf-8", "replace")
    parsed = json.loads(text) if raw and "json" in ctype else None
    return status, parsed, text


def gen(server: Server, body: dict, expect: int = 200, timeout: float = 20) -> Any:
    status, obj, text = call(server, "POST", "/generate", body, timeout=timeout)
    assert status == expect, f"HTTP {status}: {text[:500]}"
    return obj if obj is not None else text


def err_message(obj: Any) -> str:
    return obj["error"]["message"]


def in_background(fn, *args) -> dict:
    """Run fn(*args) in a thread; the returned dict gets 'result' or 'error', and 'thread'."""
    box: dict = {}

    def run() -> None:
        try:
            box["result"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            box["error"] = exc

    box["thread"] = threading.Thread(target=run, daemon=True)
    box["thread"].start()
    return box


def wait_until(pred, timeout: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


PROMPT = [2001, 368, 198, 1022, 494, 220, 17, 10, 18, 30, 2002, 198, 2001, 365, 198]


@pytest.fixture(scope="module")
def servers(tiny_model: str, tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("refserver")
    script = tmp / "script.json"
    script.write_text(json.dumps([
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>',
        "The answer is 5.",
    ]))
    common = ["--model-path", tiny_model, "--seed", "7"]
    fake = ["--engine", FAKE_ENGINE, "--context-length", str(CTX), *common]
    s = {
        # The HF server first: it takes longest (torch import + load), the others start while it loads.
        "hf": Server("hf", tmp, "--engine", "hf", *common, "--max-batch", "8", "--batch-wait-ms", "5",
                     "--dtype", "float32", "--startup-delay", "1.0"),
        "fake": Server("fake", tmp, *fake),
        "slow": Server("slow", tmp, *fake, "--slots", "2", "--token-latency", "0.01"),
        "pieces": Server("pieces", tmp, *fake, "--token-latency", "0.01", "--incremental-streaming-output"),
        "faults": Server("faults", tmp, *fake, "--fail-rate", "0.2", "--hang-rate", "0.05"),
        "crash": Server("crash", tmp, *fake, "--crash-after", "3"),
        "script": Server("script", tmp, *fake, "--script", str(script)),
    }
    for srv in s.values():
        srv.start()
    try:
        yield s
    finally:
        for srv in s.values():
            srv.stop()


@pytest.fixture(scope="module")
def fake(servers) -> Server:
    return servers["fake"].wait_ready()


@pytest.fixture(scope="module")
def slow(servers) -> Server:
    return servers["slow"].wait_ready()


@pytest.fixture(scope="module")
def hf(servers) -> Server:
    return servers["hf"].wait_ready()


# --------------------------------------------------------------------------------------------------------------
# Pure protocol functions (no server)
# --------------------------------------------------------------------------------------------------------------


def test_protocol_pure_functions() -> None:
    from pipegen.cpu_server.errors import ProtocolError
    from pipegen.cpu_server.parse import effective_max_new_tokens, parse_generate_request
    from pipegen.cpu_server.responses import check_finish

    assert effective_max_new_tokens(None, 10, 256) == 244  # null: up to C - 2 - N
    assert effective_max_new_tokens(128, 10, 256) == 128
    assert effective_max_new_tokens(300, 10, 256) == 244
    assert effective_max_new_tokens(5, 300, 256) == 0
    # 0.5.12 mode: an unknown sampling key is a bare text/plain 500.
    with pytest.raises(ProtocolError) as info:
        parse_generate_request({"input_ids": [1], "sampling_params": {"max_tokens": 1}}, context_length=256,
                               vocab_size=100, unknown_key_status=500)
    assert (info.value.status, info.value.body, info.value.content_type) == (500, b"Internal Server Error", "text/plain")
    # n > 1 on a batch: prompt-major, fresh rids, one shared effective budget per prompt.
    parsed = parse_generate_request({"input_ids": [[1, 2], [3]], "rid": ["u", "v"],
                                     "sampling_params": {"n": 2, "max_new_tokens": 4}},
                                    context_length=256, vocab_size=100, new_rid=iter("abcd").__next__)
    assert [(e.prompt_index, e.sample_index, e.rid) for e in parsed.entries] == [
        (0, 0, "a"), (0, 1, "b"), (1, 0, "c"), (1, 1, "d")]
    assert not parsed.is_single and not parsed.user_rids
    spec = parsed.entries[0]
    assert check_finish(7, 4, spec, frozenset({7})) == {"type": "length", "length": 4}  # length before stop
    assert check_finish(7, 3, spec, frozenset({7})) == {"type": "stop", "matched": 7}
    assert check_finish(8, 3, spec, frozenset({7})) is None


# --------------------------------------------------------------------------------------------------------------
# Shapes
# --------------------------------------------------------------------------------------------------------------


def test_single_response_shape_and_meta_key_order(fake: Server) -> None:
    out = gen(fake, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 16, "temperature": 0.7},
                     "return_logprob": True, "rid": "shape-1"})
    assert list(out) == ["output_ids", "meta_info"]  # no "text" under skip-tokenizer-init
    meta = out["meta_info"]
    assert list(meta) == META_KEYS_LOGPROB
    assert meta["id"] == "shape-1"
    assert meta["prompt_tokens"] == len(PROMPT)
    assert meta["weight_version"] == "default"
    assert meta["input_token_logprobs"] == []  # logprob_start_len defaults to -1
    ids, lps = out["output_ids"], meta["output_token_logprobs"]
    assert meta["completion_tokens"] == len(ids) == len(lps) == meta["output_token_logprobs_length"]
    for (lp, tid, text), oid in zip(lps, ids):
        assert isinstance(lp, float) and lp < 0 and tid == oid and text is None
    assert all(isinstance(t, int) and 0 <= t < 2048 for t in ids)

    plain = gen(fake, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4}})
    assert list(plain["meta_info"]) == META_KEYS_NO_LOGPROB
    assert len(plain["meta_info"]["id"]) == 32  # a uuid4 hex when no rid is given


def test_max_new_tokens_default_null_and_zero(fake: Server) -> None:
    out = gen(fake, {"input_ids": PROMPT, "sampling_params": {"ignore_eos": True}})
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 128}
    assert len(out["output_ids"]) == 128

    # null = up to the context: clamped to C - 2 - N, and `length` reports the clamped number.
    out = gen(fake, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": None, "ignore_eos": True}})
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": CTX - 2 - len(PROMPT)}
    assert len(out["output_ids"]) == CTX - 2 - len(PROMPT)

    # 0: one token is still sampled -> empty output_ids, one phantom logprob, finish length 0.
    out = gen(fake, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True})
    meta = out["meta_info"]
    assert out["output_ids"] == []
    assert meta["finish_reason"] == {"type": "length", "length": 0}
    assert meta["completion_tokens"] == 0
    assert len(meta["output_token_logprobs"]) == 1 and meta["output_token_logprobs_length"] == 1


def _find_stop(server: Server) -> tuple[list[int], dict]:
    """A prompt whose (deterministic) answer ends with EOS before 200 tokens."""
    for k in range(40):
        prompt = PROMPT + [100 + k]
        out = gen(server, {"input_ids": prompt, "sampling_params": {"max_new_tokens": 200}, "return_logprob": True})
        if out["meta_info"]["finish_reason"]["type"] == "stop" and len(out["output_ids"]) >= 3:
            return prompt, out
    raise AssertionError("no prompt finished with EOS")


def test_finish_reasons_stop_length_order_and_ignore_eos(fake: Server) -> None:
    prompt, out = _find_stop(fake)
    ids = out["output_ids"]
    fr = out["meta_info"]["finish_reason"]
    assert fr == {"type": "stop", "matched": EOS}
    assert ids[-1] == EOS  # the matched token is the last output id, with a logprob
    assert out["meta_info"]["output_token_logprobs"][-1][1] == EOS
    # The token that reaches the budget is EOS: the reason is still `length` (length is checked first).
    cut = gen(fake, {"input_ids": prompt, "sampling_params": {"max_new_tokens": len(ids)}})
    assert cut["output_ids"] == ids
    assert cut["meta_info"]["finish_reason"] == {"type": "length", "length": len(ids)}
    # ignore_eos: generation goes on through the EOS.
    cont = gen(fake, {"input_ids": prompt, "sampling_params": {"max_new_tokens": len(ids) + 5, "ignore_eos": True}})
    assert cont["meta_info"]["finish_reason"]["type"] == "length"
    assert len(cont["output_ids"]) == len(ids) + 5
    # stop_token_ids: stops at the first occurrence of a chosen id.
    target = ids[1]
    st = gen(fake, {"input_ids": prompt, "sampling_params": {"max_new_tokens": 200, "stop_token_ids": [target]}})
    first = ids.index(target)
    assert st["output_ids"] == ids[:first + 1]
    assert st["meta_info"]["finish_reason"] == {"type": "stop", "matched": target}


def test_batch_and_parallel_sampling_order_and_rids(fake: Server) -> None:
    prompts = [PROMPT, PROMPT[:5], PROMPT[3:12]]
    singles = [gen(fake, {"input_ids": p, "sampling_params": {"max_new_tokens": 6}})["output_ids"] for p in prompts]
    batch = gen(fake, {"input_ids": prompts, "rid": "b", "sampling_params": {"max_new_tokens": 6}})
    assert isinstance(batch, list) and len(batch) == 3
    assert [o["meta_info"]["id"] for o in batch] == ["b_0", "b_1", "b_2"]
    assert [o["output_ids"] for o in batch] == singles
    assert [o["meta_info"]["prompt_tokens"] for o in batch] == [len(p) for p in prompts]
    # Per-entry sampling params and a rid list.
    batch = gen(fake, {"input_ids": prompts[:2], "rid": ["x", "y"],
                       "sampling_params": [{"max_new_tokens": 2}, {"max_new_tokens": 3}]})
    assert [o["meta_info"]["id"] for o in batch] == ["x", "y"]
    assert [len(o["output_ids"]) for o in batch] == [2, 3]
    _, obj, _ = call(fake, "POST", "/generate", {"input_ids": prompts[:2], "rid": ["x", "x"]})
    assert err_message(obj) == "Duplicate request IDs detected within the request: ['x']"
    status, obj, _ = call(fake, "POST", "/generate", {"input_ids": prompts, "rid": ["x", "y"]})
    assert status == 400
    assert err_message(obj) == "The specified rids length mismatch with the batch_size for batch processing."

    # n > 1: a list, prompt-major, fresh uuids; sample 0 equals the n = 1 answer.
    outs = gen(fake, {"input_ids": prompts[:2], "rid": ["p", "q"], "sampling_params": {"max_new_tokens": 6, "n": 3}})
    assert len(outs) == 6
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [len(prompts[0])] * 3 + [len(prompts[1])] * 3
    rids = [o["meta_info"]["id"] for o in outs]
    assert len(set(rids)) == 6 and not {"p", "q"} & set(rids)
    assert outs[0]["output_ids"] == singles[0] and outs[3]["output_ids"] == singles[1]
    assert outs[0]["output_ids"] != outs[1]["output_ids"]  # samples differ
    one = gen(fake, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4, "n": 2}})
    assert isinstance(one, list) and len(one) == 2
    status, obj, _ = call(fake, "POST", "/generate", {"input_ids": prompts[:2],
                                                     "sampling_params": [{"n": 2}, {"n": 3}]})
    assert status == 400
    assert err_message(obj) == "The parallel_sample_num should be the same for all samples in sample params."


# --------------------------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------------------------


def test_context_length_errors_exact_texts(fake: Server) -> None:
    status, obj, _ = call(fake, "POST", "/generate", {"input_ids": [5] * CTX})
    assert status == 400
    assert err_message(obj) == f"The input ({CTX} tokens) is longer than the model's context length ({CTX} tokens)."
    status, obj, _ = call(fake, "POST", "/generate", {"input_ids": [5] * 100, "sampling_params": {"max_new_tokens": 156}})
    assert status == 400
    assert err_message(obj) == (
        f"Requested token count exceeds the model's maximum context length of {CTX} tokens. You requested a total "
        f"of 256 tokens: 100 tokens from the input messages and 156 tokens for the completion. Please reduce the "
        f"number of tokens in the input messages or the completion to fit within the limit.")
    # The default 128 counts too: a 200-token prompt without max_new_tokens is over the limit.
    status, obj, _ = call(fake, "POST", "/generate", {"input_ids": [5] * 200})
    assert status == 400 and "You requested a total of 328 tokens" in err_message(obj)
    # Scheduler limit C - 6: the longest accepted prompt is C - 7 tokens.
    status, obj, _ = call(fake, "POST", "/generate", {"input_ids": [5] * (CTX - 6), "sampling_params": {"max_new_tokens": None}})
    assert status == 400
    assert err_message(obj) == (f"Input length ({CTX - 6} tokens) exceeds the maximum allowed length ({CTX - 6} "
                                f"tokens). Use a shorter input or enable --allow-auto-truncate.")
    out = gen(fake, {"input_ids": [5] * (CTX - 7), "sampling_params": {"max_new_tokens": None, "ignore_eos": True}})
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 5}


@pytest.mark.parametrize("params,message", [
    ({"temperature": -1}, "temperature must be non-negative, got -1."),
    ({"top_p": 0}, "top_p must be in (0, 1], got 0."),
    ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5."),
    ({"top_k": 0}, "top_k must be -1 (disable) or at least 1, got 0."),
    ({"min_p": 2}, "min_p must be in [0, 1], got 2."),
    ({"repetition_penalty": 0}, "repetition_penalty must be in (0, 2] (1.0 = no penalty), got 0."),
    ({"frequency_penalty": 3}, "frequency_penalty must be in [-2, 2], got 3."),
    ({"max_new_tokens": -1}, "max_new_tokens must be at least 0, got -1."),
    ({"max_new_tokens": 4, "min_new_tokens": 5}, "min_new_tokens must be in [0, max_new_tokens(4)], got 5."),
    ({"regex": "a", "ebnf": "b"}, "Only one of regex, json_schema, or ebnf can be set."),
])
def test_sampling_range_errors(fake: Server, params: dict, message: str) -> None:
    status, obj, _ = call(fake, "POST", "/generate", {"input_ids": PROMPT, "sampling_params": params})
    assert status == 400
    assert err_message(obj) == message


def test_greedy_conversion_precedes_top_k_check(fake: Server) -> None:
    # SGLang turns temperature 0 into top_k = 1 before verify(): top_k 0 is then not an error.
    gen(fake, {"input_ids": PROMPT, "sampling_params": {"temperature": 0, "top_k": 0, "max_new_tokens": 2}})


@pytest.mark.parametrize("key", ["max_tokens", "logprobs"])
def test_unknown_sampling_key_is_a_0523_style_400(fake: Server, key: str) -> None:
    status, obj, _ = call(fake, "POST", "/generate", {"input_ids": PROMPT, "sampling_params": {key: 8}})
    assert status == 400
    assert isinstance(obj["error"], str)  # a plain string here, not an object
    assert obj["error"].startswith(f"unknown field `{key}`, expected one of `max_new_tokens`, `stop`, ")


def test_input_errors(fake: Server) -> None:
    status, obj, _ = call(fake, "POST", "/generate", {"text": "hello"})
    assert status == 400
    assert err_message(obj) == (
        "The engine initialized with skip_tokenizer_init=True cannot accept text prompts. Please provide input_ids "
        "or re-initialize the engine with skip_tokenizer_init=False.")
    status, obj, _ = call(fake, "POST", "/generate", {"sampling_params": {}})
    assert status == 400 and err_message(obj) == "Either text, input_ids or input_embeds should be provided."
    status, obj, _ = call(fake, "POST", "/generate", {"input_ids": []})
    assert status == 400 and err_message(obj) == "input_ids cannot be empty."
    status, obj, _ = call(fake, "POST", "/generate", {"input_ids": "abc"})
    assert status == 400 and obj["object"] == "error" and obj["code"] == 400 and obj["type"] == "Bad Request"
    status, obj, _ = call(fake, "POST", "/generate", {"input_ids": [1, 2, 2048]})
    assert status == 400 and "contains values greater than the vocab size (2048)" in err_message(obj)
    # text + input_ids: input_ids wins.
    gen(fake, {"text": "ignored", "input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}})


# --------------------------------------------------------------------------------------------------------------
# Determinism (fake engine)
# --------------------------------------------------------------------------------------------------------------


def test_fake_is_deterministic_across_processes_and_resumes_exactly(fake: Server, slow: Server) -> None:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 40, "ignore_eos": True, "sampling_seed": 11},
            "return_logprob": True}
    a = gen(fake, body)
    b = gen(slow, body)  # another process (same --seed), with latency and slots: same tokens, same logprobs
    assert a["output_ids"] == b["output_ids"]
    assert a["meta_info"]["output_token_logprobs"] == b["meta_info"]["output_token_logprobs"]
    other = gen(fake, {**body, "sampling_params": {**body["sampling_params"], "sampling_seed": 12}})
    assert other["output_ids"] != a["output_ids"]
    # Resume: prompt + partial output with the remaining budget continues the very same trajectory.
    full = a["output_ids"]
    rest = gen(fake, {**body, "input_ids": PROMPT + full[:15],
                      "sampling_params": {**body["sampling_params"], "max_new_tokens": 25}})
    assert rest["output_ids"] == full[15:]
    assert rest["meta_info"]["output_token_logprobs"] == a["meta_info"]["output_token_logprobs"][15:]
    # Prompt logprobs: logprob_start_len = k returns positions k.. with the first logprob null.
    out = gen(fake, {**body, "logprob_start_len": 3, "sampling_params": {"max_new_tokens": 1}})
    ilp = out["meta_info"]["input_token_logprobs"]
    assert [t for _, t, _ in ilp] == PROMPT[3:] and ilp[0][0] is None and all(lp < 0 for lp, _, _ in ilp[1:])


def test_script_mode_scripts_a_tool_conversation(servers) -> None:
    script = servers["script"].wait_ready()
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(script.argv[script.argv.index("--model-path") + 1]) / "tokenizer.json"))

    def enc(s: str) -> list[int]:
        return tok.encode(s, add_special_tokens=False).ids

    prompt = enc("<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nWhat is 2+3?<|im_end|>\n"
                 "<|im_start|>assistant\n")
    out = gen(script, {"input_ids": prompt, "sampling_params": {"max_new_tokens": 100}})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": EOS}
    text = tok.decode(out["output_ids"], skip_special_tokens=False)
    assert text == '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call><|im_end|>'
    turn2 = prompt + out["output_ids"] + enc("\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n"
                                             "<|im_start|>assistant\n")
    out2 = gen(script, {"input_ids": turn2, "sampling_params": {"max_new_tokens": 100}})
    assert tok.decode(out2["output_ids"], skip_special_tokens=False) == "The answer is 5.<|im_end|>"
    # A resumed partial reply continues the script instead of restarting it.
    part = gen(script, {"input_ids": turn2 + out2["output_ids"][:2], "sampling_params": {"max_new_tokens": 100}})
    assert part["output_ids"] == out2["output_ids"][2:]


# --------------------------------------------------------------------------------------------------------------
# Aborts, disconnects, flush_cache (fake engine with latency and 2 slots)
# --------------------------------------------------------------------------------------------------------------


def _long(rid: str, n: int = 200) -> dict:
    return {"input_ids": PROMPT, "rid": rid, "return_logprob": True,
            "sampling_params": {"max_new_tokens": n, "ignore_eos": True}}


def test_abort_request_prefix_semantics_and_waiting_abort(slow: Server) -> None:
    before = slow.stats()["aborted_via_endpoint"]
    a = in_background(gen, slow, _long("job7"))
    wait_until(lambda: slow.stats()["running"] == 1, what="job7 running")
    b = in_background(gen, slow, _long("job7-x"))
    wait_until(lambda: slow.stats()["running"] == 2, what="job7-x running")
    c = in_background(gen, slow, _long("other", 20))  # both slots busy: waits
    d = in_background(gen, slow, _long("job7-waiting"))
    wait_until(lambda: slow.stats()["waiting"] == 2, what="two waiting")
    # Duplicate of an in-flight rid.
    status, obj, _ = call(slow, "POST", "/generate", _long("job7"))
    assert status == 400 and err_message(obj) == "Duplicate request ID detected: job7"
    # "job" is not exactly in flight: ignored.
    assert call(slow, "POST", "/abort_request", {"rid": "job"})[0] == 200
    time.sleep(0.05)
    assert slow.stats()["aborted_via_endpoint"] == before
    # "job7" is: every rid starting with it goes, running or waiting.
    status, _, text = call(slow, "POST", "/abort_request", {"rid": "job7"})
    assert status == 200 and text == ""
    for box in (a, b, c, d):
        box["thread"].join(10)
        assert "error" not in box, box.get("error")
    for box in (a, b):
        out = box["result"]
        assert out["meta_info"]["finish_reason"] == {"type": "abort", "message": "Aborted", "status_code": None,
                                                     "err_type": None}
        assert 0 < len(out["output_ids"]) < 200
        assert len(out["meta_info"]["output_token_logprobs"]) == len(out["output_ids"])
    waiting = d["result"]
    assert waiting["text"] == "" and waiting["output_ids"] == []
    assert waiting["meta_info"]["finish_reason"] == {"type": "abort", "message": "Abort in waiting queue"}
    assert "prompt_tokens" not in waiting["meta_info"]
    assert c["result"]["meta_info"]["finish_reason"] == {"type": "length", "length": 20}
    assert slow.stats()["aborted_via_endpoint"] == before + 3


def test_client_disconnect_aborts_and_flush_cache(slow: Server) -> None:
    assert call(slow, "GET", "/flush_cache")[0] == 200
    before = slow.stats()["client_disconnects"]
    with pytest.raises((TimeoutError, urllib.error.URLError, OSError)):
        call(slow, "POST", "/generate", _long("gone"), timeout=0.3)
    wait_until(lambda: slow.stats()["client_disconnects"] == before + 1, what="disconnect noticed")
    wait_until(lambda: slow.stats()["running"] == 0, timeout=2, what="aborted request released its slot")
    # flush_cache: 400 while a request runs, 200 with ?timeout once it finishes.
    box = in_background(gen, slow, _long("busy", 30))
    wait_until(lambda: slow.stats()["running"] == 1, what="busy running")
    status, _, text = call(slow, "POST", "/flush_cache")
    assert status == 400 and text == "Flush cache failed."
    status, _, text = call(slow, "POST", "/flush_cache?timeout=5")
    assert status == 200 and text.startswith("Cache flushed.")
    box["thread"].join(5)


def test_a_streamed_answer_sends_the_answer_so_far_then_the_same_answer_unstreamed(slow: Server) -> None:
    """stream=true (what the actor asks for a long answer whose tokens it keeps): SGLang's server-sent events, each
    unfinished chunk the answer so far (cumulative ids and log-prob triples, finish_reason null), every 50 ms while
    tokens come (0.01 s a token: ~5 tokens a chunk); the last chunk is the answer the same request gives unstreamed.
    A batch streamed is refused in one line; a client gone mid-stream aborts the generation."""
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 40, "ignore_eos": True, "sampling_seed": 3},
            "return_logprob": True}
    req = urllib.request.Request(f"{slow.url}/generate", data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=20) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        events = [e for e in resp.read().decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    last, partial = chunks[-1], chunks[:-1]
    whole = gen(slow, body)
    assert last["output_ids"] == whole["output_ids"] and len(whole["output_ids"]) == 40
    assert last["meta_info"]["output_token_logprobs"] == whole["meta_info"]["output_token_logprobs"]
    assert len(partial) >= 3 and all(c["meta_info"]["finish_reason"] is None for c in partial)
    sizes = [len(c["output_ids"]) for c in partial]
    assert sizes == sorted(set(sizes)) and max(sizes) < 40
    for c in partial:
        n = len(c["output_ids"])
        assert c["output_ids"] == whole["output_ids"][:n]
        assert c["meta_info"]["output_token_logprobs"] == whole["meta_info"]["output_token_logprobs"][:n]

    refused = gen(slow, {**body, "input_ids": [PROMPT, PROMPT], "stream": True}, expect=400)
    assert "stream=true takes one generation" in err_message(refused)

    before = slow.stats()["client_disconnects"]
    conn = http.client.HTTPConnection("127.0.0.1", slow.port, timeout=20)
    conn.request("POST", "/generate", json.dumps({**_long("streamed-gone"), "stream": True}),
                 {"Content-Type": "application/json"})
    assert conn.getresponse().read1().startswith(b"data: ")  # the first chunk came: the client goes
    conn.close()
    wait_until(lambda: slow.stats()["client_disconnects"] == before + 1, what="disconnect noticed")
    wait_until(lambda: slow.stats()["running"] == 0, timeout=2, what="aborted stream released its slot")


def test_an_incremental_stream_sends_new_tokens_and_the_actor_reads_the_whole_answer(servers) -> None:
    """--incremental-streaming-output (how the launcher starts the CPU server): each chunk carries only its new ids
    and log-prob triples, its completion_tokens the answer's length so far; the actor's reader (engines/sglang.py)
    makes the same answer of them as the request gives unstreamed."""
    from pipegen.engines.sglang import StreamedAnswer

    pieces = servers["pieces"].wait_ready()
    assert call(pieces, "GET", "/get_server_info")[1]["incremental_streaming_output"] is True
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 40, "ignore_eos": True, "sampling_seed": 3},
            "return_logprob": True}
    req = urllib.request.Request(f"{pieces.url}/generate", data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=20) as resp:
        chunks = [json.loads(e[len("data: "):]) for e in resp.read().decode().split("\n\n") if e.startswith("data: {")]
    whole = gen(pieces, body)
    assert len(chunks) >= 3 and sum(len(c["output_ids"]) for c in chunks) == 40
    assert [c["meta_info"]["completion_tokens"] for c in chunks] == \
        [sum(len(c["output_ids"]) for c in chunks[:k + 1]) for k in range(len(chunks))]
    answer = StreamedAnswer(return_logprob=True)
    for c in chunks[:-1]:
        answer.add(c)
        assert answer.ids == whole["output_ids"][:len(answer.ids)] and len(answer.logprobs) == len(answer.ids)
    made = answer.whole(chunks[-1])
    assert made["output_ids"] == whole["output_ids"]
    assert made["meta_info"]["output_token_logprobs"] == whole["meta_info"]["output_token_logprobs"]


def test_slots_bound_running_requests(slow: Server) -> None:
    t0 = time.monotonic()
    with ThreadPoolExecutor(4) as ex:
        outs = list(ex.map(lambda i: gen(slow, _long(f"slot-{i}", 10)), range(4)))
    elapsed = time.monotonic() - t0
    assert all(len(o["output_ids"]) == 10 for o in outs)
    assert slow.stats()["max_batch_size"] == 2  # never more than --slots 2 at once
    assert elapsed >= 0.18  # two waves of 10 tokens x 10 ms


# --------------------------------------------------------------------------------------------------------------
# Fault knobs
# --------------------------------------------------------------------------------------------------------------


def test_fail_and_hang_rates(servers) -> None:
    srv = servers["faults"].wait_ready()

    def one(i: int) -> str:
        try:
            status, obj, _ = call(srv, "POST", "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}},
                                  timeout=1.0)
        except (TimeoutError, urllib.error.URLError, OSError):
            return "hang"
        if status == 503:
            assert obj == {"object": "error", "message": "The request queue is full.", "type": "503", "param": None,
                           "code": 503}
        return str(status)

    with ThreadPoolExecutor(25) as ex:
        kinds = list(ex.map(one, range(100)))
    n503, nhang, n200 = kinds.count("503"), kinds.count("hang"), kinds.count("200")
    assert n503 + nhang + n200 == 100
    assert 8 <= n503 <= 35, kinds
    assert 1 <= nhang <= 12, kinds
    st = srv.stats()
    assert st["injected_503"] == n503 and st["hung"] == nhang


def test_crash_after_kills_the_process(servers) -> None:
    srv = servers["crash"].wait_ready()
    for _ in range(3):
        gen(srv, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}})
    with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
        call(srv, "POST", "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}}, timeout=5)
    assert srv.proc.wait(5) == 86


# --------------------------------------------------------------------------------------------------------------
# The transformers engine
# --------------------------------------------------------------------------------------------------------------


def test_hf_startup_health_503_then_200_and_info(servers) -> None:
    srv = servers["hf"]
    srv.wait_port()
    # Right after binding (the model loads after a 1 s --startup-delay): liveness yes, readiness no.
    assert srv.first_seen == {"health_generate": 503, "get_model_info": 200}
    srv.wait_ready()
    assert call(srv, "GET", "/health")[0] == 200
    status, info, _ = call(srv, "GET", "/get_model_info")
    assert status == 200 and info["model_type"] == "qwen2" and info["is_generation"] is True
    assert call(srv, "GET", "/model_info")[1] == info
    status, models, _ = call(srv, "GET", "/v1/models")
    assert models["object"] == "list" and models["data"][0]["max_model_len"] == 8192
    sinfo = call(srv, "GET", "/get_server_info")[1]
    assert sinfo["context_length"] == 8192 and sinfo["max_req_input_len"] == 8186 and sinfo["skip_tokenizer_init"]


def _greedy(prompt: list[int], n: int = 12) -> dict:
    return {"input_ids": prompt, "return_logprob": True,
            "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}


def test_hf_matches_transformers_and_batching_changes_nothing(hf: Server, tiny_model: str) -> None:
    prompts = [PROMPT, PROMPT[:4], PROMPT[2:] + PROMPT, [7, 8, 9, 10, 11, 12, 13]]
    alone = [gen(hf, _greedy(p)) for p in prompts]
    # Concurrent and staggered: rows join a running batch at different steps and leave at different steps.
    with ThreadPoolExecutor(8) as ex:
        futs = []
        for i, p in enumerate(prompts * 2):
            body = _greedy(p) if i < 4 else {**_greedy(p, 5 + 3 * i)}
            futs.append(ex.submit(gen, hf, body))
            time.sleep(0.004)
        together = [f.result() for f in futs]
    for a, t in zip(alone, together[:4]):
        assert t["output_ids"] == a["output_ids"]
        for (la, _, _), (lt, _, _) in zip(a["meta_info"]["output_token_logprobs"], t["meta_info"]["output_token_logprobs"]):
            assert abs(la - lt) < 1e-3
    for a, t in zip(alone, together[4:]):  # longer budgets: the same greedy path, continued
        assert t["output_ids"][:12] == a["output_ids"]

    # The reference: plain transformers greedy decoding on the same weights.
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    with torch.inference_mode():
        ref = model.generate(torch.tensor([PROMPT]), attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
                             max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=2000)
        logits = model(torch.tensor([PROMPT + alone[0]["output_ids"]])).logits[0].float()
    assert ref[0, len(PROMPT):].tolist() == alone[0]["output_ids"]
    lp = torch.log_softmax(logits, -1)
    want = [lp[len(PROMPT) - 1 + i, t].item() for i, t in enumerate(alone[0]["output_ids"])]
    got = [x[0] for x in alone[0]["meta_info"]["output_token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(want, got)) < 1e-3  # greedy: the unscaled log_softmax (SGLang)
    # Prompt logprobs (logprob_start_len = 0): the first entry is null, then log p(token | prefix).
    out = gen(hf, {**_greedy(PROMPT, 1), "logprob_start_len": 0})
    ilp = out["meta_info"]["input_token_logprobs"]
    assert [t for _, t, _ in ilp] == PROMPT and ilp[0][0] is None
    assert max(abs(ilp[i][0] - lp[i - 1, PROMPT[i]].item()) for i in range(1, len(PROMPT))) < 1e-3


def test_hf_concurrent_requests_are_batched(hf: Server) -> None:
    before = hf.stats()
    bodies = [{"input_ids": PROMPT[: 5 + i], "sampling_params": {"max_new_tokens": 32, "ignore_eos": True}}
              for i in range(8)]
    with ThreadPoolExecutor(8) as ex:
        outs = list(ex.map(lambda b: gen(hf, b), bodies))
    after = hf.stats()
    assert all(len(o["output_ids"]) == 32 for o in outs)
    assert after["max_batch_size"] >= 4
    steps = after["decode_steps"] - before["decode_steps"]
    tokens = after["engine_tokens_generated"] - before["engine_tokens_generated"]
    assert tokens == 256 and steps <= tokens / 3, (steps, tokens)  # forward passes were shared


def test_hf_sampling_seed_stop_ids_phantom_and_abort(hf: Server) -> None:
    body = {"input_ids": PROMPT, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 16, "temperature": 1.0, "sampling_seed": 5, "ignore_eos": True}}
    a, b = gen(hf, body), gen(hf, body)
    assert a["output_ids"] == b["output_ids"]
    c = gen(hf, {**body, "sampling_params": {**body["sampling_params"], "sampling_seed": 6}})
    assert c["output_ids"] != a["output_ids"]
    # top_k = 1 / temperature 0 are greedy whatever the seed.
    g1 = gen(hf, {**body, "sampling_params": {**body["sampling_params"], "top_k": 1}})
    g2 = gen(hf, _greedy(PROMPT, 16))
    assert g1["output_ids"] == g2["output_ids"]
    # stop_token_ids: the first greedy token stops at once, and is the last output id.
    first = g2["output_ids"][0]
    st = gen(hf, {"input_ids": PROMPT, "sampling_params": {"temperature": 0, "stop_token_ids": [first]}})
    assert st["output_ids"] == [first] and st["meta_info"]["finish_reason"] == {"type": "stop", "matched": first}
    # max_new_tokens 0: phantom logprob.
    z = gen(hf, {"input_ids": PROMPT, "return_logprob": True, "sampling_params": {"max_new_tokens": 0}})
    assert z["output_ids"] == [] and len(z["meta_info"]["output_token_logprobs"]) == 1
    assert z["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    # Abort a running HF row: HTTP 200, abort finish, partial tokens.
    box = in_background(gen, hf, {"input_ids": PROMPT, "rid": "hf-long",
                                  "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}})
    wait_until(lambda: hf.stats()["running"] == 1, what="hf-long running")
    time.sleep(0.1)
    assert call(hf, "POST", "/abort_request", {"rid": "hf-long"})[0] == 200
    box["thread"].join(10)
    out = box["result"]
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(out["output_ids"]) < 4000


def test_hf_logprobs_are_sglangs_temperature_scaled_ones(hf: Server, tiny_model: str) -> None:
    """SGLang 0.5.12: log_softmax((logits after penalties) / temperature); top-k/top-p shape the draw only."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    for extra in ({"top_k": 5, "top_p": 0.9}, {"frequency_penalty": 0.5}):
        sp = {"max_new_tokens": 10, "temperature": 0.7, "sampling_seed": 3, "ignore_eos": True, **extra}
        out = gen(hf, {"input_ids": PROMPT, "return_logprob": True, "top_logprobs_num": 3, "sampling_params": sp})
        ids = out["output_ids"]
        with torch.inference_mode():
            logits = model(torch.tensor([PROMPT + ids])).logits[0, len(PROMPT) - 1:-1].float()
        counts = torch.zeros_like(logits)
        for i in range(1, len(ids)):  # the penalty at step i counts the tokens generated before it
            counts[i] = counts[i - 1]
            counts[i, ids[i - 1]] += 1
        lp = torch.log_softmax((logits - sp.get("frequency_penalty", 0.0) * counts) / 0.7, -1)
        want = lp[torch.arange(len(ids)), torch.tensor(ids)]
        got = torch.tensor([x[0] for x in out["meta_info"]["output_token_logprobs"]])
        assert (want - got).abs().max() < 1e-3, extra
        top = torch.tensor([[v for v, _, _ in step] for step in out["meta_info"]["output_top_logprobs"]])
        assert (top - lp.topk(3, -1).values).abs().max() < 1e-3, extra


def test_hf_an_answer_resumed_after_a_crash_has_the_log_probs_of_one_whole_answer(hf: Server, tiny_model: str,
                                                                                   tmp_path) -> None:
    """Progress inside a sample on the CPU server (float32) through the actor's own SGLang body: an answer resumed
    after a crash has transformers' log-probs across the resume point (conftest's check)."""
    from types import SimpleNamespace

    from conftest import assert_a_resumed_answer_is_one_answer
    from pipegen.engines.request import Generation
    from pipegen.engines.sglang import build_request, parse_response

    limits = SimpleNamespace(prompt_length=64, response_length=24, max_model_len=8192, vocab_size=None)
    params = dict(temperature=0.7, top_p=1.0, top_k=-1, repetition_penalty=1.0, logprobs=True)
    assert_a_resumed_answer_is_one_answer(
        tmp_path, tiny_model, PROMPT, params, limits,
        lambda ids, sampling_params, seed: parse_response(
            gen(hf, build_request(Generation.of(ids, sampling_params, limits, seed))), True))

"""Progress inside a sample (actor/continuation.py, run/unit_progress.py): a long answer's tokens kept as a streaming
engine sends them, or generated in chunks each durable before the next is asked; after a crash a unit continues
from its last durable tokens, and a rerun of a multi-turn unit answers the calls it asks as before from the record.

The unit-level tests drive `UnitProgress` with an engine double that answers like SGLang's /generate would (a
deterministic token function of the request, `max_new_tokens`, an end-of-sequence id); the pipeline test SIGKILLs
the real actor of a real run on the CPU server's fake backend.
"""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass
from pathlib import Path

import pytest

from pipegen.engines.request import max_new_tokens_for
from pipegen.actor.continuation import RESUMED, RESUMED_AT_TOKEN, UnitProgress
from pipegen.run.unit_progress import progress_summary, read_calls, tidy

EOS = 2


@dataclass
class Budget:
    prompt_length: int = 64
    response_length: int = 100
    max_model_len: int = 4096
    vocab_size: int | None = 1000


class Engine:
    """Answers a request as a deterministic function of (prompt ids, seed): each next token depends on the ids
    so far, EOS where the function says, `length` at max_new_tokens."""

    def __init__(self, eos_at: int | None = None):
        self.eos_at = eos_at  # the answer ends with EOS at this answer position (counting from the first prompt)
        self.requests: list[tuple[list[int], dict, int | None]] = []
        self.tokens = 0
        self.crash_after: int | None = None  # raise on the request after this many
        self.stream_every = 10  # a streamed request's answer so far goes to its keeper every this many tokens
        self.crash_at_token: int | None = None  # raise once a request generated this many tokens

    async def __call__(self, generation):
        from pipegen.actor.continuation import token_output

        ids, seed, keep = generation.prompt_ids, generation.seed, generation.on_tokens
        params = {**generation.params, "max_new_tokens": generation.max_new_tokens}

        if self.crash_after is not None and len(self.requests) >= self.crash_after:
            raise KeyboardInterrupt("crash")
        self.requests.append((list(ids), dict(params), seed))
        rid = f"rid-{len(self.requests)}"
        out, lps, reason = [], [], "length"
        ctx = list(ids)
        for _ in range(max_new_tokens_for(dict(params), len(ids), Budget())):  # the engine's budget rule
            if self.eos_at is not None and len(ctx) - self.prompt_len == self.eos_at:
                tok = EOS
            else:
                tok = 3 + int(hashlib.blake2b(repr((ctx[-3:], seed)).encode(), digest_size=2).hexdigest(), 16) % 900
            ctx.append(tok)
            out.append(tok)
            lps.append(-tok / 1000)
            if tok == EOS:
                reason = "stop"
                break
            if keep is not None and len(out) % self.stream_every == 0:
                keep(rid, list(out), list(lps))
            if self.crash_at_token is not None and len(out) >= self.crash_at_token:
                self.tokens += len(out)
                raise KeyboardInterrupt("crash")
        self.tokens += len(out)
        return token_output(out, lps, reason)


PARAMS = dict(temperature=1.0, top_p=1.0, top_k=-1, repetition_penalty=1.0, logprobs=True)


def call(progress: UnitProgress, engine: Engine, prompt: list[int], seed: int = 7, **params):
    engine.prompt_len = len(prompt)
    return asyncio.run(progress.generate(engine, prompt, {**PARAMS, **params}, seed))


def test_a_short_answer_is_todays_one_request_and_writes_nothing(tmp_path):
    path = tmp_path / "0-0.jsonl"
    engine = Engine(eos_at=10)  # a budget (response_length=100) within one chunk: today's request, unchanged
    out = call(UnitProgress(path, 128, Budget()), engine, [5, 6, 7])
    assert len(engine.requests) == 1 and engine.requests[0][2] == 7
    assert engine.requests[0][1] == {**PARAMS, "max_new_tokens": 100}  # the budget verl's rule gives, computed once
    assert out.token_ids[-1] == EOS and out.stop_reason == "stop" and len(out.token_ids) == 11
    out = call(UnitProgress(path, 32, Budget()), engine, [5, 6, 7])  # a longer budget, an answer within a chunk
    assert len(engine.requests) == 2 and engine.requests[1][1] == {**PARAMS, "max_new_tokens": 32}
    assert len(out.token_ids) == 11 and out.stop_reason == "stop"
    assert not path.exists()


def test_a_unit_unlinks_a_file_only_where_it_read_or_wrote_one(tmp_path):
    path = tmp_path / "0-0.jsonl"
    progress = UnitProgress(path, 32, Budget())
    assert not progress.file.exists  # nothing read: its end makes no unlink()
    path.write_bytes(b'{"call": 0, "dig')  # a crash tore the only line: no call to continue, but a file to remove
    progress = UnitProgress(path, 32, Budget())
    assert progress.recorded == [] and progress.file.exists
    progress.discard()
    assert not path.exists()


def test_a_long_answer_goes_in_chunks_each_durable_and_stops_as_one_request_would(tmp_path):
    path = tmp_path / "0-0.jsonl"
    engine = Engine(eos_at=None)
    out = call(UnitProgress(path, 32, Budget()), engine, [5, 6, 7])
    # the whole answer's budget is verl's (response_length=100): 32 + 32 + 32 + 4
    assert [r[1]["max_new_tokens"] for r in engine.requests] == [32, 32, 32, 4]
    assert len(out.token_ids) == 100 and out.stop_reason == "length" and len(out.log_probs) == 100
    for k, (ids, _, _) in enumerate(engine.requests):  # each chunk continues from the prompt plus the ids so far
        assert ids == [5, 6, 7] + out.token_ids[:32 * k]
    assert len({r[2] for r in engine.requests}) == 4 and engine.requests[0][2] == 7  # fresh draws per chunk
    calls = read_calls(path)  # three chunks went on and are on disk; the last is the shard line's
    assert len(calls) == 1 and calls[0].ids == out.token_ids[:96] and calls[0].end is None

    eos = Engine(eos_at=40)  # EOS inside the second chunk ends the answer there, as it would end one request
    out = call(UnitProgress(tmp_path / "1-0.jsonl", 32, Budget()), eos, [5, 6, 7])
    assert len(out.token_ids) == 41 and out.token_ids[-1] == EOS and out.stop_reason == "stop"
    assert len(eos.requests) == 2


def test_an_answer_with_a_penalty_over_its_own_tokens_or_stop_strings_goes_in_one_request(tmp_path):
    for extra in ({"repetition_penalty": 1.1}, {"frequency_penalty": 0.5}, {"stop": ["###"]}):
        engine = Engine()
        out = call(UnitProgress(tmp_path / "0-0.jsonl", 32, Budget()), engine, [5, 6, 7], **extra)
        assert len(engine.requests) == 1 and len(out.token_ids) == 100, extra


def test_a_crashed_answer_continues_from_its_last_durable_chunk(tmp_path):
    path = tmp_path / "3-1.jsonl"
    engine = Engine()
    engine.crash_after = 2  # the third chunk's request never comes back
    with pytest.raises(KeyboardInterrupt):
        call(UnitProgress(path, 32, Budget()), engine, [5, 6, 7])
    assert progress_summary(tmp_path) == (1, 64)
    durable = read_calls(path)[0].ids

    engine = Engine()
    progress = UnitProgress(path, 32, Budget())
    out = call(progress, engine, [5, 6, 7])
    assert [len(r[0]) for r in engine.requests] == [3 + 64, 3 + 96]  # only what was not durable is generated
    assert engine.tokens == 36 and len(out.token_ids) == 100
    assert out.token_ids[:64] == durable
    assert progress.row_fields() == {RESUMED: True, RESUMED_AT_TOKEN: 64, "replayed_calls": 0}
    progress.discard()
    assert not path.exists()


def test_a_streamed_answer_keeps_its_tokens_as_they_come_and_continues_from_them(tmp_path):
    path = tmp_path / "2-0.jsonl"
    engine = Engine()
    engine.crash_at_token = 45  # killed after its answer so far reached the unit 4 times (every 10 tokens)
    with pytest.raises(KeyboardInterrupt):
        call(UnitProgress(path, 32, Budget(), streams=True), engine, [5, 6, 7])
    # one request for the whole answer (verl's budget: 100), not chunks of 32
    assert [r[1]["max_new_tokens"] for r in engine.requests] == [100]
    assert progress_summary(tmp_path) == (1, 40)
    durable = read_calls(path)[0].ids

    engine = Engine()
    progress = UnitProgress(path, 32, Budget(), streams=True)
    out = call(progress, engine, [5, 6, 7])
    assert [(len(r[0]), r[1]["max_new_tokens"]) for r in engine.requests] == [(3 + 40, 60)]
    assert engine.tokens == 60 and len(out.token_ids) == 100 and len(out.log_probs) == 100
    assert out.token_ids[:40] == durable and out.stop_reason == "length"
    assert progress.row_fields() == {RESUMED: True, RESUMED_AT_TOKEN: 40, "replayed_calls": 0}

    engine = Engine(eos_at=5)  # a short answer is one request, unstreamed, as today
    call(UnitProgress(tmp_path / "4-0.jsonl", 128, Budget(), streams=True), engine, [5, 6, 7])
    assert len(engine.requests) == 1 and not (tmp_path / "4-0.jsonl").exists()


def test_a_resent_streamed_request_supersedes_what_its_failed_attempt_kept(tmp_path):
    path = tmp_path / "0-0.jsonl"

    async def send(generation):
        keep = generation.on_tokens
        keep("first", [11, 12, 13], [-0.1, -0.2, -0.3])
        keep("first", [11, 12, 13, 14, 15], [-0.1, -0.2, -0.3, -0.4, -0.5])
        keep("second", [21, 22], [-0.6, -0.7])  # the client re-sent the request: its answer starts again
        raise KeyboardInterrupt("killed")

    with pytest.raises(KeyboardInterrupt):
        asyncio.run(UnitProgress(path, 32, Budget(), streams=True).generate(send, [5, 6, 7], PARAMS, 7))
    [kept] = read_calls(path)
    assert kept.ids == [21, 22] and kept.logprobs == [-0.6, -0.7] and kept.end is None


def test_a_rerun_answers_recorded_calls_from_the_record_until_one_differs(tmp_path):
    path = tmp_path / "0-0.jsonl"
    engine = Engine(eos_at=5)
    progress = UnitProgress(path, 32, Budget())
    a = call(progress, engine, [5, 6, 7])
    b = call(progress, engine, [5, 6, 7, *a.token_ids, 50])  # the second call writes the first
    c = call(progress, engine, [5, 6, 7, *a.token_ids, 50, *b.token_ids, 60])  # ... and this one the second
    assert len(read_calls(path)) == 2 and len(engine.requests) == 3

    engine = Engine(eos_at=5)  # the rerun: same first two calls, a different third
    rerun = UnitProgress(path, 32, Budget())
    a2 = call(rerun, engine, [5, 6, 7])
    b2 = call(rerun, engine, [5, 6, 7, *a.token_ids, 50])
    assert (a2.token_ids, a2.log_probs, b2.token_ids, b2.log_probs) == (a.token_ids, a.log_probs, b.token_ids,
                                                                        b.log_probs)
    assert engine.requests == []  # no engine work for the recorded calls
    call(rerun, engine, [5, 6, 7, *a.token_ids, 50, *b.token_ids, 61])
    assert len(engine.requests) == 1 and rerun.replayed == 2 and rerun.row_fields()["replayed_calls"] == 2

    engine = Engine(eos_at=5)  # a first call that differs drops the record and goes live from there
    other = UnitProgress(path, 32, Budget())
    call(other, engine, [5, 6, 8])
    assert len(engine.requests) == 1 and not path.exists() and not other.resumed


def test_tidy_drops_the_progress_of_done_units_only(tmp_path):
    for name in ("1-0.jsonl", "2-1.jsonl", "notes.txt"):
        (tmp_path / name).write_text('{"call":0,"digest":"d","ids":[1,2],"logprobs":null,"end":null}\n')
    assert progress_summary(tmp_path) == (2, 4)
    assert tidy(tmp_path, lambda i, s: (i, s) == (1, 0)) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["2-1.jsonl", "notes.txt"]


# ------------------------------------------------------------------------------ a real run, its actor SIGKILLed


@pytest.mark.slow
def test_killed_actors_continue_long_answers_from_their_streamed_tokens(tmp_path):
    """The bench's `resume` scenario (pipegen/bench/partial_progress.py) at a cheap size, with the default settings:
    answers past actors.progress_chunk_tokens are streamed from the CPU server and their tokens kept as they come;
    a SIGKILL while the actor generates, and the restart continues the units from their kept tokens. `python -m
    pipegen.bench --only resume` measures it with 5 kills and 2,000-token answers (BENCHMARKS.md)."""
    from conftest import assert_verified, load_trajectories
    from pipegen.bench.partial_progress import crash_run

    answer = 1200  # past the default actors.progress_chunk_tokens (1,024)
    figures = crash_run(tmp_path, units=4, answer_tokens=answer, chunk_tokens=None, kills=1, token_latency=0.002,
                        seed=1)
    out = tmp_path / "run"
    assert_verified(out)  # every unit exactly once; no committed unit keeps progress (status --verify)
    data = load_trajectories(out / "trajectories.pkl")  # verl's own reader
    units = sorted(zip(map(int, data.non_tensor_batch["index"]), map(int, data.non_tensor_batch["sample"])))
    assert len(units) == len(set(units)) == 4
    assert (data.batch["response_mask"].sum(-1) == answer).all()  # the whole answer, as an uninterrupted one
    assert figures.resumed_rows >= 1
    resumed = [r for r, at in zip(data.non_tensor_batch["resumed"], data.non_tensor_batch["resumed_at_token"]) if r]
    assert resumed and all(0 < at < answer for at in data.non_tensor_batch["resumed_at_token"] if at is not None)
    assert figures.ratio <= 1.10, figures
    assert not list((out / "streams" / "progress").glob("*.jsonl"))


@pytest.mark.slow
def test_a_tool_loop_killed_mid_session_answers_its_recorded_turns_from_the_record(tmp_path, tiny_model):
    """verl's tool loop against the scripted fake server (two calculator calls, then the answer; the script of
    test_agent_loops.py): the actor is SIGKILLed once every unit is in its third model call, the launcher
    restarts it, and the rerun answers each unit's first two calls from its record (the recording proxy sees
    each of them once), then asks the engine for the third. The rows are token-exact (the sampled tokens and
    log-probs are what the engine answered for the three calls) and verl reads them."""
    import json

    import torch

    from conftest import assert_verified, launch_killing_the_actor, load_trajectories
    from fake_servers import FakeServer, RecordingProxy, write_dataset
    from pipegen.engines.request import turn_seed
    from pipegen.run.stream import unit_seed
    from test_agent_loops import QUESTIONS, SCRIPT, tool_overrides

    script = tmp_path / "script.json"
    script.write_text(json.dumps(SCRIPT))
    server = FakeServer("scripted", tmp_path, tiny_model, "--script", str(script), "--slots", "16",
                        "--token-latency", "0.08").wait_ready()
    proxy = RecordingProxy("proxy", tmp_path, server.url).wait_ready()
    data = write_dataset(tmp_path / "questions.parquet", [{"content": q} for q in QUESTIONS])
    out = tmp_path / "run"
    overrides = tool_overrides(tiny_model, data, "n=1", "seed=3", "generation.save_batch_size=1000",
                               "generation.partial_batch_quiet_s=60", "llm=external", f"llm.urls=[{proxy.url}]")
    # a unit's calls by its turns' seeds (each turn's own, derived from the unit's: turn_seed)
    unit_of = {turn_seed(unit_seed(3, i, 0), t): i for i in range(len(QUESTIONS)) for t in range(3)}

    def third_calls() -> bool:  # every unit has its first two calls answered: its third call is on its way
        answered = [unit_of[e["seed"]] for e in proxy.entries() if e["status"] == 200]
        return all(answered.count(i) >= 2 for i in range(len(QUESTIONS)))

    try:  # the calculator answers at once; the third call (8 tokens) takes ~0.6 s
        returncode, stderr = launch_killing_the_actor(out, overrides, third_calls, settle=0.3)
    finally:
        entries = proxy.entries()  # the engine's log of what it was asked and answered
        for process in (proxy, server):
            process.stop()
    assert returncode == 0, stderr[-3000:]
    assert (out / "logs" / "actor_0.log").read_text().count("starting actor_0") == 2
    assert_verified(out)
    rows = load_trajectories(out / "trajectories.pkl")  # verl's own reader

    calls: dict[int, list[dict]] = {}
    for e in sorted(entries, key=lambda e: e["t"]):
        if e["status"] == 200:
            calls.setdefault(unit_of[e["seed"]], []).append(e)
    nt = rows.non_tensor_batch
    resumed = 0
    for i, index in enumerate(map(int, nt["index"])):
        turns = sorted({len(e["input_ids"]): e for e in calls[index]}.values(), key=lambda e: len(e["input_ids"]))
        assert len(turns) == 3
        # a resumed unit's third call carries the seed it carried in the life that was killed
        assert [e["seed"] for e in turns] == [turn_seed(unit_seed(3, index, 0), t) for t in range(3)]
        # the first two calls reached the engine once, whether or not the unit was resumed
        for turn in turns[:2]:
            assert sum(e["input_ids"] == turn["input_ids"] for e in calls[index]) == 1
        if nt["resumed"][i]:
            resumed += 1
            assert nt["replayed_calls"][i] == 2 and nt["resumed_at_token"][i] == 0
        mask = rows.batch["response_mask"][i].bool()
        sampled = rows.batch["responses"][i][mask].tolist()
        assert sampled == [t for turn in turns for t in turn["output_ids"]]
        logprobs = torch.tensor([lp for turn in turns for lp in turn["logprobs"]], dtype=torch.float32)
        assert torch.equal(rows.batch["rollout_log_probs"][i][mask], logprobs)
    assert resumed >= 1

"""Scenario `resume`: what SIGKILLed actors cost with long answers, with the answers' progress kept on disk
(`actors.progress_chunk_tokens`, actor/continuation.py) and without it (0: a killed unit starts again from scratch),
and what keeping it costs a run that is never killed.

The real launcher runs against pipegen's CPU server with the fake model backend (no EOS, so every answer is the
whole `max_response_length`; a fixed per-token latency): the actor is SIGKILLed at random moments while it
generates, the launcher restarts it each time, and at the end the server's count of tokens it generated is
divided by the tokens in the output. `crash_run` is also what tests/test_partial_progress.py runs at a cheap size.

Owns: the kill schedule and the figures (the kill ratio off and at the default; the cost of the default in runs
nobody kills). Must never: assert a timing.
"""

from __future__ import annotations

import os
import random
import shlex
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipegen.bench import common as c

KEY = "resume"
TITLE = "Long answers under SIGKILLed actors: tokens generated ÷ tokens kept, progress kept vs not"


@dataclass
class CrashFigures:
    generated: int  # tokens the server generated, the killed requests' included
    kept: int  # response tokens in trajectories.pkl
    kills: int
    units: int
    wall_s: float
    resumed_rows: int  # rows whose unit continued from its record

    @property
    def ratio(self) -> float:
        return self.generated / max(1, self.kept)


def actor_pids(out: Path) -> list[int]:
    """The pids of this run's actors (matched on their exact command line, never by a broad name)."""
    want = [b"pipegen.actor", f"output_dir={out}".encode()]
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            argv = [a for a in Path(entry.path, "cmdline").read_bytes().split(b"\0") if a]
        except OSError:
            continue
        if len(argv) == 1:  # a forked role carries its command as one process title (launch/forks.py)
            argv = [w.encode() for w in shlex.split(argv[0].decode(errors="replace"))]
        if all(w in argv for w in want):
            pids.append(int(entry.name))
    return pids


def overrides(units: int, answer_tokens: int, chunk_tokens: int | None, restarts: int) -> list[str]:
    """The launch's keys; chunk_tokens None leaves actors.progress_chunk_tokens out (a pipegen before it: the
    same scenario measured on that code, with PYTHONPATH pointing at it)."""
    chunking = [] if chunk_tokens is None else [f"actors.progress_chunk_tokens={chunk_tokens}"]
    return [f"max_samples={units}", "n=1", f"max_response_length={answer_tokens}", "max_prompt_length=256",
            f"actors.concurrency={units}", *chunking, f"generation.restart_limit={restarts}",
            "generation.show_progress=false", "generation.report=false", "generation.upload_artifact=false",
            "actors.stats_interval_s=0.5", "seed=5"]


def crash_run(folder: Path, *, units: int, answer_tokens: int, chunk_tokens: int | None, kills: int,
              token_latency: float, seed: int = 0, timeout_s: float = 300) -> CrashFigures:
    """One run under `kills` SIGKILLs of its actor, each at a random moment while the server generates for it."""
    from verl import DataProto

    rng = random.Random(seed)
    out = folder / "run"
    args = c.fake_backend_args(slots=units, eos_prob=0.0, token_latency=token_latency)
    with c.reference_server(folder, args) as server:
        log = open(folder / "launch.log", "wb")
        t0 = time.perf_counter()
        proc = subprocess.Popen(c.launcher_command(out, server.url, *overrides(units, answer_tokens, chunk_tokens,
                                                                                 kills + 2)),
                                cwd=c.REPO, stdout=log, stderr=subprocess.STDOUT)
        try:
            killed: set[int] = set()  # pids tried
            made = 0  # kills that landed
            while made < kills:
                pid = wait_for(lambda: next((p for p in actor_pids(out) if p not in killed), None), proc, timeout_s)
                before = c.server_stats(server.url)["requests_total"]
                # a random moment while it generates: once this actor's first requests reached the server
                wait_for(lambda: c.server_stats(server.url)["requests_total"] > before or None, proc, timeout_s)
                # within its share of one answer's time, so every kill lands while the answers are unfinished
                time.sleep(rng.uniform(0.2, 0.8) * answer_tokens * token_latency / (kills + 1))
                try:
                    os.kill(pid, signal.SIGKILL)
                    made += 1
                except ProcessLookupError:  # it had ended: no kill
                    pass
                killed.add(pid)
            proc.wait(timeout_s)
        finally:
            c.stop_process(proc)
            log.close()
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            raise RuntimeError(f"launcher exited {proc.returncode}; log {log.name}")
        generated = int(c.server_stats(server.url)["engine_tokens_generated"])
    data = DataProto.load_from_disk(str(out / "trajectories.pkl"))
    kept = int(data.batch["response_mask"].sum())
    resumed = data.non_tensor_batch.get("resumed")
    return CrashFigures(generated, kept, made, len(data), wall,
                        0 if resumed is None else sum(1 for r in resumed if r))


def wait_for(probe, proc: subprocess.Popen, timeout_s: float):
    """probe()'s first value that is not None, polled while the launcher runs."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        value = probe()
        if value is not None:
            return value
        if proc.poll() is not None:
            raise RuntimeError(f"the launcher ended (exit {proc.returncode}) before the kill")
        time.sleep(0.02)
    raise RuntimeError("timed out waiting for the actor")


@dataclass
class ChunkedSpec:
    """The e2e scenario's actor run (bench/end_to_end.py's RunSpec) with actors.progress_chunk_tokens set (None:
    left at its default)."""

    base: Any
    chunk_tokens: int | None

    def overrides(self) -> list[str]:
        chunking = [] if self.chunk_tokens is None else [f"actors.progress_chunk_tokens={self.chunk_tokens}"]
        return [*self.base.overrides(), *chunking]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.base, name)


def cost_pairs(tmp: Path, base: Any, reps: int, token_latency: float = 0.0) -> dict[str, dict[str, list[float]]]:
    """The e2e actor in this process, progress kept at the default vs off (0), alternated on one fake server:
    per label its rates (samples/s, first to last line) and the actor's and the server's CPU per unit."""
    from pipegen.bench.end_to_end import process_cpu_s, run_actor, steady_rate

    figures: dict[str, dict[str, list[float]]] = {k: {"rate": [], "actor": [], "server": []} for k in ("on", "off")}
    args = c.fake_backend_args(slots=4096, eos_prob=0, token_latency=token_latency)
    with c.reference_server(tmp / "srv", args) as server:
        for i, label in enumerate((["on", "off", "off", "on"] * reps)[: 2 * reps]):
            before = process_cpu_s(server.proc.pid)
            arrivals, run, actor_cpu = run_actor(tmp / f"run_{i}", server.url,
                                                 ChunkedSpec(base, None if label == "on" else 0))
            units = len(arrivals)
            figures[label]["rate"].append(steady_rate(arrivals))
            figures[label]["actor"].append(actor_cpu)
            figures[label]["server"].append((process_cpu_s(server.proc.pid) - before) / units)
    return figures


def cost_row(res: c.ScenarioResult, what: str, figures: dict[str, dict[str, list[float]]], note: str) -> None:
    on, off = figures["on"], figures["off"]
    pairs = list(zip(on["rate"], off["rate"]))
    ms = lambda xs: f"{c.median(xs) * 1e3:.2f}"  # noqa: E731
    res.add(c.Row(what, c.median([a / b for a, b in pairs]), "actor samples/s, progress kept ÷ not", "≥ 0.97",
                  raw=f"kept {c.fmt_rate(c.median(on['rate']), ' samples/s')}, not kept "
                      f"{c.fmt_rate(c.median(off['rate']), ' samples/s')}; {len(pairs)} pairs alternated; CPU per "
                      f"unit kept vs not: actor {ms(on['actor'])} vs {ms(off['actor'])} ms, server "
                      f"{ms(on['server'])} vs {ms(off['server'])} ms; {note}"))


def persistence_cost(res: c.ScenarioResult, tmp: Path, reps: int) -> None:
    """What keeping progress at its default costs a run nobody kills, on the e2e scenario's actor: at the e2e row's
    1,024-token answers (within the threshold: nothing streamed or written), and at answers twice the threshold,
    streamed, on the instant fake server (an answer's tokens come faster than the server's stream timer: one chunk)
    and on a fake with per-token latency (a chunk and a line every 50 ms of each answer)."""
    from pipegen.bench.end_to_end import RunSpec
    from pipegen.config.schema import Actors

    chunk = Actors.progress_chunk_tokens
    cost_row(res, f"e2e actor at the e2e row's 1,024-token answers (instant fake server): progress kept "
                  f"(default, actors.progress_chunk_tokens={chunk}) vs off (0)",
             cost_pairs(tmp / "one", RunSpec(1024, n=4, concurrency=64), reps),
             "384 units; an answer within the threshold is one request, unstreamed, and writes nothing")
    cost_row(res, f"e2e actor, {2 * chunk}-token answers, streamed (instant fake server)",
             cost_pairs(tmp / "two", RunSpec(2 * chunk, n=2, concurrency=64), reps),
             "192 units; each answer one streamed request (the server streams every 50 ms: one chunk here)")
    latency = 0.001
    cost_row(res, f"the same with {latency * 1e3:.0f} ms a token (a fake engine with per-token latency)",
             cost_pairs(tmp / "slow", RunSpec(2 * chunk, n=2, concurrency=64), reps, token_latency=latency),
             "192 units, 64 in flight; each answer ~40 chunks, each one line")


def chunk_cost_s(tokens_per_chunk: int, chunks: int = 64, reps: int = 20) -> float:
    """Seconds of the actor's CPU one streamed chunk costs from its bytes to its kept line: SSE split and parse
    (engines/sglang.py's `sse_chunks`, an incremental chunk of `tokens_per_chunk` ids and log-prob triples),
    `StreamedAnswer.add`, and the unit's keeper writing it (continuation.py's `_keeper`); the best of `reps`."""
    import asyncio
    import tempfile
    from types import SimpleNamespace

    import orjson

    from pipegen.actor.continuation import UnitProgress
    from pipegen.engines.sglang import StreamedAnswer, sse_chunks

    events = []
    for k in range(chunks):
        ids = list(range(1000 + k * tokens_per_chunk, 1000 + (k + 1) * tokens_per_chunk))
        meta = {"id": "x", "finish_reason": None, "completion_tokens": (k + 1) * tokens_per_chunk,
                "output_token_logprobs": [[-0.123456789, t, None] for t in ids], "prompt_tokens": 10}
        events.append(b"data: " + orjson.dumps({"output_ids": ids, "meta_info": meta, "index": 3}) + b"\n\n")

    class Body:  # what sse_chunks reads of aiohttp's response: one network read per event
        content_type = "text/event-stream"

        def __init__(self):
            self.content = SimpleNamespace(iter_any=self.iter_any)

        async def iter_any(self):
            for event in events:
                yield event

    limits = SimpleNamespace(prompt_length=64, response_length=4096, max_model_len=8192, vocab_size=None)

    async def one(path) -> float:
        progress = UnitProgress(path, 1024, limits, streams=True)
        keep, answer = progress._keeper(0, "digest", 0), StreamedAnswer(True)
        t0 = time.process_time()
        async for chunk in sse_chunks(Body()):
            answer.add(chunk)
            keep("rid", answer.ids, answer.logprobs)
        took = time.process_time() - t0
        progress.discard()
        return took / chunks

    with tempfile.TemporaryDirectory() as tmp:
        return min(asyncio.run(one(Path(tmp) / f"{r}.jsonl")) for r in range(reps))


def keeping_cost(res: c.ScenarioResult) -> None:
    """The cost of keeping a streamed answer's tokens, per chunk, as a share of one actor core at 20k tokens/s (a GPU
    node's rate for one actor): chunks come every `keep_every_s` (actor/supervision.py) of generation, never more
    often than every `STREAM_MIN_TOKENS` tokens, so 20k tokens/s is at most 20k / STREAM_MIN_TOKENS chunks a second."""
    from pipegen.engines.sglang import STREAM_MIN_TOKENS

    for tokens in (STREAM_MIN_TOKENS, 4 * STREAM_MIN_TOKENS):
        per_chunk = chunk_cost_s(tokens)
        share = per_chunk * 20_000 / tokens
        res.add(c.Row(f"keeping a streamed answer's tokens: chunks of {tokens} tokens (incremental, with log-probs) "
                      f"at 20k tokens/s", share, "share of one actor core", "≤ 0.02" if tokens == STREAM_MIN_TOKENS
                      else "", raw=f"{per_chunk * 1e6:.1f} µs of CPU a chunk (SSE parse, StreamedAnswer, the kept "
                                   f"line), {20_000 / tokens:.0f} chunks/s"))


def run(quick: bool) -> c.ScenarioResult:
    res = c.ScenarioResult(KEY, TITLE)
    # 5 ms a token is 200 tokens/s a sequence, four times the ~50 a GPU gives one sequence of a long answer
    units, answer, latency, kills = (8, 2000, 0.005, 5) if quick else (16, 2000, 0.005, 6)
    fast = 0.001  # and 1,000 tokens/s: a kill's fixed costs in time weigh 5 times more in tokens
    figures = {}
    for label, tokens, lat in (("off", 0, latency), ("default", None, latency), ("fast", None, fast)):
        with c.scratch(f"resume-{label}") as tmp:
            figures[label] = crash_run(tmp, units=units, answer_tokens=answer, chunk_tokens=tokens, kills=kills,
                                       token_latency=lat)
    from pipegen.config.schema import Actors

    kept = (f"progress kept at the default (actors.progress_chunk_tokens={Actors.progress_chunk_tokens}: a longer "
            f"answer streamed, its tokens kept as they come)")
    names = {"off": "progress not kept (actors.progress_chunk_tokens=0: one request an answer, a killed unit starts "
                    f"again), {latency * 1e3:.0f} ms a token",
             "default": f"{kept}, {latency * 1e3:.0f} ms a token",
             "fast": f"{kept}, {fast * 1e3:.0f} ms a token"}
    for label, f in figures.items():
        res.add(c.Row(f"{names[label]}: {f.units} units of {answer} tokens, {f.kills} actor SIGKILLs",
                      f.ratio, "tokens generated ÷ tokens in the output", "≤ 1.10" if label == "default" else "",
                      raw=f"{f.generated} generated, {f.kept} kept, {f.resumed_rows} rows resumed, "
                          f"{c.fmt_s(f.wall_s)}"))
    keeping_cost(res)
    # the cost of keeping progress in a run nobody kills: the e2e scenario's actor, default vs off
    with c.scratch("resume-cost") as tmp:
        persistence_cost(res, tmp, 2 if quick else 3)
    res.notes.append("Each kill lands at a random moment, 20-80% of 1/(kills+1) of one answer's time after the "
                     "restarted actor's first request reaches the server; the launcher restarts the actor each time. "
                     "A kill costs each unit in flight what the server generated after the last chunk the actor "
                     "kept (the CPU server streams every 50 ms) and until it saw the connection close (the kernel "
                     "closes a killed actor's sockets after freeing its memory: ~35 ms here): a time, so the faster "
                     "the tokens, the more tokens. pipegen's CPU server streams: an engine that does not (vLLM) "
                     "keeps a long answer in chunks of actors.progress_chunk_tokens instead.")
    return res

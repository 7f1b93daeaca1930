"""Scenario `longtail`: what pipegen's request supervision costs an engine whose answers have a long tail, with
no fault at all: the engine's tokens thrown away, and the time lost against the engine's own bound.

    python -m pipegen.bench --only longtail [--quick]

The server is the fake SGLang (pipegen/bench/doubles/fake_sglang.py) made GPU-like: a batched decode loop whose
step takes STEP_MS + PER_RUNNING_MS x running and gives each of at most MAX_RUNNING running members a token;
answer lengths drawn from a lognormal (median, sigma) per (prompt, seed), cut at the budget
(`max_response_length`), so a few answers run to the budget while most end early; chunks incremental, as pipegen
starts SGLang. The real launcher runs against it (`llm=external`, as bench/grouping.py does) with the shipped
defaults: hedging, the stall watchdog, auto concurrency, grouping and kept progress as shipped; one fake, and a
variant with two.

Figures (each a ratio within one run):
- tokens generated ÷ tokens kept: generated = the fakes' `output_tokens` (every token their schedulers made,
  aborted members' and hedge copies' included), kept = the response tokens of the merged trajectories.pkl (verl's
  DataProto, `response_mask`); target ≤ 1.02;
- makespan ÷ ideal: makespan = the fakes' first member received → last answer sent; ideal =
  max(W ÷ (S x C), T_L), with W the kept tokens, S the fakes, C = MAX_RUNNING ÷ (STEP_MS + PER_RUNNING_MS x
  MAX_RUNNING) a fake's capacity in tokens per ms at a full batch (its step model's best), and T_L the longest
  answer's own generation time, its first step to its last, as the fake ran it (`longest_own_s`: the steps of the
  batch it shared; the issue's "longest answer's own generation time"). The row also states L x (STEP_MS +
  PER_RUNNING_MS), the longest answer alone in the batch, which no run with other work beside it reaches. Target
  ≤ 1.05;
- idle GPU-seconds in the tail: the run's own measure (the closing line's `tail:`, actor/concurrency.py's
  TailMeter), slots idle while fewer answers than a full batch remained;
- the group-correlated cases (`grouped`: the fake's per-prompt lognormal median, σ 1.0, samples σ 0.3 around it; 16
  slots at 5 ms a token; 64 prompts), n = 4 and n = 1, one and two fakes, 4k and 16k budgets; the last n = 1 case
  reads the case before it as its earlier run (`actors.lengths_from`);
- beside them: /generate HTTP requests, members aborted and /abort_request calls (the fakes'), and the actors'
  stalled, hedges and hedge tokens (their stats lines).

Owns: the scenario's settings and rows. Must never: assert a timing or raise on a missed target (a missed target
is reported in the table), or leave a server or launcher running when it returns.
"""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from pipegen.bench import common as c
from pipegen.launch.servers import ServerProcess

KEY = "longtail"
TITLE = "Long-tailed answers, GPU-like fake SGLang, no fault: tokens generated ÷ kept, makespan ÷ ideal (CPU)"
TARGET_TOKENS = "≤ 1.02"
TARGET_MAKESPAN = "≤ 1.05"
FRONT_MS, ITEM_MS = 1.25, 0.02  # the H100's front-end cost per HTTP request and per member (bench/grouping.py)


@dataclass(frozen=True)
class Engine:
    """The GPU-like fake's step model and length draw."""

    step_ms: float
    per_running_ms: float
    max_running: int
    median: float
    sigma: float
    sample_sigma: float = 0.0  # > 0: group-correlated lengths (a median per prompt, each sample around it)

    @property
    def lengths(self) -> str:
        """The fake's --lengths."""
        if self.sample_sigma > 0:
            return f"grouped:{self.median:g}:{self.sigma:g}:{self.sample_sigma:g}"
        return f"lognormal:{self.median:g}:{self.sigma:g}"

    @property
    def tokens_per_ms(self) -> float:
        """A fake's capacity: a full batch's tokens per step ÷ that step's time (throughput grows with the batch)."""
        return self.max_running / (self.step_ms + self.per_running_ms * self.max_running)

    def alone_s(self, tokens: int) -> float:
        """An answer's own generation time: one step a token, itself alone in the batch."""
        return tokens * (self.step_ms + self.per_running_ms) / 1000.0

    def describe(self) -> str:
        lengths = (f"lengths lognormal (median {self.median:g}, σ {self.sigma:g})" if self.sample_sigma <= 0 else
                   f"group-correlated lengths (per-prompt lognormal median around {self.median:g}, σ {self.sigma:g}; "
                   f"samples σ {self.sample_sigma:g} around it)")
        return f"steps of {self.step_ms:g} ms + {self.per_running_ms:g} ms × running (≤ {self.max_running}), {lengths}"


@dataclass(frozen=True)
class Case:
    name: str
    prompts: int
    n: int
    budget: int  # max_response_length
    servers: int
    engine: Engine
    overrides: tuple[str, ...] = ()  # launcher overrides of this case (the shipped defaults otherwise)
    earlier: bool = False  # n=1 with the lengths of the case before it (same prompts): actors.lengths_from=<its run>


@dataclass
class Figures:
    case: Case
    units: int
    generated: int
    kept: int
    longest: int
    makespan_s: float
    generate_calls: int
    aborted: int
    abort_requests: int
    chunks: int
    member_seconds: float  # the fakes' running members integrated over their clocks
    max_running_seen: int  # the most members one fake ran at once
    actors: dict[str, int]  # summed over actors: stalled, aborts_sent, hedges, hedge_wins, hedge_tokens
    wall_s: float
    longest_own_s: float  # the longest answer's own generation time, as a fake ran it
    tail: dict[str, float]  # the run's own tail measure (observe/stats.py's tail_metrics: tail/idle_gpu_s, ...)

    @property
    def ideal_s(self) -> float:
        e = self.case.engine
        return max(self.kept / (self.case.servers * e.tokens_per_ms) / 1000.0, self.longest_own_s)

    @property
    def tokens_ratio(self) -> float:
        return self.generated / max(1, self.kept)

    @property
    def makespan_ratio(self) -> float:
        return self.makespan_s / self.ideal_s


QUICK_ENGINE = Engine(step_ms=2.0, per_running_ms=0.05, max_running=32, median=300, sigma=1.0)
FULL_ENGINE = Engine(step_ms=4.0, per_running_ms=0.03, max_running=128, median=300, sigma=1.2)
# the group-correlated fake: 16 slots at 5 ms a token (no batch cost), per-prompt medians σ 1.0, samples σ 0.3
GROUPED_ENGINE = Engine(step_ms=5.0, per_running_ms=0.0, max_running=16, median=300, sigma=1.0, sample_sigma=0.3)
GROUPED = [Case("grouped n=4 4k", 64, 4, 4096, 1, GROUPED_ENGINE),
           Case("grouped n=4 16k", 64, 4, 16384, 1, GROUPED_ENGINE),
           Case("grouped n=4 4k, two fakes", 64, 4, 4096, 2, GROUPED_ENGINE),
           Case("grouped n=1 4k", 64, 1, 4096, 1, GROUPED_ENGINE),
           Case("grouped n=1 4k, earlier lengths", 64, 1, 4096, 1, GROUPED_ENGINE, earlier=True)]
CASES = {
    "quick": [Case("4k", 96, 4, 4096, 1, QUICK_ENGINE), Case("4k, two fakes", 96, 4, 4096, 2, QUICK_ENGINE),
              *GROUPED],
    "full": [Case("4k", 96, 32, 4096, 1, FULL_ENGINE), Case("16k", 96, 32, 16384, 1, FULL_ENGINE),
             Case("4k, two fakes", 96, 32, 4096, 2, FULL_ENGINE), *GROUPED],
}
EXTRA: list[str] = []  # launcher overrides for every case (`python -m pipegen.bench.longtail KEY=VALUE ...`)
ACTOR_KEYS = ("stalled", "aborts_sent", "hedges", "hedge_wins", "hedge_tokens")


def fake_sglang(folder: Path, name: str, engine: Engine, vocab: int, context_length: int,
                *extra: str) -> ServerProcess:
    """A GPU-like fake SGLang on a free loopback port, answering when it returns."""
    port_file = folder / f"{name}.port"
    argv = [sys.executable, "-m", "pipegen.bench.doubles.fake_sglang", "--port", "0", "--port-file", str(port_file),
            "--front-ms", str(FRONT_MS), "--item-ms", str(ITEM_MS), "--step-ms", str(engine.step_ms),
            "--step-ms-per-running", str(engine.per_running_ms), "--max-running", str(engine.max_running),
            "--lengths", engine.lengths, "--incremental-streaming-output",
            "--vocab", str(vocab), "--context-length", str(context_length), *extra]
    return ServerProcess(argv, folder / f"{name}.log", port_file=port_file, cwd=c.REPO).start().wait_ready(60)


def long_context_model(folder: Path, context: int) -> str:
    """The tiny test model, or a copy of it whose config allows `context` positions (the actor takes its limit
    from the model's config with llm=external; the 16k case needs more than the tiny model's 8,192)."""
    import json
    import shutil

    model = Path(c.tiny_model())
    config = json.loads((model / "config.json").read_text())
    if int(config.get("max_position_embeddings") or 0) >= context:
        return str(model)
    copy = folder / "model"
    if not copy.exists():
        shutil.copytree(model, copy)
        config["max_position_embeddings"] = context
        (copy / "config.json").write_text(json.dumps(config, indent=2))
    return str(copy)


def slug_of(case: Case) -> str:
    return case.name.replace(" ", "_").replace(",", "").replace("=", "")


def run_case(folder: Path, case: Case, *overrides: str) -> Figures:
    """One launch of `case` against fresh fakes; the figures from the fakes' counters, the output and the actors'
    stats lines."""
    from pipegen.bench.doubles.tiny_models import MODEL_VOCAB_SIZE

    prompt_room = 512
    context = prompt_room + case.budget + 8
    slug = slug_of(case)
    servers = [fake_sglang(folder, f"{slug}_{k}", case.engine, MODEL_VOCAB_SIZE, context)
               for k in range(case.servers)]
    out = folder / f"run_{slug}"
    try:
        urls = ",".join(s.url for s in servers)  # launcher_command's `llm.urls=[...]` takes a list
        cmd = c.launcher_command(out, urls, "train_files=demo", f"max_samples={case.prompts}",
                                 f"n={case.n}", f"max_response_length={case.budget}",
                                 f"max_prompt_length={prompt_room}",
                                 "llm.protocol=sglang", "generation.show_progress=false", *case.overrides,
                                 *overrides,
                                 model=long_context_model(folder, context))
        t0 = time.perf_counter()
        result = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL, cwd=c.REPO)
        wall = time.perf_counter() - t0
        if result.returncode != 0:
            raise RuntimeError(f"launcher failed (rc {result.returncode}): {result.stderr[-2000:]}")
        stats = [c.get_json(f"{s.url}/fake_stats") for s in servers]
    finally:
        for s in servers:
            s.stop()
    units, kept, longest = c.kept_response_tokens(out)
    from pipegen.observe.stats import actor_lines, latest_stats, tail_metrics
    from pipegen.run.layout import RunDir

    tail = tail_metrics(list(actor_lines(latest_stats(RunDir(out).stats)).values()))
    actors = {k: sum(int(getattr(a, k, 0) or 0) for a in c.actor_stats(out)) for k in ACTOR_KEYS}
    return Figures(case, units, sum(s["output_tokens"] for s in stats), kept, longest,
                   max(s["last_answer_t"] or 0.0 for s in stats)  # a fake that got nothing has no times
                   - min(s["first_item_t"] for s in stats if s["first_item_t"] is not None),
                   sum(s["http_requests"] for s in stats), sum(s["aborted"] for s in stats),
                   sum(s["abort_requests"] for s in stats), sum(s["chunks"] for s in stats),
                   sum(s["member_seconds"] for s in stats), max(s["max_running_seen"] for s in stats), actors, wall,
                   max(s["longest_own_s"] for s in stats), tail)


def add_rows(res: c.ScenarioResult, f: Figures) -> None:
    case = f.case
    setup = (f"{f.units} units ({case.prompts} demo prompts × {case.n}), budget {case.budget:,}, "
             f"{case.servers} fake{'s' if case.servers > 1 else ''}: {case.engine.describe()}")
    res.add(c.Row(f"{case.name}: tokens the engine generated ÷ tokens kept", f.tokens_ratio,
                  "fakes' output_tokens ÷ response tokens in trajectories.pkl", TARGET_TOKENS,
                  raw=(f"{f.generated:,} generated, {f.kept:,} kept (longest {f.longest:,}); {f.generate_calls:,} "
                       f"/generate requests, {f.aborted} members aborted, {f.abort_requests} /abort_request; actors: "
                       f"stalled {f.actors['stalled']}, aborts {f.actors['aborts_sent']}, hedges "
                       f"{f.actors['hedges']} (won {f.actors['hedge_wins']}, {f.actors['hedge_tokens']:,} tokens); "
                       f"{setup}")))
    work_s = f.kept / (case.servers * case.engine.tokens_per_ms) / 1000.0
    batch = f.member_seconds / (case.servers * f.makespan_s)
    res.add(c.Row(f"{case.name}: makespan ÷ ideal", f.makespan_ratio,
                  "first member → last answer ÷ max(kept ÷ capacity, longest answer's own time)", TARGET_MAKESPAN,
                  raw=(f"makespan {f.makespan_s:.2f} s, ideal {f.ideal_s:.2f} s (work {work_s:.2f} s at "
                       f"{case.engine.tokens_per_ms * 1000:,.0f} tok/s a fake; longest answer's own time "
                       f"{f.longest_own_s:.2f} s, alone it would take {case.engine.alone_s(f.longest):.2f} s); "
                       f"mean batch {batch:.1f} of {case.engine.max_running} a fake (most {f.max_running_seen}); "
                       f"{f.chunks:,} streamed chunks; "
                       f"launcher wall {f.wall_s:.0f} s")))
    res.add(c.Row(f"{case.name}: idle GPU-seconds in the tail", f.tail.get("tail/idle_gpu_s", float("nan")),
                  "the run's own measure: slots idle while fewer answers than a full batch remained",
                  "as low as the longest answer allows",
                  raw=(f"over {f.tail.get('tail/seconds', 0):.1f} s of tail; the run's own makespan ÷ ideal "
                       f"{f.tail.get('tail/makespan_over_ideal', float('nan')):.2f}")))


def run(quick: bool) -> c.ScenarioResult:
    res = c.ScenarioResult(KEY, TITLE)
    cases = CASES["quick" if quick else "full"]
    with c.scratch("longtail") as folder:
        for before, case in zip([None, *cases], cases):
            extra = [f"actors.lengths_from={folder / f'run_{slug_of(before)}'}"] if case.earlier and before else []
            add_rows(res, run_case(folder, case, *extra, *EXTRA))
    res.notes.append("longtail: ideal = max(kept tokens ÷ (fakes × a fake's full-batch tokens per second), the "
                     "longest answer's own generation time as the fake ran it); the makespan is the fakes' own clock (first member "
                     "received → last answer sent), so start-up and the merge are outside it.")
    return res

"""What the job is, in words a person checks at a glance: the launch's first line (the plan) and the closing
summary's lines on the prompts and responses.

- `plan_line` (printed by `print_plan`): prompts of which dataset, samples each, units, response and prompt limits, the servers; from
  the config and the parquet footers (or the unit manifest of a run being resumed), before anything starts.
- `job_lines`: how many rows of the dataset became prompts (and how many max_samples or the length filter left
  out), and how many responses reached the response limit.
- `run_summary`: the closing summary as data (what the Python entry, pipegen/api.py, returns).

Owns: those lines. Must never: import verl or torch (the plan line comes before any process starts), or
write anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from pipegen.inputs.dataset import file_rows, selected_rows, string_prompts
from pipegen.observe.outcomes import Outcomes, committed_outcomes, unit_outcomes
from pipegen.run.checkpoint import failure_reason
from pipegen.run.integrity import DamagedFile
from pipegen.run.precision import resolve_dtype_name
from pipegen.run.layout import RunDir
from pipegen.config.schema import JOB_DEFAULTS, is_demo, reproducibility


def _files(cfg: DictConfig) -> list[str]:
    files = cfg.data.train_files
    return [str(files)] if isinstance(files, str) else [str(f) for f in files]


def dataset_name(cfg: DictConfig) -> str:
    files = _files(cfg)
    if is_demo(files):
        return "the demo set"
    return Path(files[0]).name if len(files) == 1 else f"{len(files)} files ({Path(files[0]).name}, ...)"


def _prompts(cfg: DictConfig, run: RunDir) -> tuple[int | None, str]:
    """(prompts, where they come from) before the dataset is read: the manifest of a resumed run, else the
    parquet footers under max_samples (None: json files, counted when verl reads them)."""
    name = dataset_name(cfg)
    if run.units_file.exists():
        try:
            return len(run.read_manifest()), f"{name} (resumed)"
        except DamagedFile:
            pass  # the launcher sets it aside and reads the dataset again
    max_samples = cfg.data.get("train_max_samples")
    rows = file_rows(cfg)
    if rows is None:
        return None, name
    kept = selected_rows(rows, max_samples)
    rows_text = f"all its {rows} rows" if kept == rows else f"{kept} of its {rows} rows: max_samples={max_samples}"
    return kept, f"{name} ({rows_text})"


def plan_line(cfg: DictConfig, run: RunDir, engine_reason: str = "") -> str:
    """The launch's first line: what will run, and on which engine (`engine_reason`: why that one, from
    the launcher's engine choice)."""
    rollout = cfg.actor_rollout_ref.rollout
    n = int(rollout.n)
    prompts, source = _prompts(cfg, run)
    at_most = "at most " if cfg.data.get("filter_overlong_prompts") else ""
    each = f"{n} sample" if n == 1 else f"{n} samples"
    what = (f"{at_most}{prompts} prompts of {source} x {each} = {at_most}{prompts * n} units" if prompts is not None
            else f"every prompt of {source} x {each}")
    line = (f"pipegen: {what}; responses up to {int(rollout.response_length)} tokens, prompts up to "
            f"{int(rollout.prompt_length)}; {engine_reason or f'llm={cfg.llm.kind}'}")
    if cfg.llm.kind == "cpu":  # bf16 log-probs differ from a float32 recomputation: say which one serves
        dtype = resolve_dtype_name(str(cfg.llm.dtype))
        line += f" in {dtype}" + (" (this CPU has native bf16; llm.dtype=float32 for float32)"
                                  if dtype == "bfloat16" and str(cfg.llm.dtype) == "auto" else "")
    line += f"; {reproducibility(cfg)}"
    if string_prompts([str(f) for f in _files(cfg)], str(cfg.data.prompt_key)):
        line += f"; the {cfg.data.prompt_key} column holds plain strings: each is sent as one user message"
    if cfg.storage.url:
        line += f"; committed to {cfg.storage.url} (this node's scratch folder: {run.root})"
    if is_demo(_files(cfg)):
        line += (f" (the demo's small settings; your own train_files get every row and "
                 f"{JOB_DEFAULTS['max_response_length']}-token responses)")
    return line


def print_plan(cfg: DictConfig, run: RunDir, engine_reason: str = "") -> None:
    """Print the plan line (the launch's first line). A data file that cannot be read is left to the dataset
    check that follows, which names it and the fix."""
    try:
        line = plan_line(cfg, run, engine_reason)
    except (OSError, ValueError):  # pyarrow's ArrowInvalid is a ValueError
        return
    print(line, flush=True)


def job_lines(run: RunDir, cfg: DictConfig, outcomes: Outcomes | None) -> list[str]:
    """The closing summary's lines on prompts skipped and responses that reached the response limit."""
    lines = []
    facts = run.read_dataset_facts()
    prompts = len(run.read_manifest()) if run.units_file.exists() else 0
    if facts is not None and facts.rows is not None:
        lines.append(f"  prompts:      {prompts} of the {facts.rows} rows of {dataset_name(cfg)}; skipped: "
                     f"{facts.skipped_by_max_samples} by max_samples, {facts.skipped_too_long} as too long "
                     f"(data.filter_overlong_prompts)")
    finishes = outcomes.finishes if outcomes is not None else {}
    if finishes:
        limit = int(cfg.actor_rollout_ref.rollout.response_length)
        cut, seen = finishes.get("length", 0), sum(finishes.values())
        advice = ": raise max_response_length if they were cut short" if cut else ""
        lines.append(f"  responses:    {cut} of {seen} reached the response limit ({limit} tokens){advice}")
    return lines


@dataclass
class RunSummary:
    """The closing summary as data: what `pipegen.generate` returns beside the run directory."""

    complete: bool
    samples: int  # units committed
    units: int  # prompts x n
    failed: dict[str, str]  # "index:sample" -> why (rerun the same call to retry them)
    output: Path | None  # trajectories.pkl or the sharded output's index.json; None with final_merge=false
    batches: list[Path]  # the batch files, when they are the output (final_merge=false)
    artifact: Path | None  # trajectories.zip
    prompts: int
    n: int
    dataset_rows: int | None  # rows of train_files (None: json files)
    skipped_by_max_samples: int | None
    skipped_too_long: int | None
    response_limit: int
    responses_at_limit: int | None
    mean_reward: float | None  # None: nothing was scored
    pass_at_n: float | None


def run_summary(run: RunDir) -> RunSummary:
    """The run's summary now (complete or not): its units, where the output is, the rewards, the prompts used
    and skipped, and the responses that reached the response limit."""
    from pipegen.observe.progress import snapshot
    from pipegen.run.config import load_run_config

    cfg = load_run_config(run)
    n = int(cfg.actor_rollout_ref.rollout.n)
    snap = snapshot(run, n)
    # a store run's lines stay on its nodes
    outcomes = committed_outcomes(run, cfg) if cfg.storage.url else unit_outcomes(run, cfg)
    rewards = outcomes.rewards if outcomes is not None else None
    facts = run.read_dataset_facts()
    finishes = outcomes.finishes if outcomes is not None else {}
    output = run.merged_output()
    return RunSummary(
        complete=snap.complete, samples=snap.committed, units=snap.total,
        failed={unit: failure_reason(info) for unit, info in snap.failed_units.items()},
        output=output, batches=run.batch_files_on_disk() if output is None else [],
        artifact=run.artifact if run.artifact.exists() else None, prompts=snap.total // n, n=n,
        dataset_rows=facts.rows if facts is not None else None,
        skipped_by_max_samples=facts.skipped_by_max_samples if facts is not None else None,
        skipped_too_long=facts.skipped_too_long if facts is not None else None,
        response_limit=int(cfg.actor_rollout_ref.rollout.response_length),
        responses_at_limit=finishes.get("length", 0) if finishes else None,
        mean_reward=rewards.mean_reward if rewards is not None else None,
        pass_at_n=rewards.pass_at_n if rewards is not None else None,
    )

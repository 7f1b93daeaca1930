"""The preflight: what would fail every unit, found before any unit runs.

A setting that fails only once a unit has generated (a dead verifier, a reward function with the wrong
signature or one that raises, a harness that does not import, a command whose program is missing) would
otherwise cost the whole run's generation. Before any process starts, on the dataset's first row:
- the run's reward function (custom_reward_function.*) is loaded as verl loads it, its signature is checked
  against verl's call (data_source, solution_str, ground_truth, extra_info and reward_kwargs), and it is called
  once with an empty response; what it returns must be a score (protocol.parse_result);
- the verifier (reward.verifier_url) answers one real request for that row, with a score;
- the external loop's `external.harness` imports and names a callable, and `external.command`'s program exists.
Tasks resolve earlier, when their rows are written (launch/job.py computes them, prepare writes them). Each
failure is one line naming the setting and the fix; the cost (the seconds it took) is stated on the console, and
`generation.preflight=false` skips it.

Owns: those checks. Must never: score a sample, start a process, or read more of the dataset than one row.
"""

from __future__ import annotations

import inspect
import shlex
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import orjson
from omegaconf import DictConfig, OmegaConf

from pipegen.config.invocation import command
from pipegen.config.schema import uses_external_loop

from pipegen.rewards.protocol import RewardFailure, ScoreRequest, parse_result

SKIP = "generation.preflight=false skips this check"


def first_row(cfg: DictConfig) -> dict[str, Any] | None:
    """The dataset's first row as verl reads its columns (None for a file that is not parquet or jsonl, or not
    written yet)."""
    files = cfg.data.train_files
    path = Path(str(files if isinstance(files, str) else list(files)[0]))
    if not path.is_file():  # tasks' files are written once the launcher holds the lock: nothing to read yet
        return None
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        with pq.ParquetFile(path) as f:
            table = f.read_row_group(0) if f.metadata.num_row_groups else None
        rows = table.slice(0, 1).to_pylist() if table is not None and table.num_rows else []
        return rows[0] if rows else None
    if path.suffix == ".jsonl":
        with open(path, "rb") as f:
            line = f.readline().strip()
        return orjson.loads(line) if line else None
    return None


def request_for(row: dict[str, Any]) -> ScoreRequest:
    """verl's reward call for this row with an empty response (actor/scoring.py builds the real ones)."""
    reward_model = row.get("reward_model") or {}
    return ScoreRequest(data_source=row.get("data_source"), solution_str="",
                        ground_truth=reward_model.get("ground_truth") if isinstance(reward_model, dict) else None,
                        extra_info={**dict(row.get("extra_info") or {}), "num_turns": 1, "rollout_reward_scores": {}})


def check_function(cfg: DictConfig, row: dict[str, Any]) -> str:
    """The run's reward function called once on the row; one line naming the setting and the fix, or ''."""
    from pipegen.rewards.spec import run_reward
    from pipegen.rewards.local import load_function

    spec = run_reward(cfg)
    fn = load_function(spec)
    raw, kwargs = (fn.args[0], dict(fn.args[1])) if getattr(fn, "args", None) else (fn, {})
    where = f"custom_reward_function {spec.path}:{spec.name}"
    request = request_for(row)
    try:
        inspect.signature(raw).bind(**request.kwargs(), **kwargs)
    except TypeError as e:
        return (f"{where} cannot take verl's reward call compute_score(data_source=, solution_str=, ground_truth=, "
                f"extra_info={', **reward_kwargs' if kwargs else ''}): {e}; give it those keyword arguments "
                f"(def {spec.name}(data_source, solution_str, ground_truth, extra_info=None, **kwargs))")
    except ValueError:  # a builtin without a signature: its call below tells
        pass
    result: list[Any] = []

    def call() -> None:
        try:
            value = fn(**request.kwargs())
            if inspect.isawaitable(value):
                import asyncio

                value = asyncio.run(value)
            result.append(("ok", value))
        except BaseException as e:  # noqa: BLE001 (reported below as the refusal)
            result.append(("raised", e))

    limit = float(cfg.reward.timeout_s)
    thread = threading.Thread(target=call, name="pipegen-preflight-reward", daemon=True)
    thread.start()
    thread.join(limit)
    if not result:
        return (f"{where} did not return within reward.timeout_s={limit:g} on the first row with an empty "
                f"response; make it return, or raise reward.timeout_s ({SKIP})")
    kind, value = result[0]
    if kind == "raised":
        return (f"{where} raised {type(value).__name__}: {value} on the first row with an empty response "
                f"(a model may answer nothing); make it return a score for every answer ({SKIP})")
    try:
        parse_result(value, where)
    except RewardFailure as e:
        return f"{e} on the first row ({SKIP})"
    return ""


def check_verifier(cfg: DictConfig, row: dict[str, Any]) -> str:
    """One real request to reward.verifier_url for the row, through the actors' own client (rewards/verifier.py)
    with one try: a verifier that is down is a refusal here, not a retry; one line naming the fix, or ''."""
    import asyncio

    from pipegen.rewards.spec import run_reward
    from pipegen.rewards.verifier import VerifierReward

    settings = OmegaConf.merge(cfg.reward, {"verifier_attempts": 1})
    verifier = VerifierReward(run_reward(cfg), settings)

    async def once() -> Any:
        try:
            return await verifier.score(request_for(row))
        finally:
            await verifier.close()

    try:
        parse_result(asyncio.run(once()), verifier.describe())
    except RewardFailure as e:
        return (f"{e} on the first row with an empty response; start the verifier ({command('serve-reward')} "
                f"--port PORT), fix reward.verifier_url, or fix the verifier ({SKIP})")
    return ""


def check_harness(cfg: DictConfig) -> str:
    """external.harness imports and names a callable; external.command's program exists."""
    from pipegen.gateway.harness import Harness, HarnessFailed

    ext = cfg.external
    if ext.get("harness"):
        try:
            Harness.from_config(ext).callable()
        except (HarnessFailed, ValueError) as e:
            return str(e)
        except Exception as e:  # noqa: BLE001 (the module's own import error, named)
            where = str(ext.harness).rpartition(":")[0]
            return (f"external.harness={ext.harness}: loading it raised {type(e).__name__}: {e}; give its file "
                    f"(external.harness=path/to/file.py:NAME), or make `python -c 'import {where}'` work from this "
                    f"folder (install it or put it on PYTHONPATH)")
        return ""
    if ext.get("command"):
        try:
            words = shlex.split(str(ext.command))
        except ValueError as e:
            return f"external.command={ext.command!r} is not a shell command line ({e}); fix its quoting"
        program = next((w for w in words if "=" not in w.partition("/")[0]), None)  # after VAR=value settings
        if program and not shutil.which(program) and not Path(program).exists():
            return (f"external.command: its program {program!r} is not found (not a file, not on PATH); install it "
                    f"or give its full path ({SKIP})")
    return ""


def preflight(cfg: DictConfig) -> tuple[str, str]:
    """(refusal, note): a one-line refusal ('' when every check passed) and what was checked at what cost."""
    if not cfg.generation.preflight:
        return "", ""
    started = time.perf_counter()
    checked = []
    if uses_external_loop(cfg):
        problem = check_harness(cfg)
        if problem:
            return problem, ""
        checked.append("the harness imports" if cfg.external.get("harness") else "the command's program exists")
    from pipegen.rewards.spec import run_reward

    spec = run_reward(cfg)
    warning = ""
    if spec is not None:
        row = first_row(cfg)
        if row is not None:
            problem = check_verifier(cfg, row) if spec.url is not None else check_function(cfg, row)
            if problem:
                return problem, ""
            checked.append(f"{spec.describe()} scored the first row")
    elif cfg.actors.scoring and not cfg.tasks and not uses_external_loop(cfg):
        try:
            warning = unscorable_by_default(first_row(cfg))
        except Exception:  # noqa: BLE001 (a file that cannot be read: the dataset check that follows names it)
            warning = ""
    if not checked:
        return "", warning
    return "", (f"preflight: {', '.join(checked)} ({time.perf_counter() - started:.1f} s; "
                f"generation.preflight=false skips it)") + (f"\n{warning}" if warning else "")


def unscorable_by_default(row: dict[str, Any] | None) -> str:
    """A warning ('' when none) for a first row verl's default_compute_score cannot score: no data_source, or no
    reward_model.ground_truth. Such rows are generated and kept unscored; the closing summary counts them."""
    if row is None:
        return ""
    reward_model = row.get("reward_model")
    missing = [name for name, there in (("data_source", row.get("data_source")),
                                        ("reward_model.ground_truth", isinstance(reward_model, dict)
                                         and reward_model.get("ground_truth") is not None)) if not there]
    if not missing:
        return ""
    return (f"warning: the first row has no {' and no '.join(missing)}, which verl's default_compute_score scores "
            f"by: such rows are generated and stay unscored; set custom_reward_function.path=my_reward.py or "
            f"reward.verifier_url=URL to score them")

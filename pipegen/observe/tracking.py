"""Metrics and the artifact through verl's `Tracking` (console, file, wandb, ... from `trainer.logger`).

- `RunTracker`: the launcher's view of the run over time. Called every refresh with a
  `pipegen.observe.progress.Snapshot`; computes aggregated metrics (progress, units/s, output tokens/s,
  in-flight, failed, latency p50/p95, finish reasons, turns, response lengths, mean reward, errors,
  duplicates, torn lines; the launch's average units/s and output tokens/s; with SGLang or vLLM on this
  node's GPUs, their mean utilisation while generating: observe/gpu_busy.py) and, every `interval_s`, logs them through verl's `Tracking` and appends
  them to DIR/streams/stats/launch.jsonl. One wandb run per launch, named `trainer.experiment_name`
  in project `trainer.project_name`, grouped by the run key so the launches of one run sit together.
- `upload_artifact(cfg, run)`: DIR/trajectories.zip as the wandb Artifact seed 000 logged, named `trajectories` of
  type `trajectories` (a trainer's `use_artifact("trajectories:latest", type="trajectories")` finds it; called by
  the writer after it zips the merged run, when `generation.upload_artifact` and wandb is a logger).

wandb defaults (each only when the variable is unset): WANDB_DIR=DIR (so offline runs land in
DIR/wandb/offline-run-*/, upload later with `wandb sync`), WANDB_SILENT=true and WANDB_CONSOLE=off
(wandb's own chatter would break the progress bar). `file` writes DIR/logs/metrics-<launch>.jsonl
unless VERL_FILE_LOGGER_PATH is set. `console` prints verl's `step:N - key:value ...` lines only with
generation.show_progress=false (otherwise the bar is the console view), into DIR/logs/launch.log: what verl's
Tracking prints (those lines, the file logger's "Creating file logger at ...") goes to the launcher's log, never to
the terminal, where the launcher's own lines say how the run goes (observe/console.py).

Owns: what pipegen logs to metric backends, and the artifact upload.
Must never: make a run fail because a metric backend failed (it warns and carries on), upload a
partial trajectories.zip, or import verl/wandb unless a backend needs them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
from typing import Any, Iterator

from omegaconf import DictConfig, OmegaConf

from pipegen.run.checkpoint import load_checkpoint
from pipegen.run.diskfull import is_disk_full
from pipegen.run.layout import RunDir
from pipegen.observe.gpu_busy import GpuBusy
from pipegen.observe.stats import Rates, StatsAppender, actor_lines, flatten_numbers
from pipegen.run.stats_line import LaunchStats, StatsLine

log = logging.getLogger("pipegen.tracking")

ELAPSED_S = "time/elapsed_s"  # the launch's age at this step (the launcher's closing summary reads these two)
LAUNCH_UNITS_PER_S = "throughput/units_per_s_launch_avg"
LAUNCH_TOKENS_PER_S = "throughput/output_tokens_per_s_launch_avg"
GPU_BUSY = "gpu/busy_percent_while_generating"  # this node's GPUs (SGLang/vLLM servers pipegen started), mean
CONSOLE_KEYS = ("progress/done", "progress/committed", "progress/total", "progress/failed", "progress/in_flight",
                "throughput/units_per_s", "throughput/output_tokens_per_s", "latency/p50_s", "latency/p95_s",
                "reward/mean", "errors/total")


def backends_for(cfg: DictConfig, console: bool) -> list[str]:
    backends = [str(b) for b in (cfg.trainer.get("logger") or [])]
    if not console:
        backends = [b for b in backends if b != "console"]
    return list(dict.fromkeys(backends))


@contextlib.contextmanager
def _env_defaults(cfg: DictConfig, run: RunDir, job_type: str) -> Iterator[None]:
    """Set pipegen's wandb/file-logger defaults for the duration of a backend's init."""
    lid = run.read_launch().launch[:8] or time.strftime("%Y%m%d-%H%M%S")
    defaults = {
        "WANDB_DIR": str(run.root),
        "WANDB_SILENT": "true",
        "WANDB_CONSOLE": "off",
        "WANDB_RUN_GROUP": f"{cfg.trainer.experiment_name}-{(run.run_key() or 'unknown')}",
        "WANDB_JOB_TYPE": job_type,
        "VERL_FILE_LOGGER_PATH": str(run.metrics_log(lid)),
    }
    added = {k: v for k, v in defaults.items() if not os.environ.get(k)}
    os.environ.update(added)
    if "VERL_FILE_LOGGER_PATH" in added:
        run.logs.mkdir(parents=True, exist_ok=True)
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


@contextlib.contextmanager
def prints_to_log(run: RunDir) -> Iterator[None]:
    """What a library prints meanwhile (verl's console and file loggers print to stdout) goes to the launcher's log,
    DIR/logs/launch.log, appended beside its own lines."""
    run.logs.mkdir(parents=True, exist_ok=True)
    with open(run.role_log("launch"), "a", encoding="utf-8") as log_file, contextlib.redirect_stdout(log_file):
        yield


def make_tracking(cfg: DictConfig, run: RunDir, backends: list[str], job_type: str = "generate") -> Any:
    """verl's Tracking with project/experiment from cfg.trainer and the resolved config attached."""
    from verl.utils.tracking import Tracking

    config = OmegaConf.to_container(cfg, resolve=True)
    with _env_defaults(cfg, run, job_type), prints_to_log(run):
        return Tracking(project_name=str(cfg.trainer.project_name), experiment_name=str(cfg.trainer.experiment_name),
                        default_backend=backends, config=config)


def wandb_run_dir(tracking: Any) -> str | None:
    wandb = getattr(tracking, "logger", {}).get("wandb")
    run = getattr(wandb, "run", None) if wandb is not None else None
    return getattr(run, "dir", None) if run is not None else None


class RunTracker:
    """Aggregated run metrics over time, logged through verl's Tracking every interval_s."""

    def __init__(self, cfg: DictConfig, run: RunDir, interval_s: float | None = None, console: bool | None = None,
                 stats_role: str | None = LaunchStats.ROLE):
        self.cfg = cfg
        self.run = run
        self.interval_s = float(interval_s if interval_s is not None else cfg.generation.tracking_interval_s)
        if console is None:
            console = not bool(cfg.generation.show_progress)
        self.backends = backends_for(cfg, console)
        self.tracking: Any = None
        self.step = 0
        self.started = time.time()
        self._last_log: float | None = None
        self.rates = Rates()
        self.stats = StatsAppender(run.stats, stats_role) if stats_role else None
        self._done0: int | None = None
        self._tokens0: int | None = None
        self._last_done: int | None = None
        # GPU utilisation where this launcher's servers use this node's GPUs (never for llm=cpu or external)
        kind = str(OmegaConf.select(cfg, "llm.kind", default="cpu"))
        self.gpu = GpuBusy.start(os.environ) if kind in ("sglang", "vllm") and stats_role else None
        if self.backends:
            try:
                self.tracking = make_tracking(cfg, run, self.backends)
            except Exception as e:  # a metrics backend must never stop generation
                log.warning("metrics tracking (%s) disabled: %s: %s", ",".join(self.backends), type(e).__name__, e)
                self.tracking = None
            else:
                where = wandb_run_dir(self.tracking)
                if where:
                    log.info("wandb run files: %s", os.path.dirname(where))

    def metrics(self, snap: Any) -> dict[str, Any]:
        """The aggregated metrics for a snapshot; also sets snap.tokens_per_s for the progress bar."""
        now = time.time()
        m: dict[str, Any] = {
            "progress/committed": snap.committed,
            "progress/done": snap.done,
            "progress/total": snap.total,
            "progress/fraction": snap.fraction,
            "progress/batches": snap.batches,
            "progress/pending": snap.pending,
            "progress/failed": snap.failed,
            "progress/in_flight": snap.in_flight,
            "progress/requests_in_flight": snap.requests_in_flight,
            ELAPSED_S: now - self.started,
        }
        m.update(snap.metrics)
        units = self.rates.observe("done", now, snap.done)
        tokens = None
        for role, line in actor_lines(snap.roles).items():
            r = self.rates.observe(f"tokens/{role}", float(line.time or now), float(line.output_tokens),
                                   identity=(line.host, line.pid))
            if r is not None and not line.final:
                tokens = (tokens or 0.0) + r
        if units is not None:
            m["throughput/units_per_s"] = units
        if tokens is not None:
            m["throughput/output_tokens_per_s"] = tokens
        if self._done0 is None:
            self._done0 = snap.done
            self._tokens0 = snap.output_tokens
        elapsed = now - self.started
        if elapsed > 0:
            m[LAUNCH_UNITS_PER_S] = max(0, snap.done - self._done0) / elapsed
            m[LAUNCH_TOKENS_PER_S] = max(0, snap.output_tokens - (self._tokens0 or 0)) / elapsed
        if self.gpu is not None:
            generating = snap.in_flight > 0 or (self._last_done is not None and snap.done > self._last_done)
            self.gpu.observe(generating)
            if self.gpu.mean() is not None:
                m[GPU_BUSY] = self.gpu.mean()
        self._last_done = snap.done
        snap.tokens_per_s = tokens
        return m

    def update(self, snap: Any, roles: dict[str, StatsLine] | None = None, force: bool = False) -> dict[str, Any]:
        """Compute the metrics for snap (roles: latest stats lines, default snap.roles); log them
        when interval_s has passed since the last log, or when force."""
        if roles is not None:
            snap.roles = roles
        m = self.metrics(snap)
        now = time.monotonic()
        if force or self._last_log is None or now - self._last_log >= self.interval_s:
            self._last_log = now
            self._log(m)
        return m

    def _log(self, m: dict[str, Any]) -> None:
        self.step += 1
        numbers = flatten_numbers(m)
        if self.stats is not None:
            try:
                self.stats.append(LaunchStats(step=self.step, metrics=numbers))
            except OSError as e:  # a full disk in words: the roles stop the run with its one line (run/diskfull.py)
                log.warning("could not append launcher stats: %s",
                            "no space left on the device" if is_disk_full(e) else e)
        if self.tracking is None:
            return
        try:
            others = [b for b in self.backends if b != "console"]
            with prints_to_log(self.run):
                if others:
                    self.tracking.log(data=numbers, step=self.step, backend=others)
                if "console" in self.backends:
                    self.tracking.log(data={k: numbers[k] for k in CONSOLE_KEYS if k in numbers}, step=self.step,
                                      backend=["console"])
        except Exception as e:
            log.warning("metrics tracking failed, disabled for this launch: %s: %s", type(e).__name__, e)
            self.tracking = None

    def finish(self, snap: Any | None = None, exit_code: int = 0) -> None:
        if snap is not None:
            self.update(snap, force=True)
        if self.gpu is not None:
            self.gpu.stop()
        if self.stats is not None:
            self.stats.close()
            self.stats = None
        if self.tracking is not None:
            try:
                with prints_to_log(self.run):
                    self.tracking.finish(exit_code=exit_code)
            except Exception as e:
                log.warning("metrics tracking did not finish cleanly: %s: %s", type(e).__name__, e)
            self.tracking = None


ARTIFACT_NAME = "trajectories"  # seed 000's `_upload_artifact`: name and type
ARTIFACT_TYPE = "trajectories"


def artifact_aliases(cfg: DictConfig, run: RunDir) -> list[str]:
    """`latest`, the run's key and the experiment's name (wandb aliases allow letters, digits, '-', '_' and '.')."""
    experiment = re.sub(r"[^A-Za-z0-9._-]+", "-", str(cfg.trainer.experiment_name)).strip("-")
    return list(dict.fromkeys(["latest", f"run-{(run.run_key() or 'unknown')}", *([experiment] if experiment else [])]))


def upload_artifact(cfg: DictConfig, run: RunDir) -> None:
    """Log DIR/trajectories.zip as the wandb Artifact `trajectories` (type `trajectories`, as seed 000's; aliases:
    latest, the run's key, the experiment's name) in its own short wandb run of the
    run's group (job type `upload`). Offline (WANDB_MODE=offline) it is staged for `wandb sync`.
    Never raises: a failed upload is logged as an error; the data on disk is complete either way."""
    if not run.artifact.exists():
        log.error("no %s to upload", run.artifact)
        return
    try:
        ckpt = load_checkpoint(run.checkpoint)
        rollout = cfg.actor_rollout_ref.rollout
        metadata = {
            "rows": ckpt.num_rows,
            "units": ckpt.num_committed,
            "batches": len(ckpt.batches),
            "model_path": str(cfg.actor_rollout_ref.model.path),
            "train_files": OmegaConf.to_container(cfg.data, resolve=True).get("train_files"),
            "n": int(rollout.n),
            "temperature": float(rollout.temperature),
            "run_key": (run.run_key() or 'unknown'),
            "output_dir": str(run.root),
        }
        tracking = make_tracking(cfg, run, ["wandb"], job_type="upload")
        wandb = tracking.logger["wandb"]
        art = wandb.Artifact(name=ARTIFACT_NAME, type=ARTIFACT_TYPE, metadata=metadata,
                             description=f"pipegen trajectories ({ckpt.num_rows} rows) from {run.root}")
        # immutable: referenced in place, not copied into wandb's staging area (it can be many GB)
        art.add_file(str(run.artifact), name=run.artifact.name, policy="immutable")
        wandb.run.log_artifact(art, aliases=artifact_aliases(cfg, run))
        where = wandb_run_dir(tracking)
        tracking.finish(exit_code=0)
        log.info("artifact %s:%s (type %s) logged to wandb%s", ARTIFACT_NAME, artifact_aliases(cfg, run)[-1],
                 ARTIFACT_TYPE, f" ({os.path.dirname(where)})" if where else "")
    except Exception as e:
        log.error("uploading %s to wandb failed (%s: %s); the file on disk is complete, upload it later",
                  run.artifact, type(e).__name__, e)

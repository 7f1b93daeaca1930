"""Config: compose pipegen's Hydra config with verl's groups once, save it, load it in every child.

Owns: finding verl's config folder without importing verl, composing `conf/pipegen.yaml` with CLI
overrides, writing and reading `OUTPUT_DIR/conf/config.yaml`, and the run-directory layout.
Must never: import verl or torch (the launcher's startup stays fast), or compose verl's groups in a
child process (children read the saved file so every role sees exactly one config).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
PRIMARY = "pipegen"


def verl_config_dir() -> str:
    """verl's trainer/config folder, found without executing verl's __init__ (which costs ~5 s)."""
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("verl is not installed: run ./launch.sh --setup")
    return os.path.join(list(spec.submodule_search_locations)[0], "trainer", "config")


def compose(overrides: list[str]) -> DictConfig:
    """Compose the full config (pipegen + verl groups) with Hydra's compose API."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    search = f"hydra.searchpath=[file://{verl_config_dir()}]"
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = hydra_compose(config_name=PRIMARY, overrides=[search, *overrides])
    return cfg


def resolved(cfg: DictConfig) -> DictConfig:
    """A fully resolved copy (in-place OmegaConf.resolve chokes on verl's `oc.select:...,[]` defaults)."""
    out = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    assert isinstance(out, DictConfig)
    return out


@dataclass(frozen=True)
class RunDir:
    """Every path pipegen writes under output_dir, in one place."""

    root: Path

    @property
    def conf(self) -> Path:
        return self.root / "conf"

    @property
    def config_file(self) -> Path:
        return self.conf / "config.yaml"

    @property
    def units_file(self) -> Path:
        return self.conf / "units.json"

    @property
    def fingerprint_file(self) -> Path:
        return self.conf / "fingerprint.json"

    @property
    def launch_file(self) -> Path:
        return self.conf / "launch.json"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def streams(self) -> Path:
        return self.root / "streams"

    @property
    def rollouts(self) -> Path:
        return self.streams / "rollouts"

    @property
    def failures(self) -> Path:
        return self.streams / "failures"

    @property
    def stats(self) -> Path:
        return self.streams / "stats"

    @property
    def checkpoint(self) -> Path:
        return self.root / "checkpoint.json"

    @property
    def writer_lock(self) -> Path:
        return self.root / ".writer.lock"

    @property
    def trajectories(self) -> Path:
        return self.root / "trajectories.pkl"

    @property
    def artifact(self) -> Path:
        return self.root / "trajectories.zip"

    def batch_file(self, number: int) -> Path:
        return self.root / f"batch_{number:05d}.pkl"


def output_dir_from_args(args: list[str]) -> Path:
    """The output_dir=... override from a child's argv (children get only that and their identity)."""
    for arg in args:
        if arg.startswith("output_dir="):
            return Path(arg.split("=", 1)[1]).expanduser().resolve()
    raise SystemExit("missing output_dir=DIR (the run directory)")


def load_run_config(run: RunDir) -> DictConfig:
    """Load the resolved config a launcher saved; a clear error when the directory is not a run."""
    if not run.config_file.exists():
        raise SystemExit(
            f"{run.config_file} not found: {run.root} is not a pipegen run directory "
            f"(start one with: python -m pipegen.launch output_dir={run.root})"
        )
    cfg = OmegaConf.load(run.config_file)
    assert isinstance(cfg, DictConfig)
    return cfg


def save_run_config(run: RunDir, cfg: DictConfig) -> None:
    from pipegen.atomic import atomic_write_bytes

    run.conf.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(run.config_file, OmegaConf.to_yaml(cfg, resolve=True).encode())

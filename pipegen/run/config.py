"""Config: compose pipegen's Hydra config with verl's groups once, save it, load it in every child.

Owns: finding verl's config folder without importing verl, composing `conf/pipegen.yaml` with CLI
overrides, writing and reading `OUTPUT_DIR/conf/config.yaml`.
Must never: import verl or torch (the launcher's startup stays fast), or compose verl's groups in a
child process (children read the saved file so every role sees exactly one config).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from pipegen.run.atomic import atomic_write_bytes
from pipegen.run.layout import RunDir

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
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
    run.conf.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(run.config_file, OmegaConf.to_yaml(cfg, resolve=True).encode())

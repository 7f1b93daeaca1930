"""The run's saved config: DIR/conf/config.yaml, written once by the launcher and read by every process.

Owns: writing the resolved config (ending in a marker line, so a truncated file is told from a whole one) and
reading it back, a damaged file named in one line, a key an older pipegen did not save filled in with the
schema's default (config/schema.py's `fill_defaults`).
Must never: compose a config (config/compose.py does, once, in the launcher), import verl or torch, or let a
child process see another config than the one saved.
"""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from pipegen.config.schema import fill_defaults
from pipegen.run.atomic import atomic_write_bytes
from pipegen.run.integrity import DamagedFile, read_yaml_file, relaunch_advice
from pipegen.run.layout import RunDir


# The saved config's last line: a truncated file often still parses as YAML, so its end is marked.
CONFIG_END = "# end of the resolved config (pipegen writes this file whole)"


def load_run_config(run: RunDir) -> DictConfig:
    """Load the resolved config a launcher saved; a clear error when the directory is not a run, and
    a DamagedFile (one line: the launch command writes it again) when the file is damaged."""
    if not run.config_file.exists() and not run.checkpoint.exists() and not run.units_file.exists():
        raise SystemExit(
            f"{run.config_file} not found: {run.root} is not a pipegen run directory "
            f"(start one with: python -m pipegen.launch output_dir={run.root})"
        )
    try:
        return read_yaml_file(run.config_file, CONFIG_END, _run_config, "pipegen run config")
    except DamagedFile as e:
        raise e.with_advice("the checkpoint, batch files and shards", relaunch_advice(run.root)) from None


def _run_config(cfg) -> DictConfig:
    if not isinstance(cfg, DictConfig):
        raise TypeError("the file is not a mapping of keys")
    int(cfg.actor_rollout_ref.rollout.n), int(cfg.generation.save_batch_size)  # what every role reads first
    return fill_defaults(cfg)  # a key an older pipegen did not save reads as its one default, the schema's


def save_run_config(run: RunDir, cfg: DictConfig) -> None:
    run.conf.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(run.config_file, f"{OmegaConf.to_yaml(cfg, resolve=True)}{CONFIG_END}\n".encode())

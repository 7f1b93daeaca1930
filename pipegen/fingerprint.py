"""The resume guard: a fingerprint of everything that defines the generated data.

Components: model path and weights identity (file names and sizes), tokenizer files and chat template,
data files and their sizes, sampling parameters, n, lengths, seed, agent loop and tool configs.
Stored as `conf/fingerprint.json`; a launch or writer restart whose fingerprint differs is refused
with what changed, so two datasets are never silently mixed in one output.

Owns: computing and comparing fingerprints. Must never: hash multi-GB weight files (sizes identify
them well enough and keep a relaunch instant) or modify the run directory except through `save`.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import orjson
from omegaconf import DictConfig, OmegaConf

from pipegen.atomic import atomic_write_bytes

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "config.json", "generation_config.json")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
OVERRIDE_KEY = "resume_with_changes"


def _file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16] if path.is_file() else "missing"


def _maybe_file(path: Any) -> str | None:
    return _file_digest(Path(str(path)).expanduser()) if path else None


def compute_fingerprint(cfg: DictConfig) -> dict[str, Any]:
    rollout = cfg.actor_rollout_ref.rollout
    model_dir = Path(str(cfg.actor_rollout_ref.model.path)).expanduser()
    weights = sorted(
        (p.name, p.stat().st_size) for p in model_dir.glob("*") if p.is_file() and p.suffix in WEIGHT_SUFFIXES
    ) if model_dir.is_dir() else []
    files = cfg.data.train_files
    files = [files] if isinstance(files, str) else list(files)
    return {
        "model_path": str(model_dir),
        "weights": weights,
        "tokenizer": {name: _file_digest(model_dir / name) for name in TOKENIZER_FILES if (model_dir / name).exists()},
        "custom_chat_template": cfg.actor_rollout_ref.model.get("custom_chat_template"),
        "data_files": [(str(f), Path(str(f)).stat().st_size if Path(str(f)).exists() else None) for f in files],
        "max_samples": cfg.data.get("train_max_samples"),
        "prompt_key": cfg.data.prompt_key,
        "n": int(rollout.n),
        "seed": cfg.get("seed"),
        "per_unit_seed": cfg.actors.get("per_unit_seed"),
        "sampling": {
            "temperature": rollout.temperature,
            "top_p": rollout.top_p,
            "top_k": rollout.top_k,
            "calculate_log_probs": rollout.calculate_log_probs,
        },
        "prompt_length": int(rollout.prompt_length),
        "response_length": int(rollout.response_length),
        "agent": {
            "default_agent_loop": rollout.agent.default_agent_loop,
            "agent_loop_config": _maybe_file(rollout.agent.agent_loop_config_path),
            "tool_config": _maybe_file(rollout.multi_turn.tool_config_path),
            "function_tools": _maybe_file(rollout.multi_turn.function_tool_path),
            "multi_turn": OmegaConf.to_container(rollout.multi_turn, resolve=True),
        },
        "scoring": cfg.actors.get("scoring"),
    }


def describe_changes(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    changes = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            changes += describe_changes(a, b, f"{prefix}{key}.")
        elif a != b:
            changes.append(f"{prefix}{key}: {_short(a)} -> {_short(b)}")
    return changes


def _short(value: Any) -> str:
    text = orjson.dumps(value).decode()
    return text if len(text) <= 60 else text[:57] + "..."


def save_fingerprint(path: Path, fp: dict[str, Any]) -> None:
    atomic_write_bytes(path, orjson.dumps(fp, option=orjson.OPT_INDENT_2))


def mismatch_message(stored: dict[str, Any], current: dict[str, Any], output_dir: Path) -> str | None:
    changes = describe_changes(stored, current)
    if not changes:
        return None
    return (
        f"{output_dir} was generated with a different setup ({'; '.join(changes[:4])}"
        f"{'; ...' if len(changes) > 4 else ''}). Use a new output_dir, or pass {OVERRIDE_KEY}=true to "
        "continue anyway (the output would mix both setups)"
    )


def check_fingerprint(cfg: DictConfig, run) -> str | None:
    """None when the run directory's stored fingerprint matches cfg (or none is stored yet)."""
    if cfg.get(OVERRIDE_KEY) or not run.fingerprint_file.exists():
        return None
    stored = orjson.loads(run.fingerprint_file.read_bytes())
    return mismatch_message(stored, orjson.loads(orjson.dumps(compute_fingerprint(cfg))), run.root)

"""The resume guard: a fingerprint of everything that defines the generated data.

Components: model path and weights identity (each weight file's name, size and a digest of three
sampled 64 KiB blocks), tokenizer files and chat template (full digests: they are small), data files
(size and sampled digest) and row selection, sampling parameters, n, lengths, seeds, the generator
(the model or the fake test engine), agent loop, tool and loop configs, and scoring.
Stored as `conf/fingerprint.json`; a launch or writer restart whose fingerprint differs is refused
with one line naming what changed and how to proceed (a new output_dir, or `resume_with_changes=true`),
so two datasets are never silently mixed in one output. The fingerprint binds a directory only once
the run has produced something (`has_output`): a launch refused before generating (a prompt too long,
a wrong column) may be rerun with the fix in the same output_dir.

Owns: computing and comparing fingerprints. Must never: read whole multi-GB weight or data files
(sampled blocks identify them and keep a relaunch instant), or modify the run directory except
through `save_fingerprint`.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Callable, Mapping

import orjson
from omegaconf import DictConfig, OmegaConf

from pipegen.config.schema import HF_BACKEND, Rows
from pipegen.run.atomic import atomic_write_bytes
from pipegen.run.integrity import DamagedFile, read_json_file, relaunch_advice

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "config.json", "generation_config.json")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
OVERRIDE_KEY = "resume_with_changes"
# a run that had samples added (n 1 -> 2) keeps the run key it had, so its prompts' uids (stream.prompt_uid) stay
KEPT_RUN_KEY = "run_key"


SAMPLE_BYTES = 64 << 10


def _file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16] if path.is_file() else "missing"


def sampled_digest(path: Path, block: int = SAMPLE_BYTES) -> str:
    """A digest of a file's size and its first, middle and last blocks: constant time for any size,
    and different for re-trained weights of the same shape (their bytes differ everywhere)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            return _sampled(size, lambda start: (f.seek(start), f.read(block))[1], block)
    except OSError:
        return "missing"


def bytes_digest(data: bytes, block: int = SAMPLE_BYTES) -> str:
    """`sampled_digest` of a file that will hold `data`: a launch's task files before it writes them."""
    return _sampled(len(data), lambda start: data[start:start + block], block)


def _sampled(size: int, read_at: Callable[[int], bytes], block: int) -> str:
    h = hashlib.sha256()
    h.update(str(size).encode())
    for start in sorted({0, max(0, size // 2 - block // 2), max(0, size - block)}):
        h.update(read_at(start))
    return h.hexdigest()[:16]


def _data_file(path: str, pending: Mapping[str, bytes]) -> tuple[str, int | None, str]:
    """A data file's (path, size, sampled digest), from its bytes when this launch has not written it yet."""
    if path in pending:
        return path, len(pending[path]), bytes_digest(pending[path])
    file = Path(path)
    return path, file.stat().st_size if file.exists() else None, sampled_digest(file)


def _maybe_file(path: Any) -> str | None:
    return _file_digest(Path(str(path)).expanduser()) if path else None


def compute_fingerprint(cfg: DictConfig, pending: Mapping[str, bytes] | None = None) -> dict[str, Any]:
    """The fingerprint of a resolved config; `pending`: {path: bytes} of data files this launch writes only once
    its resume guard has passed (its task files), fingerprinted as the files they will be."""
    rollout = cfg.actor_rollout_ref.rollout
    model_dir = Path(str(cfg.actor_rollout_ref.model.path)).expanduser()
    weights = sorted(
        (p.name, p.stat().st_size, sampled_digest(p))
        for p in model_dir.glob("*") if p.is_file() and p.suffix in WEIGHT_SUFFIXES
    ) if model_dir.is_dir() else []
    files = cfg.data.train_files
    files = [files] if isinstance(files, str) else list(files)
    data = cfg.data
    llm = cfg.get("llm") or {}
    return {
        "model_path": str(model_dir),
        "weights": weights,
        "tokenizer": {name: _file_digest(model_dir / name) for name in TOKENIZER_FILES if (model_dir / name).exists()},
        "custom_chat_template": cfg.actor_rollout_ref.model.get("custom_chat_template"),
        "data_files": [_data_file(str(f), pending or {}) for f in files],
        "max_samples": data.get("train_max_samples"),
        "prompt_key": data.prompt_key,
        "row_selection": {
            "shuffle": data.get("shuffle"),
            "data_seed": data.get("seed"),
            "filter_overlong_prompts": data.get("filter_overlong_prompts"),
            "truncation": data.get("truncation"),
        },
        "apply_chat_template_kwargs": _plain(data.get("apply_chat_template_kwargs")),
        # only llm=cpu names a model backend; every other kind serves the model itself
        "generator": "model" if llm.get("engine") in (None, HF_BACKEND) else "fake engine",
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
        **_reward(cfg),
        # how a multi-trajectory sample's rows are scored and weighed: only where not the default, so a run
        # without them keeps its run key
        **({"rows": rows} if (rows := _rows(cfg)) else {}),
        # the `external` loop's harness defines its units' data; absent when unset, so other runs' prints stay
        **({"external": {"harness": ext.get("harness"), "command": ext.get("command")}}
           if (ext := cfg.get("external") or {}).get("harness") or ext.get("command") else {}),
    }


def _reward(cfg: DictConfig) -> dict[str, Any]:
    """The reward settings and the task names, only where set (a run without them keeps its run key)."""
    out: dict[str, Any] = {}
    crf = cfg.get("custom_reward_function") or {}
    url = (cfg.get("reward") or {}).get("verifier_url")
    if url:
        out["verifier_url"] = url
    elif crf.get("path"):
        path = str(crf.path)
        out["reward_function"] = {"path": path, "name": crf.get("name"), "reward_kwargs": _plain(crf.get("reward_kwargs")),
                                  "file": None if path.startswith("pkg://") else _maybe_file(path)}
    tasks = list(cfg.get("tasks") or [])
    return {"reward": out, "tasks": tasks} if out or tasks else {}


def _rows(cfg: DictConfig) -> dict[str, Any]:
    """rows.reward and rows.loss_weight where they differ from their defaults (they define the rows' data)."""
    rows, default = cfg.get("rows") or {}, Rows()
    return {k: rows.get(k) for k in ("reward", "loss_weight")
            if rows.get(k, getattr(default, k)) != getattr(default, k)}


def _plain(value: Any) -> Any:
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def describe_changes(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    """One short phrase per changed component, e.g. `sampling.temperature: 1.0 -> 0.5`."""
    changes = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        name = f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            changes += describe_changes(a, b, f"{name}.")
        elif a == b:
            continue
        elif key in ("weights", "data_files") and isinstance(a, list) and isinstance(b, list):
            changes.append(f"{name}: {_describe_files(a, b)}")
        elif prefix == "tokenizer." or key in ("agent_loop_config", "tool_config", "function_tools"):
            changes.append(f"{name}: contents changed" if a and b else f"{name}: {_short(a)} -> {_short(b)}")
        else:
            changes.append(f"{name}: {_short(a)} -> {_short(b)}")
    return changes


def _describe_files(old: list, new: list) -> str:
    """Which files of a [name, size, digest...] list were added, removed or changed."""
    def by_name(entries: list) -> dict[str, Any]:
        return {Path(str(e[0])).name if isinstance(e, (list, tuple)) else str(e): e for e in entries}

    a, b = by_name(old), by_name(new)
    parts = [f"{n} changed" for n in sorted(set(a) & set(b)) if a[n] != b[n]]
    parts += [f"{n} removed" for n in sorted(set(a) - set(b))]
    parts += [f"{n} added" for n in sorted(set(b) - set(a))]
    return ", ".join(parts[:3]) + (", ..." if len(parts) > 3 else "") if parts else "changed"


def _short(value: Any, limit: int = 60) -> str:
    """JSON text of value; a long one keeps its end (paths differ at the end, not at /home/...)."""
    text = orjson.dumps(value).decode()
    return text if len(text) <= limit else "..." + text[-(limit - 3):]


def has_output(run) -> bool:
    """Whether the run directory holds anything generated: a stream record (rollout or failure), a
    batch file, or a checkpoint. Until then nothing can mix, so any setting may still change."""
    from pipegen.run.medium import open_medium

    if run.checkpoint.exists() or run.batch_files_on_disk() or run.legacy_batch_files():
        return True
    return open_medium(run).holds_lines()  # the medium the run's saved config names (files when none is saved)


def fingerprint_bytes(fp: dict[str, Any]) -> bytes:
    """The file's exact bytes: their digest is the run key (layout.RunDir.run_key), which seeds uids."""
    return orjson.dumps(fp, option=orjson.OPT_INDENT_2)


def run_key_of(fp: dict[str, Any]) -> str:
    """The run key a fingerprint gives once saved (RunDir.run_key reads it back from the file): the one it keeps, or
    its digest."""
    return fp.get(KEPT_RUN_KEY) or hashlib.sha256(fingerprint_bytes(fp)).hexdigest()[:16]


def with_kept_run_key(stored: dict[str, Any] | None, current: dict[str, Any]) -> dict[str, Any]:
    """This launch's fingerprint, keeping the run key the stored one keeps (a run that had samples added): what
    the two are compared and saved as."""
    if stored and stored.get(KEPT_RUN_KEY):
        return {**current, KEPT_RUN_KEY: stored[KEPT_RUN_KEY]}
    return current


def save_fingerprint(path: Path, fp: dict[str, Any]) -> None:
    atomic_write_bytes(path, fingerprint_bytes(fp))


def load_fingerprint(run) -> dict[str, Any] | None:
    """The stored fingerprint, None before the launcher saved one; a DamagedFile when it is damaged."""
    def checked(data: Any) -> dict[str, Any]:
        if not isinstance(data, dict) or "n" not in data or "model_path" not in data:
            raise ValueError("a fingerprint is an object with the run's model_path, n, ...")
        return data

    try:
        return read_json_file(run.fingerprint_file, checked, "pipegen fingerprint", missing_ok=True)
    except DamagedFile as e:
        raise e.with_advice("the checkpoint, batch files and shards",
                            f"{relaunch_advice(run.root)} when its setup matches the run key the checkpoint "
                            "recorded") from None


def mismatch_message(stored: dict[str, Any], current: dict[str, Any], output_dir: Path) -> str | None:
    changes = describe_changes(stored, current)
    if not changes:
        return None
    shown = "; ".join(changes[:4]) + (f"; and {len(changes) - 4} more" if len(changes) > 4 else "")
    return (
        f"{output_dir} was generated with a different setup ({shown}). To keep the datasets apart, use a "
        f"new output_dir; to continue this run anyway, add {OVERRIDE_KEY}=true (its output would mix both setups)"
    )


def check_fingerprint(cfg: DictConfig, run) -> str | None:
    """None when the run directory's stored fingerprint matches cfg (or none is stored yet)."""
    if cfg.get(OVERRIDE_KEY):
        return None
    stored = load_fingerprint(run)
    if stored is None:
        return None
    current = orjson.loads(orjson.dumps(compute_fingerprint(cfg)))
    return mismatch_message(stored, with_kept_run_key(stored, current), run.root)

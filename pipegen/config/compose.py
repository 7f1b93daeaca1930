"""Composing the job's config: pipegen's Hydra config with verl's groups, once, from the shipped `pipegen/conf/`.

Owns: finding verl's config folder without importing verl, composing `conf/pipegen.yaml` (package data, so an
installed pipegen composes without its checkout) with the command line's overrides, saying in one line what is
wrong with an override, the type and rule check of every key, and the `--help` listing.
Must never: import verl or torch (the launcher's startup stays fast), import any other part of pipegen (config/
is the ground floor), or write a file (launch/ saves the resolved config into the run directory).
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from pipegen.config.schema import LLM_KINDS, check_values, describe_keys, key_info
from pipegen.config.schema import register as register_schema

# the shipped config folder: pipegen/conf/, inside the package (pyproject.toml ships it as package data)
CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
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

    register_schema()
    search = f"hydra.searchpath=[file://{verl_config_dir()}]"
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = hydra_compose(config_name=PRIMARY, overrides=[search, *overrides])
    return cfg


def resolved(cfg: DictConfig) -> DictConfig:
    """A fully resolved copy (in-place OmegaConf.resolve chokes on verl's `oc.select:...,[]` defaults)."""
    out = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    assert isinstance(out, DictConfig)
    return out


HELP = "python -m pipegen.launch --help"
def describe_config_error(error: Exception, overrides: list[str] = ()) -> str:
    """One line naming the fix for a Hydra / OmegaConf error (theirs span many lines); `overrides` tell
    which llm kind's keys were composed."""
    cause: BaseException | None = error
    while cause is not None:  # a value of the wrong type for a schema key: OmegaConf names the key
        full_key = getattr(cause, "full_key", None)
        if full_key and type(cause).__name__ == "ValidationError":
            kind = next((o.split("=", 1)[1] for o in overrides if o.startswith("llm=")), "cpu")
            info = key_info(str(full_key), kind if kind in LLM_KINDS else None)
            value = getattr(cause, "value", None)
            allowed = info.allowed() if info is not None and info.allowed() else _type_name(cause)
            return f"{full_key}={value} is not allowed: use {allowed}"
        cause = cause.__cause__
    text = str(error).strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    first = lines[0] if lines else type(error).__name__
    m = re.match(r"Could not override '([^']+)'", first)
    if m:
        return (f"unknown key '{m.group(1)}': check its spelling against {HELP} "
                f"(a new key needs a leading +, as in +{m.group(1)}=...)")
    m = re.search(r"Could not find '([^'/]+)/([^']+)'", first)
    if m:
        group = m.group(1)
        options = [ln for ln in lines[2:] if not ln.startswith(("Config search path", "provider="))]
        choices = ", ".join(f"{group}={o}" for o in options if "=" not in o)
        return f"{group}={m.group(2)} does not exist" + (f"; choose {choices}" if choices else f"; see {HELP}")
    if type(error).__name__ == "OverrideParseException":
        return f"cannot parse an override ({first}); overrides are key=value (quote lists: 'key=[a,b]')"
    return f"{first} (see {HELP})"


def _type_name(error: BaseException) -> str:
    m = re.search(r"could not be converted to (\w+)", str(error))
    return {"Integer": "an integer", "Float": "a number", "Boolean": "true | false"}.get(m.group(1), m.group(1)) \
        if m else "a value of the key's type"


def check_types(cfg: DictConfig) -> None:
    """Raise ValueError naming the key when a mandatory key is unset (`???`), or a pipegen key holds a value
    its schema rule does not allow (OmegaConf has checked the types while composing)."""
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        key = missing[0]
        example = "'llm.urls=[http://HOST:PORT]'" if key == "llm.urls" else f"{key}=VALUE"
        raise ValueError(f"{key} must be set: add {example} to the command line")
    check_values(cfg)


# verl's keys that users set most, shown by --help with their values (verl's groups hold ~200 more)
VERL_KEYS_SHOWN = (
    "data.prompt_key", "data.filter_overlong_prompts", "data.truncation", "data.shuffle", "data.seed",
    "data.apply_chat_template_kwargs", "data.return_raw_chat",
    "actor_rollout_ref.model.path", "actor_rollout_ref.model.custom_chat_template",
    "actor_rollout_ref.model.trust_remote_code",
    "actor_rollout_ref.rollout.n", "actor_rollout_ref.rollout.temperature", "actor_rollout_ref.rollout.top_p",
    "actor_rollout_ref.rollout.top_k", "actor_rollout_ref.rollout.do_sample",
    "actor_rollout_ref.rollout.prompt_length", "actor_rollout_ref.rollout.response_length",
    "actor_rollout_ref.rollout.calculate_log_probs",
    "actor_rollout_ref.rollout.agent.default_agent_loop", "actor_rollout_ref.rollout.agent.agent_loop_config_path",
    "actor_rollout_ref.rollout.multi_turn.enable", "actor_rollout_ref.rollout.multi_turn.max_assistant_turns",
    "actor_rollout_ref.rollout.multi_turn.tool_config_path",
)


def help_text(cfg: DictConfig) -> str:
    """pipegen's own keys from the schema (value, help, allowed values), then verl's most used keys."""
    lines = [describe_keys(cfg), "", "verl's keys users set most (verl's groups keep all of verl's keys "
             "and defaults; set any of them the same way):"]
    for key in VERL_KEYS_SHOWN:
        try:
            value = OmegaConf.select(cfg, key, throw_on_missing=False, default="(not in this verl)")
        except Exception:  # an interpolation that cannot resolve yet: show it unresolved
            value = "?"
        if OmegaConf.is_config(value):
            value = OmegaConf.to_container(value, resolve=True)
        shown = "null" if value is None else str(value).lower() if isinstance(value, bool) else value
        lines.append(f"  {key}={shown}")
    return "\n".join(lines)

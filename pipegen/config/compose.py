"""Composing the job's config: pipegen's Hydra config with verl's groups, once, from the shipped `conf/`.

Owns: finding verl's config folder without importing verl, finding the top-level `conf/` (the package
`pipegen.conf`: a checkout's own folder, or pipegen/conf/ in an installed wheel), composing its `pipegen.yaml`
with the command line's overrides, saying in one line what is wrong with an override (a typo in verl's groups
from one composition of the defaults, `unknown_verl_key`, before the launch imports its machinery), the type and
rule check of every key, and the `--help` listing.
Must never: import verl or torch (the launcher's startup stays fast), import any other part of pipegen (config/
is the ground floor), or write a file (launch/ saves the resolved config into the run directory).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
from dataclasses import fields
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from pipegen.config.invocation import command
from pipegen.config.overrides import given, parse
from pipegen.config.schema import (DEFAULT_LLM, LLM_KINDS, PipegenConfig, check_values, describe_keys, key_info,
                                   schema_keys)
from pipegen.config.schema import register as register_schema


def shipped_conf_dir() -> Path:
    """The shipped config folder: the checkout's top-level conf/, installed as the package `pipegen.conf`
    (pyproject.toml's package-dir), so an editable install finds the checkout's folder and a wheel its own
    pipegen/conf/. Located, not imported."""
    spec = importlib.util.find_spec("pipegen.conf")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("pipegen's conf/ folder is not installed (pipegen.conf): reinstall pipegen "
                           "(./launch.sh --setup, or pip install . in a checkout)")
    return Path(list(spec.submodule_search_locations)[0]).resolve()


CONF_DIR = shipped_conf_dir()
PRIMARY = "pipegen"


def verl_config_dir() -> str:
    """verl's trainer/config folder, found without executing verl's __init__ (which costs ~5 s)."""
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("verl is not installed: run ./launch.sh --setup, or pip install . in a checkout of pipegen")
    return os.path.join(list(spec.submodule_search_locations)[0], "trainer", "config")


# pipegen's own groups: every key of them is the schema's, so a new key (+key) there could only be ignored
PIPEGEN_GROUPS = ("actors", "generation", "trainer", "reward", "external", "export", "llm", "cluster",
                  "streams", "ray_kwargs")
VERL_GROUPS = ("actor_rollout_ref", "data", "distillation")  # verl's own YAML: only a composition knows its keys


def new_key_allowed(key: str) -> bool:
    """Where a new key (`+key=...`) means something: inside a free-form keyword group (a reward's reward_kwargs, a
    chat template's or an agent loop's kwargs, an engine's kwargs, ray.init's ray_kwargs.ray_init), never at
    pipegen's root, in its own groups or in verl's groups, whose code reads only the keys they have."""
    return any(part.endswith("kwargs") or part == "ray_init" for part in key.split(".")[1:-1])


def refuse_new_keys(overrides: list[str]) -> None:
    """A `+key` anywhere but a kwargs group would be accepted and ignored (pipegen's keys, verl's, or a group
    neither has, such as +reward_model.enable): one line instead."""
    for override in overrides:
        parsed = parse(override)
        if parsed is None or parsed.prefix not in ("+", "++"):
            continue
        key = parsed.key
        if new_key_allowed(key):
            continue
        root = key.split(".", 1)[0]
        close = did_you_mean(key, pipegen_keys()) if root not in VERL_GROUPS else ""
        owner = "verl's code pipegen runs reads no such key" if root in VERL_GROUPS else "pipegen has no such key"
        raise ValueError(f"+{key}: {owner}, and a new one would be ignored; "
                         + (f"did you mean {close}? " if close else "")
                         + "(a leading + adds a key only to a kwargs group, as in "
                         "+custom_reward_function.reward_kwargs.NAME=VALUE)")


@functools.cache
def default_config() -> DictConfig:
    """The config no override changes, pipegen's and verl's groups (composed once per process): what a key is
    looked up in before the command line's own composition."""
    return compose(["output_dir=DIR"])


@functools.cache
def known_keys() -> list[str]:
    """Every key of the default config, pipegen's and verl's groups, dotted."""
    known: list[str] = []

    def walk(node, prefix: str) -> None:
        for k in node:
            value = node._get_node(k) if OmegaConf.is_config(node) else None
            path = f"{prefix}{k}"
            child = node.get(k) if isinstance(node, DictConfig) else None
            if isinstance(child, DictConfig):
                walk(child, path + ".")
            elif value is not None:
                known.append(path)

    walk(default_config(), "")
    return known


def unknown_key_line(key: str, known: list[str] | None = None) -> str:
    """The one line refusing a key the config does not have, with the closest known keys (`known`: every key of
    the composed config when not given)."""
    close = did_you_mean(key, known)
    plus = f" (a new key there needs a leading +, as in +{key}=...)" if new_key_allowed(key) else ""
    return f"unknown key '{key}'" + (f"; did you mean {close}?" if close else f": check its spelling against "
                                     f"{help_command()}") + plus


def unknown_verl_key(overrides: list[str]) -> str:
    """One line for the first plain override of a key in verl's groups that Hydra's composition would refuse
    (a struct mapping of the default config without it), looked up in one composition of the defaults rather than
    the command line's; '' when none. A group choice (`a/b=...`) or a `+key` may add keys: those overrides are
    left to the composition, as is any key below a value that is no mapping."""
    parsed = [p for o in overrides if (p := parse(o)) is not None]
    if any("/" in p.key for p in parsed):
        return ""
    added = [p.key for p in parsed if p.prefix]
    keys = [p.key for p in parsed if not p.prefix and p.key.split(".", 1)[0] in VERL_GROUPS
            and not any(p.key == a or p.key.startswith(a + ".") for a in added)]
    if not keys:
        return ""
    try:
        cfg = default_config()
    except Exception:  # noqa: BLE001 (a config that does not compose is refused by the launch's own composition)
        return ""
    for key in keys:
        node: object = cfg
        for part in key.split("."):
            if not isinstance(node, DictConfig):
                break  # below a value that is no mapping: the composition judges
            if part not in node.keys():
                if OmegaConf.is_struct(node):
                    return unknown_key_line(key)
                break
            node = node._get_node(part)
    return ""


def unknown_key(overrides: list[str]) -> str:
    """One line for the first override whose key the schema alone rules out, before Hydra composes anything: a
    root key that is neither pipegen's nor one of verl's groups, or a key that pipegen's own groups (every llm and
    cluster kind's) do not have; '' when none. verl's groups, `+key` (refuse_new_keys) and `~key` are left to the
    composition."""
    known = {info.path for info in schema_keys()}
    roots = {f.name for f in fields(PipegenConfig)}
    for override in overrides:
        parsed = parse(override)
        if parsed is None or parsed.prefix:
            continue
        key = parsed.key
        root = key.split(".", 1)[0]
        if root in VERL_GROUPS or root == "hydra" or key in known or key in roots:
            continue
        if root in roots and any(key.startswith(k + ".") for k in known):
            continue  # inside a key that holds a mapping (custom_reward_function.reward_kwargs.NAME)
        return unknown_key_line(key, pipegen_keys())
    return ""


def pipegen_keys() -> list[str]:
    """pipegen's own keys (every llm and cluster kind's) and the root's names: what a typo there is compared with,
    without composing."""
    return sorted({info.path for info in schema_keys()} | {f.name for f in fields(PipegenConfig)})


def did_you_mean(key: str, known: list[str] | None = None) -> str:
    """The known keys closest to a misspelt one ('' when none is close), as "a or b" (`known`: every key of the
    composed config when not given)."""
    import difflib

    try:
        known = known_keys() if known is None else known
    except Exception:  # noqa: BLE001 (a hint only: a config that does not compose has its own error)
        return ""
    close = difflib.get_close_matches(key, known, n=2, cutoff=0.8)
    if not close:  # the last part alone: max_sample -> max_samples, generation.max_attempt -> ...max_attempts
        tails = {k.rsplit(".", 1)[-1]: k for k in known if k.startswith(key.rsplit(".", 1)[0] + ".") or "." not in key}
        close = [tails[t] for t in difflib.get_close_matches(key.rsplit(".", 1)[-1], list(tails), n=2, cutoff=0.8)]
    return " or ".join(close)


def compose(overrides: list[str]) -> DictConfig:
    """Compose the full config (pipegen + verl groups) with Hydra's compose API."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    refuse_new_keys(overrides)
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


def help_command() -> str:
    """`pipegen run --help` or `python -m pipegen.launch --help`, as the user started pipegen."""
    return f"{command('run')} --help"


def describe_config_error(error: Exception, overrides: list[str] = ()) -> str:
    """One line naming the fix for a Hydra / OmegaConf error (theirs span many lines); `overrides` tell
    which llm kind's keys were composed."""
    cause: BaseException | None = error
    while cause is not None:  # a value of the wrong type for a schema key: OmegaConf names the key
        full_key = getattr(cause, "full_key", None)
        if full_key and type(cause).__name__ == "ValidationError":
            kind = given(list(overrides), "llm") or DEFAULT_LLM
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
        return unknown_key_line(m.group(1))
    m = re.search(r"Could not find '([^'/]+)/([^']+)'", first)
    if m:
        group = m.group(1)
        options = [ln for ln in lines[2:] if not ln.startswith(("Config search path", "provider="))]
        choices = ", ".join(f"{group}={o}" for o in options if "=" not in o)
        return f"{group}={m.group(2)} does not exist" + (f"; choose {choices}" if choices else f"; see {help_command()}")
    if type(error).__name__ == "OverrideParseException":
        return f"cannot parse an override ({first}); overrides are key=value (quote lists: 'key=[a,b]')"
    return f"{first} (see {help_command()})"


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


# verl's keys that users set most, shown by --help with their values (verl's groups hold ~200 more); none that
# pipegen refuses (data.truncation, data.return_raw_chat: only their defaults are accepted)
VERL_KEYS_SHOWN = (
    "data.prompt_key", "data.filter_overlong_prompts", "data.shuffle", "data.seed",
    "data.apply_chat_template_kwargs",
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

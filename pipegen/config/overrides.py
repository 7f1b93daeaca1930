"""A command line's Hydra overrides read with Hydra's own parser (`OverridesParser`), so that every part of the
launch that looks at an override before composing (the engine choice, verl's keys, the new-key guard, the task
defaults) reads `+key='a=b'`, quoting and `~key` as Hydra's composition will.

An override Hydra cannot parse reads as None here: the composition that follows refuses it in one line
(config/compose.py's describe_config_error), so a reader never raises for it first.

Owns: that reading, and the one rendering of Python values as overrides (`to_overrides`: the Python entry's
keys, a config file's keys). Must never: compose a config, or change an override's text (what is handed on is
the user's own text).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
import os
from typing import Any, Mapping


@dataclass(frozen=True)
class Given:
    """One `[+|++|~]key=value` override: its prefix, its key, its value as typed (quotes kept) and as Hydra reads
    it (quotes gone, `true` a bool, `[a,b]` a list)."""

    prefix: str  # "", "+", "++" or "~"
    key: str
    text: str  # the value as typed, after the first "="
    value: Any


@functools.cache
def _parser() -> Any:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create()


@functools.cache
def parse(override: str) -> Given | None:
    """`override` as Hydra reads it; None for one Hydra cannot parse (a flag such as --help among them)."""
    from hydra.errors import HydraException

    try:
        parsed = _parser().parse_override(override)
    except HydraException:
        return None
    prefix = "~" if parsed.is_delete() else "++" if parsed.is_force_add() else "+" if parsed.is_add() else ""
    _, sep, text = override.partition("=")
    return Given(prefix, str(parsed.key_or_group), text if sep else "", parsed.value())


def given(overrides: list[str], key: str) -> str | None:
    """The value the last override of `key` sets, as Hydra reads it, as a string (None when none sets it)."""
    found = None
    for o in overrides:
        p = parse(o)
        if p is not None and p.key == key and p.prefix != "~":
            found = "" if p.value is None else str(p.value)
    return found


def keys_set(overrides: list[str]) -> set[str]:
    """The keys an override list sets or deletes."""
    return {p.key for p in map(parse, overrides) if p is not None}


GROUPS = ("llm", "cluster", "streams")  # config groups: {"llm": {"kind": "vllm", ...}} chooses llm=vllm


def render(value: Any) -> str:
    """A Python value as Hydra's override grammar reads it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(render(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ",".join(f"{k}:{render(v)}" for k, v in value.items()) + "}"
    text = os.fspath(value) if isinstance(value, os.PathLike) else str(value)
    plain = text and all(c.isalnum() or c in "/._-:@+~" for c in text) and not text[0].isdigit()
    return text if plain or _is_number(text) else "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def to_overrides(keys: Mapping[str, Any], prefix: str = "") -> list[str]:
    """`{"n": 4, "llm": {"kind": "vllm", "tp": 2}, "data.shuffle": True}` -> `["n=4", "llm=vllm", "llm.tp=2",
    "data.shuffle=true"]`. A dict value is a group of keys, except where verl's key holds a dict itself
    (e.g. data.apply_chat_template_kwargs): pass those as a dotted name with the dict as its value."""
    out: list[str] = []
    for name, value in keys.items():
        path = f"{prefix}{name}"
        if isinstance(value, Mapping) and not (prefix or "." in name) and path in GROUPS:
            value = dict(value)
            kind = value.pop("kind", None)
            if kind is not None:
                out.append(f"{path}={kind}")
            out += to_overrides(value, f"{path}.")
        elif isinstance(value, Mapping) and not any(path.endswith(k) for k in DICT_KEYS):
            out += to_overrides(value, f"{path}.")
        else:
            out.append(f"{path}={render(value)}")
    return out


DICT_KEYS = ("apply_chat_template_kwargs", "mm_processor_kwargs", "engine_kwargs", "reward_kwargs", "ray_init")

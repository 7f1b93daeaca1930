"""A command line's Hydra overrides read with Hydra's own parser (`OverridesParser`), so that every part of the
launch that looks at an override before composing (the engine choice, verl's keys, the new-key guard, the task
defaults) reads `+key='a=b'`, quoting and `~key` as Hydra's composition will.

An override Hydra cannot parse reads as None here: the composition that follows refuses it in one line
(config/compose.py's describe_config_error), so a reader never raises for it first.

Owns: that reading. Must never: compose a config, or change an override's text (what is handed on is the
user's own text).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any


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

"""Every pipegen key of the schema refuses a bad value before any process starts, in one line that names the
key and what it accepts; --help lists every key from the same schema."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipegen.launch.launcher import main as launch_main
from pipegen.config.schema import LLM_KINDS, KeyInfo, schema_keys

# Keys for which every value of their type is acceptable to the schema, with where they are checked instead.
NO_BAD_VALUE = {
    "llm.python": "any interpreter path; the launcher checks it runs SGLang before starting a server",
    "custom_reward_function.path": "any path; the launcher loads the function from it (tests/test_rewards.py)",
    "custom_reward_function.reward_kwargs": "any mapping of keyword arguments; a non-mapping is refused at launch",
    "reward.verifier_url": "any string; the launcher refuses one that is not an http(s) URL (tests/test_rewards.py)",
}


def bad_values(info: KeyInfo) -> list[str]:
    """Override values the key must refuse."""
    rule, kind = info.rule, info.type_name
    out = []
    if rule.choices is not None:
        out.append("maybe" if any(isinstance(c, bool) for c in rule.choices) else "bogus")
    elif rule.auto_or_count:
        out += ["0", "many"]
    elif rule.items is not None:
        out.append("[bogus]")
    elif kind.startswith("list"):
        out.append("5")
    elif kind in ("int", "float", "Optional[int]"):
        out.append("abc")
    if rule.at_least is not None:
        out.append(str(int(rule.at_least) - 1))
    if rule.above is not None:
        out.append(str(rule.above))
    if rule.non_empty:
        out.append("[]" if kind.startswith("list") else "")
    return out


# One bad value per key (its rule's when it has one: a wrong type is refused the same way for every key, and
# keys without a rule still exercise that path); the llm.* keys of every kind, the rest once.
CASES = [(kind, info, bad_values(info)[-1]) for kind in LLM_KINDS for info in schema_keys(kind)
         if (kind == "cpu" or info.path.startswith("llm.")) and bad_values(info)]


def test_every_key_has_a_bad_value_or_a_reason() -> None:
    keys = {info.path for kind in LLM_KINDS for info in schema_keys(kind)}
    assert keys >= set(NO_BAD_VALUE)
    unchecked = {info.path for kind in LLM_KINDS for info in schema_keys(kind) if not bad_values(info)}
    assert unchecked == set(NO_BAD_VALUE)


@pytest.mark.parametrize("kind,info,bad", CASES, ids=[f"{k}:{i.path}={b}" for k, i, b in CASES])
def test_a_bad_value_fails_in_one_line_before_anything_starts(kind: str, info: KeyInfo, bad: str,
                                                             tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    args = [f"output_dir={out}", f"llm={kind}"]
    if kind == "external" and info.path != "llm.urls":
        args.append("llm.urls=[http://127.0.0.1:9]")
    if info.path.startswith("cluster.") and info.path != "cluster.kind":
        args.append("cluster=ray")  # keys of that kind only
    if info.path != "output_dir":
        args.append(f"{info.path}={bad}")
    else:
        args[0] = f"output_dir={bad}"
    assert launch_main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pipegen: error: "), err
    assert info.path in err[0] and (info.allowed() in err[0] or "must be set" in err[0]), err[0]
    assert not out.exists()  # nothing written, so no process could have started


def test_help_lists_every_key_with_its_rule(capsys) -> None:
    assert launch_main(["--help"]) == 0
    text = capsys.readouterr().out
    for info in schema_keys("cpu"):
        assert f"  {info.path}=" in text and info.rule.help in text

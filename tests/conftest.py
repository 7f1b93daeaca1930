"""Shared fixtures: the tiny random-weight model, and running the real launcher as a user would."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fake_servers import FAKE_ENGINE_CLASS

REPO = Path(__file__).resolve().parent.parent

# The deterministic fake engine of pipegen's CPU server, chosen by import path (pipegen.testing is test code).
FAKE_ENGINE = f"llm.engine={FAKE_ENGINE_CLASS}"

# Small, fast defaults for pipeline tests: a handful of demo prompts, short answers, small batches.
# save_batch_size=4 and partial_batch_quiet_s=0.3 (defaults 64 and 300 s) make a 12-row run write several batch
# files, so these tests exercise multi-batch commits and merges; batch boundaries never change what
# trajectories.pkl holds (merge sorts rows by index, sample, trajectory). test_writer_batches.py runs
# the writer with the real defaults.
FAST = [
    "max_samples=6",
    "n=2",
    "max_response_length=24",
    "llm.max_batch=8",
    "actors.concurrency=8",
    "actors.stats_interval_s=0.5",
    "generation.save_batch_size=4",
    "generation.partial_batch_quiet_s=0.3",
    "generation.show_progress=false",
]


@pytest.fixture(scope="session")
def tiny_model() -> str:
    from pipegen.testing.tiny_models import tiny_model_path

    return tiny_model_path()


def launch(out: Path, *overrides: str, timeout: float = 240, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `python -m pipegen.launch output_dir=OUT ...` in a subprocess and return its result."""
    cmd = [sys.executable, "-m", "pipegen.launch", f"output_dir={out}", *overrides]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def load_trajectories(path: Path):
    from verl import DataProto

    return DataProto.load_from_disk(str(path))


# The SGLang server-environment resolve (test_gpu_install) spends ~3 minutes waiting on the package index:
# started when that test is collected, so the wait overlaps the rest of the suite.
SERVER_RESOLVE = pytest.StashKey()


@pytest.hookimpl(trylast=True)  # after -k/-m deselection: never started for a run that will not check it
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.name == "test_sglang_server_requirements_resolve_against_the_index" and not any(
                m.name == "skipif" and m.args and m.args[0] for m in item.iter_markers()):
            config.stash[SERVER_RESOLVE] = item.module.ServerResolve()


def pytest_unconfigure(config: pytest.Config) -> None:
    job = config.stash.get(SERVER_RESOLVE, None)
    if job is not None and job.proc.poll() is None:  # the run was interrupted before the test collected it
        job.proc.kill()
        shutil.rmtree(job.dir, ignore_errors=True)

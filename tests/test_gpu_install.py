"""The GPU install path, proven on a CPU machine: `./launch.sh` on a machine whose nvidia-smi reports a GPU
puts SGLang into its own virtualenv (from requirements/sglang-server.txt) and hands its python to the
launcher; that file's pins resolve with pip against the package index; the server is started by that
python; the GPU benchmark is skipped cleanly without a GPU. Beside it, the vLLM server's environment: set up for
llm=vllm and verl's rollout.name=vllm alike, and by the test command before pytest starts."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import REPO, SERVER_RESOLVE

SERVER_REQUIREMENTS = REPO / "requirements" / "sglang-server.txt"
# launch.sh's pip_version: the pip every virtualenv gets, and so the one ServerResolve runs
PIP = re.search(r'^pip_version="(.+)"$', (REPO / "launch.sh").read_text(), re.M).group(1)


def dry_run_setup(tmp_path: Path, nvidia_smi: str | None, *args: str) -> list[list[str]]:
    """`./launch.sh ARGS` with PIPEGEN_SETUP_DRY_RUN=1 and a fake nvidia-smi (None: none on PATH):
    the commands it would run, each split back into its argv."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    smi.unlink(missing_ok=True)
    if nvidia_smi is not None:
        smi.write_text(f"#!/bin/sh\n{nvidia_smi}\n")
        smi.chmod(0o755)
    # PATH: the fake first; then only the folders holding bash's helpers and python3, never a real nvidia-smi
    path = [str(bin_dir)] + [p for p in os.environ["PATH"].split(os.pathsep)
                             if p and not (Path(p) / "nvidia-smi").exists()]
    env = {**os.environ, "PATH": os.pathsep.join(path), "PIPEGEN_SETUP_DRY_RUN": "1",
           "PIPEGEN_VENV": str(tmp_path / "venvs" / ".venv")}
    env.pop("PIPEGEN_SGLANG_VENV", None)
    result = subprocess.run(["bash", str(REPO / "launch.sh"), *args], capture_output=True, text=True, env=env,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert not (tmp_path / "venvs").exists(), "a dry run must not create anything"
    return [shlex.split(line[2:]) for line in result.stdout.splitlines() if line.startswith("+ ")]


def test_launch_sh_takes_the_gpu_path_where_nvidia_smi_reports_a_gpu(tmp_path: Path) -> None:
    venvs = tmp_path / "venvs"
    gpu = dry_run_setup(tmp_path, 'echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-00000000)"',
                        "output_dir=runs/x", "llm=sglang")
    server_python = str(venvs / ".venv-sglang" / "bin" / "python")
    assert ["python3", "-m", "venv", str(venvs / ".venv-sglang")] in gpu
    server_install = [c for c in gpu if c[0] == server_python]
    pip_install = [server_python, "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    # a current pip first (see ServerResolve), then the server's pins
    assert server_install == [pip_install + [PIP], pip_install + ["-r", str(SERVER_REQUIREMENTS)]]
    main_python = str(venvs / ".venv" / "bin" / "python")
    main_installs = [c for c in gpu if c[0] == main_python and "pip" in c]
    assert main_installs[0][-1] == PIP
    assert [c for c in main_installs if f"{REPO}[test]" in c], main_installs  # pipegen itself, no sglang extra
    assert not any(a.startswith("torch==") for c in main_installs for a in c)  # the CUDA torch, not the CPU pin
    # the launcher is handed the server environment's python (pipegen/config/schema.py: llm.python)
    assert ["export", f"PIPEGEN_SGLANG_PYTHON={server_python}"] in gpu
    assert gpu[-1] == ["exec", main_python, "-m", "pipegen.launch", "output_dir=runs/x", "llm=sglang"]

    for no_gpu in (None, "exit 9"):  # no nvidia-smi, or one that finds no GPU (a driver without a device)
        cpu = dry_run_setup(tmp_path, no_gpu, "--setup")
        assert not any(".venv-sglang" in a for c in cpu for a in c), cpu
        assert [main_python, "-m", "pip", "install", "--disable-pip-version-check", "-q", "torch==2.14.1",
                "torchvision==0.29.1"] in cpu  # the pair built together: verl reads pictures through torchvision


def test_verls_rollout_name_vllm_sets_vllm_up_through_launch_sh_as_llm_vllm_does(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """launch.sh reads the engine from the overrides by the launcher's rule (launch/engine_choice.py): llm= first,
    else verl's actor_rollout_ref.rollout.name; vLLM's environment is made and handed over for either spelling,
    and by --tests before pytest starts."""
    vllm = tmp_path / "venvs" / "vllm"
    monkeypatch.setenv("PIPEGEN_VLLM_VENV", str(vllm))
    install = [str(vllm / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check", "-q", "-r",
               str(REPO / "requirements" / "vllm-server-cpu.txt")]
    for asked in (["llm=vllm"], ["actor_rollout_ref.rollout.name=vllm"], ["++actor_rollout_ref.rollout.name='vllm'"]):
        commands = dry_run_setup(tmp_path, None, "output_dir=runs/x", *asked)
        assert install in commands and ["export", f"PIPEGEN_VLLM_PYTHON={vllm / 'bin' / 'python'}"] in commands, asked
    for asked in (["llm=external", "actor_rollout_ref.rollout.name=vllm"], ["llm=cpu"], []):
        commands = dry_run_setup(tmp_path, None, "output_dir=runs/x", *asked)
        assert not any(str(vllm) in a for c in commands for a in c), asked
    # the test command makes it before pytest starts (tests/test_vllm.py reads PIPEGEN_VLLM_PYTHON)
    tests = dry_run_setup(tmp_path, None, "--tests")
    assert install in tests and ["export", f"PIPEGEN_VLLM_PYTHON={vllm / 'bin' / 'python'}"] in tests
    assert tests[-1][0] == "exec" and tests[-1][2:4] == ["-m", "pytest"], tests[-1]


def test_the_server_environment_pins_what_verl_expects() -> None:
    """requirements/sglang-server.txt names the SGLang version verl 0.9.1's own `sglang` extra names."""
    from importlib.metadata import requires

    verl_sglang = [r.split(";")[0].strip() for r in requires("verl") or [] if r.startswith("sglang==")]
    pins = [line.strip() for line in SERVER_REQUIREMENTS.read_text().splitlines()
            if line.strip() and not line.startswith("#")]
    assert verl_sglang and verl_sglang[0] in pins, (verl_sglang, pins)


def pypi_reachable() -> bool:
    try:
        socket.create_connection(("pypi.org", 443), timeout=5).close()
        return True
    except OSError:
        return False


# Linux x86_64 wheel tags of a current GPU machine (glibc 2.34+); pip needs each manylinux level spelled out.
PLATFORMS = [f"manylinux_2_{minor}_x86_64" for minor in range(5, 36)] + [
    "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64", "linux_x86_64"]


class ServerResolve:
    """pip's own resolver, in dry-run/report mode, for a Python 3.12 Linux GPU machine, run in the background.
    It reads each wheel's metadata alone (PyPI's PEP 658 files, else `fast-deps` HTTP range requests), so no
    CUDA wheel is downloaded: the pip that launch.sh installs into every virtualenv does that, while Python
    3.11's bundled pip 23 fetched ~3.8 GB of wheels whole into its temp folder after resolving, and filled a
    CI machine's disk. Its temp folder is watched to prove it. It waits on the network for up to a minute or
    more, so conftest starts it when the test is collected and the wait overlaps the rest of the suite."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="pipegen-sglang-resolve-"))
        self.report = self.dir / "report.json"
        self.target = self.dir / "never-written"
        self.cache = self.dir / "pip-cache"
        self.tmp = self.dir / "tmp"
        self.tmp.mkdir()
        self.stderr = self.dir / "stderr.txt"
        self.tmp_peak = 0
        cmd = [sys.executable, "-m", "pip", "install", "--isolated", "--dry-run", "--ignore-installed", "--quiet",
               "--use-feature=fast-deps", "--report", str(self.report), "--target", str(self.target),
               "--index-url", "https://pypi.org/simple", "--only-binary=:all:", "--implementation", "cp",
               "--python-version", "3.12", *[a for p in PLATFORMS for a in ("--platform", p)],
               "--cache-dir", str(self.cache), "-r", str(SERVER_REQUIREMENTS)]
        self.started = time.monotonic()
        with self.stderr.open("w") as err:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err,
                                         env={**os.environ, "TMPDIR": str(self.tmp)})

    def result(self, timeout_s: float) -> tuple[int, str, float]:
        """pip's exit code, stderr and seconds taken; `tmp_peak` is the most disk its temp folder used meanwhile."""
        deadline = time.monotonic() + timeout_s
        try:
            while self.proc.poll() is None and time.monotonic() < deadline:
                self.tmp_peak = max(self.tmp_peak, self.tmp_size())
                time.sleep(0.5)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode, self.stderr.read_text(), time.monotonic() - self.started

    def tmp_size(self) -> int:
        size = 0
        for folder, _, files in os.walk(self.tmp):  # os.walk skips a folder pip removes while it is listed
            for name in files:
                try:
                    size += os.lstat(os.path.join(folder, name)).st_blocks * 512  # fast-deps' files are sparse
                except FileNotFoundError:  # pip removed it between the listing and the stat
                    pass
        return size


@pytest.mark.slow  # pip resolves ~200 packages against PyPI (network waits, overlapped: see ServerResolve)
@pytest.mark.timeout(1500)  # network-bound and sequential in pip: the suite's 300 s default is too short for it
@pytest.mark.skipif(not pypi_reachable(), reason="needs the package index (pypi.org) to resolve the SGLang server's pins")
def test_sglang_server_requirements_resolve_against_the_index(request: pytest.FixtureRequest) -> None:
    job = request.config.stash.get(SERVER_RESOLVE, None) or ServerResolve()
    try:
        returncode, err, took = job.result(timeout_s=1200)
        assert returncode == 0, err[-4000:]
        installs = {i["metadata"]["name"].lower(): i["metadata"]["version"]
                    for i in json.loads(job.report.read_text())["install"]}
        print(f"resolved {len(installs)} packages in {took:.0f}s: sglang {installs.get('sglang')}, "
              f"torch {installs.get('torch')}, transformers {installs.get('transformers')}")
        assert installs["sglang"] == "0.5.12"
        assert "torch" in installs and "transformers" in installs
        assert not job.target.exists()
        cache = sum(f.stat().st_size for f in job.cache.rglob("*") if f.is_file())
        assert cache < 200 << 20, f"pip downloaded {cache >> 20} MiB: CUDA wheels were fetched whole"
        assert job.tmp_peak < 200 << 20, f"pip used {job.tmp_peak >> 20} MiB of disk in its temp folder: wheels fetched whole"
    finally:
        shutil.rmtree(job.dir, ignore_errors=True)


def test_sglang_servers_run_with_the_server_environments_python(tmp_path: Path) -> None:
    from pipegen.launch.servers import check_server_python, sglang_server_command
    from pipegen.launch.world import ServerPlan

    plan = ServerPlan("server_0", "127.0.0.1", 30000, (0, 1))
    argv, env = sglang_server_command(plan, "/models/m", {"python": "/opt/sglang/bin/python", "tp": 2}, 0)
    assert argv[:3] == ["/opt/sglang/bin/python", "-m", "sglang.launch_server"] and env == {"CUDA_VISIBLE_DEVICES": "0,1"}
    assert sglang_server_command(plan, "/models/m", {"python": None}, 0)[0][0] == sys.executable
    # a python without SGLang: one line naming both fixes
    problem = check_server_python("sglang", sys.executable)
    assert problem is not None and "llm.python" in problem and "launch.sh" in problem and "\n" not in problem


def test_gpu_benchmark_is_skipped_cleanly_without_a_gpu(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "pipegen.bench", "--only", "gpu", "--out", str(tmp_path / "bench.md")],
                            cwd=REPO, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 0, result.stderr[-2000:]
    assert "gpu: skipped: no GPU" in result.stdout, result.stdout
    assert "Traceback" not in result.stdout + result.stderr

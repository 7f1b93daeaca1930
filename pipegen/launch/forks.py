"""pipegen's own Python roles (actors, the writer, pipegen's CPU server with its model backend) and the launcher's
dataset read, forked from one process that imported verl, torch and transformers once.

Why: those imports are nearly all of a role's start-up, about 8 s of CPU each (torch, tensordict's torch._dynamo,
transformers' model classes, verl's agent loops). A launch paid them in the launcher, in every actor, in the writer
and in every CPU server, and again at every restart after a crash. A fork of a process that has imported them
starts in milliseconds, and its pages are shared until written. Python's multiprocessing forkserver does the
forking: a fresh interpreter, started with the first fork a launch asks for (its first server, or its dataset
read), that imports the preload list and forks on request. Hand-written here is only what makes a fork the `python -m` command it stands for: its
own session, its log as stdout and stderr, stdin from /dev/null, its environment, working directory, argv and
process title (`ps` and `pgrep -f` show the command). The command stays saved as DIR/logs/<role>.cmd.sh, and run by
hand it behaves the same.
A fork first freezes what it inherited out of the garbage collector's reach (gc.freeze): every collection of the
role would otherwise walk the forkserver's millions of objects, which made the forked CPU server 20% slower a token.

Owns: this process's forkserver and its preload list. Must never: fork anything but pipegen's own modules under
this interpreter (SGLang, vLLM and a CPU server under another `llm.python` run in their own Python environments
and are started as commands), or import a role's modules into the launcher itself.
"""

from __future__ import annotations

import atexit
import gc
import multiprocessing
import multiprocessing.forkserver
import os
import runpy
import shlex
import subprocess
import sys
import traceback
from multiprocessing.context import ForkServerContext
from pathlib import Path
from typing import Any, Callable

from pipegen.config.schema import HF_BACKEND
from pipegen.observe.logs import PARENT_ENV
from pipegen.run.handshake import ACTOR_IMPORTS, WRITER_IMPORTS

# The roles started as forks; any other command (another engine's server, a harness) runs as itself.
FORKED_MODULES = frozenset({"pipegen.actor", "pipegen.writer", "pipegen.cpu_server"})
# What the forkserver imports before its first fork: each role's start-up imports, the modules each one imports
# lazily on its way to work, and the dataset read's (launch/unit_manifest.py); the CPU server's hf backend needs
# torch and transformers' model classes, which verl's imports already hold. No module of the CPU server itself:
# the forkserver's command line lists this preload, and `pgrep -f pipegen.cpu_server` must find servers alone.
PRELOAD = tuple(dict.fromkeys((
    *ACTOR_IMPORTS, *WRITER_IMPORTS,
    "pipegen.actor.attempts", "pipegen.actor.admission", "pipegen.writer.batches", "pipegen.inputs.dataset",
    "pipegen.inputs.media", "pipegen.launch.unit_manifest", "aiohttp", "uvloop",
    "transformers.models.auto.tokenization_auto",
)))
TRACKER_WARNING = "ignore:resource_tracker:UserWarning"  # "resource_tracker: There appear to be N leaked ..."


def forkable(argv: list[str]) -> bool:
    """`argv` is `python -m <one of pipegen's forked roles> ...` under this interpreter. The CPU server is forked
    only with its model backend (`--engine hf`, the default), which imports torch and transformers: a backend named
    by import path (a test double) imports neither, and as its own command it answers without waiting for the
    forkserver's imports."""
    if not (len(argv) >= 3 and argv[0] == sys.executable and argv[1] == "-m" and argv[2] in FORKED_MODULES):
        return False
    if argv[2] == "pipegen.cpu_server" and "--engine" in argv[3:]:
        at = argv.index("--engine", 3)
        return at + 1 < len(argv) and argv[at + 1] == HF_BACKEND
    return True


def context() -> ForkServerContext:
    """The forkserver, started on the first call (it imports PRELOAD meanwhile; the first fork waits for that).
    Its environment names this process as the parent, as every child's does (observe/logs.watch_parent)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    # The forkserver and multiprocessing's resource tracker are spawned with this process's environment.
    # The tracker unlinks what a role killed by design (a stop, a crash test) left registered, such as tqdm's
    # lock, and would then warn of "leaked semaphore objects" on the launcher's terminal: that one warning is off.
    spawn_env = {PARENT_ENV: str(os.getpid()),
                 "PYTHONWARNINGS": ",".join(filter(None, [os.environ.get("PYTHONWARNINGS"), TRACKER_WARNING]))}
    before = {k: os.environ[k] for k in spawn_env if k in os.environ}
    os.environ.update(spawn_env)  # for these two spawns only, then put back as it was
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        for k in spawn_env:
            os.environ.pop(k, None)
        os.environ.update(before)
    return ctx


class ForkedRole:
    """A role forked from the forkserver, with the part of subprocess.Popen's interface the supervisor uses
    (pid, poll, wait). Its exit code reads as Popen's: negative for the signal that killed it."""

    def __init__(self, argv: list[str], env: dict[str, str], log_path: Path):
        self.args = argv
        self._proc = context().Process(target=_run_module, args=(argv, env, str(log_path), os.getcwd()),
                                       name=argv[2])
        self._proc.start()
        self.pid: int = self._proc.pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._proc.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode


def _run_module(argv: list[str], env: dict[str, str], log_path: str, cwd: str) -> None:
    """In the fork: become `argv` (python -m MODULE ARGS...) and run MODULE as __main__."""
    import setproctitle

    # the title first: setproctitle finds the memory it rewrites through the process's original environment
    setproctitle.setproctitle(shlex.join(argv))
    os.setsid()  # its own session and process group, as Popen(start_new_session=True) gives a command
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    # line-buffered, as PYTHONUNBUFFERED=1 keeps a command's log current (multiprocessing already gave stdin /dev/null)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    _fresh_random_state()
    gc.freeze()  # the forkserver's objects are this role's imports, never garbage: no collection walks them
    sys.argv = [argv[2], *argv[3:]]  # runpy puts the module's file in sys.argv[0], as `python -m` does
    atexit._clear()  # the forkserver's exit functions are not this role's; its own run below, as at a normal exit
    try:
        runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()  # as `python -m` prints it, without multiprocessing's "Process ...:" header
        raise SystemExit(1)
    finally:
        atexit._run_exitfuncs()


def _fresh_random_state() -> None:
    """numpy's global generator was seeded once, in the forkserver: reseed it from the OS as a new process would
    (Python's `random` reseeds itself after a fork)."""
    import numpy as np

    np.random.seed()


def call_forked(fn: Callable[..., Any], *args: Any, log_path: Path | None = None) -> Any:
    """`fn(*args)` in a fork of the forkserver (it has imported what `fn` needs); returns its result or raises
    its exception here. Interrupted (Ctrl-C, SIGTERM), the fork is killed before the exception goes on."""
    ctx = context()
    receive, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_call, args=(send, fn, args, str(log_path) if log_path else None),
                       name=getattr(fn, "__name__", "call"))
    proc.start()
    send.close()
    try:
        while not receive.poll(0.2):
            if not proc.is_alive() and not receive.poll(0):
                raise RuntimeError(f"{getattr(fn, '__name__', fn)} died with exit code {proc.exitcode} before it "
                                   f"answered" + (f"; see {log_path}" if log_path else ""))
        ok, value = receive.recv()
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join()
        receive.close()
    if ok:
        return value
    raise value


def _call(send, fn: Callable[..., Any], args: tuple, log_path: str | None) -> None:
    from pipegen.observe.logs import setup_logging

    if log_path:  # the call's prints (verl's "dataset len: 96", datasets' bars) and log lines go to the log alone
        sys.stdout.flush()
        sys.stderr.flush()
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    setup_logging("launch")
    try:
        result = (True, fn(*args))
    except BaseException as e:  # noqa: BLE001 - every failure goes back to the caller, which raises it
        result = (False, e)
    try:
        send.send(result)
    except Exception:  # an exception that does not pickle: its type and text still reach the caller
        send.send((False, RuntimeError(f"{type(result[1]).__name__}: {result[1]}")))
    send.close()

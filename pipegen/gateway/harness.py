"""Running the user's harness for one unit, unmodified: it gets a base URL and a key, nothing else changes.

- `external.harness=module:function` or `external.harness=path/to/file.py:function`: called as
  `function(row, base_url, api_key)`; sync (in a thread) or async. Its return value is the result. A file is
  loaded as `custom_reward_function.path`'s is: by its path (the launch makes it absolute, `absolute_target`),
  with its own folder on sys.path so that its siblings import, as `python file.py` has. A module name is
  imported; one that is not installed is then looked for in the current folder, as `python -c 'import NAME'`
  finds it there (an actor's current folder is its launcher's). Either is loaded once per process.
- `external.command='...'`: a shell command with `OPENAI_BASE_URL` (ends in /v1), `OPENAI_API_KEY`,
  `ANTHROPIC_BASE_URL` (the same session without /v1, as Anthropic's SDK expects), `ANTHROPIC_API_KEY` and
  `PIPEGEN_ROW` (a JSON file holding the row) set, in its own process group. Its result is the JSON value on its
  last stdout line, if that line is one.
A result is a number (the reward), an object with `reward` and other fields, or nothing. A harness module that
imports an SDK pipegen's examples extra installs (openai, anthropic, openai-agents) when it is missing fails its
unit with one line naming the extra.
`external.timeout_s` bounds each unit; a command past it is killed with its whole process group. A callable
run in a thread cannot be killed: past its limit the unit fails and its session closes, so its later calls are
refused.

Owns: how a harness is started, stopped and read. Must never: let a harness failure pass as a result (a crash,
a timeout or a result of the wrong shape raises `HarnessFailed` with the reason and the stderr tail), or drop a
command's stderr tail (an exit 0 keeps it in the result, for a unit that fails later).
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import importlib.util
import inspect
import os
import signal
import sys
import tempfile
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import orjson

from pipegen.distribution import pip_install

STDERR_TAIL_CHARS = 2000  # what of a failed command's stderr goes into its failure reason
# the SDKs pipegen's examples extra installs (pyproject.toml): import name -> package
EXAMPLE_SDKS = {"openai": "openai", "anthropic": "anthropic", "agents": "openai-agents"}
EXAMPLES_EXTRA = pip_install("examples")


class HarnessFailed(RuntimeError):
    """The harness crashed, timed out, made no call, or returned something that is not a result."""


@dataclass(frozen=True)
class HarnessResult:
    reward: float | None
    fields: dict[str, Any]  # the result's other fields (row data for the unit)
    stderr: str = ""  # a command's stderr tail ("; stderr tail: ..."), kept whatever its exit code


@dataclass(frozen=True)
class Harness:
    """What `external.*` configures: a callable or a command, and the per-unit limit."""

    target: str | None
    command: str | None
    timeout_s: float

    @classmethod
    def from_config(cls, external: Any) -> "Harness":
        target, command = external.harness, external.command
        if bool(target) == bool(command):
            raise ValueError("the external agent loop needs exactly one of external.harness=module:function or "
                             "external.command='...'")
        return cls(target or None, command or None, float(external.timeout_s))

    def callable(self) -> Callable[..., Any]:
        return load_callable(str(self.target))

    async def run(self, row: dict[str, Any], base_url: str, api_key: str) -> HarnessResult:
        if self.command:
            return await self._run_command(row, base_url, api_key)
        return await self._run_callable(row, base_url, api_key)

    async def _run_callable(self, row: dict[str, Any], base_url: str, api_key: str) -> HarnessResult:
        fn = self.callable()
        try:
            if inspect.iscoroutinefunction(fn):
                value = await asyncio.wait_for(fn(row, base_url, api_key), self.timeout_s)
            else:
                value = await asyncio.wait_for(in_own_thread(fn, row, base_url, api_key), self.timeout_s)
        except asyncio.TimeoutError:
            raise HarnessFailed(f"harness {self.target} ran past external.timeout_s={self.timeout_s:g}") from None
        except Exception as e:
            raise HarnessFailed(f"harness {self.target} raised {type(e).__name__}: {e}") from e
        return result_of(value, f"harness {self.target}")

    async def _run_command(self, row: dict[str, Any], base_url: str, api_key: str) -> HarnessResult:
        with tempfile.NamedTemporaryFile("wb", prefix="pipegen-row-", suffix=".json", delete=False) as f:
            f.write(orjson.dumps(row, default=str))
        env = {**os.environ, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": api_key,
               "ANTHROPIC_BASE_URL": base_url.removesuffix("/v1"), "ANTHROPIC_API_KEY": api_key,
               "PIPEGEN_ROW": f.name}
        try:
            proc = await asyncio.create_subprocess_shell(self.command, stdout=asyncio.subprocess.PIPE,
                                                         stderr=asyncio.subprocess.PIPE, env=env,
                                                         start_new_session=True)
            try:
                out, err = await asyncio.wait_for(proc.communicate(), self.timeout_s)
            except (asyncio.TimeoutError, asyncio.CancelledError) as e:
                _kill_group(proc.pid)
                out, err = await proc.communicate()
                if isinstance(e, asyncio.CancelledError):
                    raise
                raise HarnessFailed(f"command ran past external.timeout_s={self.timeout_s:g}"
                                    f"{tail(err)}") from None
        finally:
            os.unlink(f.name)
        if proc.returncode != 0:
            raise HarnessFailed(f"command exited with status {proc.returncode}{tail(err)}")
        lines = out.decode(errors="replace").strip().splitlines()
        try:
            value = orjson.loads(lines[-1]) if lines else None
        except orjson.JSONDecodeError:
            value = None  # a last line that is not JSON: the command printed no result
        if not isinstance(value, (int, float, dict)) or isinstance(value, bool):
            value = None
        try:
            result = result_of(value, "command")
        except HarnessFailed as e:
            raise HarnessFailed(f"{e}{tail(err)}") from None
        return replace(result, stderr=tail(err))


def split_target(target: str) -> tuple[str, str]:
    """`module:function` or `path/to/file.py:function` -> (module or path, function); ValueError otherwise."""
    where, _, name = target.rpartition(":")
    if not where or not name:
        raise ValueError(f"external.harness={target!r}: use module:function or path/to/file.py:function")
    return where, name


def is_file_target(where: str) -> bool:
    return where.endswith(".py") or "/" in where or where.startswith("~")


def absolute_target(target: str, cwd: str | None = None) -> str:
    """external.harness with a file's path made absolute (from `cwd`, the launcher's folder), so that every actor
    loads the same file wherever it runs; a module name unchanged. ValueError, one line, for a missing file."""
    where, name = split_target(target)
    if not is_file_target(where):
        return target
    path = Path(os.path.expandvars(os.path.expanduser(where)))
    if not path.is_absolute():
        path = Path(cwd or os.getcwd()) / path
    if not path.is_file():
        raise ValueError(f"external.harness={target}: {path} is no such file; give the .py file holding {name} "
                         f"(path/to/file.py:{name}) or an importable module (module:{name})")
    return f"{path.resolve()}:{name}"


@functools.cache
def load_callable(target: str) -> Callable[..., Any]:
    """The harness function `target` names, its module loaded once in this process (see the module's header)."""
    where, name = split_target(target)
    try:
        loaded = _load_file(where) if is_file_target(where) else _import_module(where)
    except ModuleNotFoundError as e:
        sdk = EXAMPLE_SDKS.get((e.name or "").partition(".")[0])
        if sdk is None:
            raise
        raise HarnessFailed(f"external.harness={target}: needs the {sdk} SDK, which is not installed: "
                            f"{EXAMPLES_EXTRA}") from None
    fn = getattr(loaded, name, None)
    if not callable(fn):
        raise ValueError(f"external.harness={target!r}: {where} has no callable {name}")
    return fn


def _import_module(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        here = os.getcwd()
        if e.name != module.partition(".")[0] or here in sys.path:
            raise  # a module the harness imports is missing, or the current folder was searched already
        sys.path.append(here)  # `python -c` searches the current folder; an installed package still wins
        return importlib.import_module(module)


def _load_file(where: str) -> Any:
    path = Path(os.path.expandvars(os.path.expanduser(where))).resolve()
    if not path.is_file():
        raise ValueError(f"external.harness: {path} is no such file; give the .py file holding the harness")
    if str(path.parent) not in sys.path:
        sys.path.append(str(path.parent))  # its siblings import, as they do under `python file.py`
    name = f"pipegen_harness_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before it runs: dataclasses and pickling look their module up by name
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def in_own_thread(fn: Callable[..., Any], *args: Any) -> asyncio.Future:
    """fn(*args) in a thread of its own, as a future of this event loop. Not the default executor: a harness
    blocks its thread while it waits on the gateway, and the gateway's own work (verl's tool parser decodes in
    the default executor) must never queue behind it. A daemon thread: one past its limit never holds the
    actor's exit."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(value: Any, error: BaseException | None) -> None:
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(value)

    def target() -> None:
        try:
            value = fn(*args)
        except BaseException as e:  # noqa: BLE001  (handed to the awaiting unit)
            loop.call_soon_threadsafe(settle, None, e)
        else:
            loop.call_soon_threadsafe(settle, value, None)

    threading.Thread(target=target, name="pipegen-harness", daemon=True).start()
    return future


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def tail(stderr: bytes) -> str:
    text = stderr.decode(errors="replace").strip()
    return f"; stderr tail: {text[-STDERR_TAIL_CHARS:]}" if text else ""


def result_of(value: Any, who: str) -> HarnessResult:
    """A harness's return value as a result (see the module docstring)."""
    if value is None:
        return HarnessResult(None, {})
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return HarnessResult(float(value), {})
    if isinstance(value, dict):
        reward = value.get("reward")
        if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float))):
            raise HarnessFailed(f"{who} returned reward={reward!r}: a number is needed")
        return HarnessResult(None if reward is None else float(reward),
                             {k: v for k, v in value.items() if k != "reward"})
    raise HarnessFailed(f"{who} returned a {type(value).__name__}: return a number, an object with 'reward', "
                        "or nothing")

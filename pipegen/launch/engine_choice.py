"""Which engine a launch runs, and why, in words for the plan line: the engine follows the machine.

- `llm=KIND` on the command line: that kind. `llm=cpu` on a machine with GPUs still runs, and the reason says
  the GPUs go unused.
- else verl's own way to pick one, `actor_rollout_ref.rollout.name=sglang|vllm`: `llm=sglang` or `llm=vllm`.
- else the machine: with visible NVIDIA GPUs and SGLang set up (./launch.sh's `.venv-sglang`, exported as
  `PIPEGEN_SGLANG_PYTHON`), `llm=sglang`; otherwise `llm=cpu` (pipegen's CPU reference server), and where GPUs
  are visible but SGLang is not set up the reason says so.

Visible GPUs: `nvidia-smi -L` must list at least one (launch.sh's own test); `CUDA_VISIBLE_DEVICES`, when set,
then says how many of them this launch may use, read as world.py's `visible_gpus` reads it for the servers. SGLang set up: `PIPEGEN_SGLANG_PYTHON`
names an interpreter that exists, or launch.sh's `.venv-sglang/bin/python` sits beside the virtualenv running
this launch (then `llm.python` is set to it).

verl's `trainer.n_gpus_per_node=0` says "no GPU": `rollout.name=sglang` (or none) is then served by pipegen's CPU
server, which speaks SGLang's protocol, and `rollout.name=vllm` by vLLM's CPU build; the reason says so.

`actor_rollout_ref.rollout.name` is checked here against an explicit `llm=`: `vllm` needs `llm=vllm` or
`llm=external`; `sglang` goes with every kind but `vllm` (pipegen's CPU server and external servers speak
SGLang's protocol).

Owns: that choice and its reason. Must never: start anything, or import torch (the choice is made before the
config is composed; `nvidia-smi` answers in well under a second).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from pipegen.config.overrides import given
from pipegen.launch.world import listed_gpus, visible_gpus

ROLLOUT_NAME = "actor_rollout_ref.rollout.name"
GPUS_KEY = "trainer.n_gpus_per_node"
ENGINE_NAMES = ("sglang", "vllm")  # verl's rollout.name values pipegen starts


@dataclass(frozen=True)
class EngineChoice:
    overrides: list[str]  # the command line with `llm=` (and `llm.python=`) added where the choice is not cpu
    kind: str
    reason: str  # why, for the plan line ("" when llm= was given and there is nothing to add)


def gpus_for_launch(env: Mapping[str, str], listed: Callable[[], int] = listed_gpus) -> int:
    """NVIDIA GPUs this launch may use: none unless nvidia-smi lists one, then world.visible_gpus's."""
    count = listed()
    return min(count, len(visible_gpus(env, lambda: count))) if count else 0


def sglang_python(env: Mapping[str, str], prefix: str = sys.prefix) -> tuple[str | None, bool]:
    """(SGLang's interpreter as launch.sh set it up, whether llm.python must name it): PIPEGEN_SGLANG_PYTHON
    when it names a file, else `.venv-sglang/bin/python` beside this virtualenv; (None, False) when neither."""
    named = env.get("PIPEGEN_SGLANG_PYTHON")
    if named:
        return (named, False) if Path(named).is_file() else (None, False)
    beside = Path(env.get("PIPEGEN_SGLANG_VENV") or Path(prefix).parent / ".venv-sglang") / "bin" / "python"
    return (str(beside), True) if beside.is_file() else (None, False)


def _gpus(n: int) -> str:
    return f"{n} NVIDIA GPU{'s' if n != 1 else ''}"


def choose_engine(overrides: list[str], env: Mapping[str, str] = os.environ,
                  listed: Callable[[], int] = listed_gpus, prefix: str = sys.prefix) -> EngineChoice:
    """The launch's engine (see the module's header). ValueError, one line, when verl's rollout.name and llm=
    disagree or rollout.name names an engine pipegen does not start."""
    kind = given(overrides, "llm")
    name = given(overrides, ROLLOUT_NAME)
    if name is not None and name not in ENGINE_NAMES:
        raise ValueError(f"{ROLLOUT_NAME}={name}: pipegen starts sglang or vllm servers (or llm=cpu, its CPU "
                         f"server; llm=external for your own)")
    no_gpu = given(overrides, GPUS_KEY) == "0"  # verl's way to say "no GPU"
    if no_gpu and kind == "sglang":
        raise ValueError(f"llm=sglang runs on GPUs and {GPUS_KEY}=0 asks for none: drop one (llm=cpu is pipegen's "
                         f"CPU server, which speaks SGLang's protocol)")
    if no_gpu and kind is None:
        if name == "vllm":
            return EngineChoice([*overrides, "llm=vllm"], "vllm",
                                f"llm=vllm: vLLM's CPU build, since {GPUS_KEY}=0 ({ROLLOUT_NAME}=vllm)")
        why = (f"{ROLLOUT_NAME}=sglang is served by pipegen's CPU server, which speaks SGLang's protocol"
               if name == "sglang" else "pipegen's CPU server")
        return EngineChoice([*overrides, "llm=cpu"], "cpu", f"llm=cpu: {GPUS_KEY}=0, so {why}")
    if kind is not None:
        if name == "vllm" and kind not in ("vllm", "external"):
            raise ValueError(f"{ROLLOUT_NAME}=vllm and llm={kind} disagree: drop one (llm=vllm starts vLLM)")
        if name == "sglang" and kind == "vllm":
            raise ValueError(f"{ROLLOUT_NAME}=sglang and llm=vllm disagree: drop one (llm=sglang starts SGLang)")
        gpus = gpus_for_launch(env, listed) if kind == "cpu" and not no_gpu else 0
        if gpus:
            python, _ = sglang_python(env, prefix)
            hint = "leave llm= out for SGLang" if python else "./launch.sh sets SGLang up for them"
            return EngineChoice(overrides, kind, f"llm=cpu as asked: the {_gpus(gpus)} visible go unused ({hint})")
        return EngineChoice(overrides, kind, "")
    if name is not None:
        return EngineChoice([*overrides, f"llm={name}"], name, f"llm={name} from {ROLLOUT_NAME}={name}")
    gpus = gpus_for_launch(env, listed)
    if not gpus:
        return EngineChoice(overrides, "cpu", "llm=cpu: no NVIDIA GPU visible, so pipegen's CPU server")
    python, name_it = sglang_python(env, prefix)
    if python is None:
        return EngineChoice(overrides, "cpu",
                            f"llm=cpu: {_gpus(gpus)} visible but SGLang is not set up (./launch.sh sets it up): "
                            f"the GPUs go unused")
    added = ["llm=sglang", *([f"llm.python={python}"] if name_it and given(overrides, "llm.python") is None else [])]
    return EngineChoice([*overrides, *added], "sglang",
                        f"llm=sglang: {_gpus(gpus)} visible and SGLang set up ({python})")

"""The CPU reference server's command line: ``python -m pipegen.cpu_server --model-path DIR [flags]``.

Owns: the flags every model backend receives (the launcher passes ``--threads``, ``--dtype`` and ``--max-batch`` to any
backend), choosing the backend class from ``--engine`` (``hf`` or an import path ``package.module:ClassName``)
and letting that class add its own flags, the log format, and running ``serve`` on uvloop.
Must never: construct or import a particular backend by name other than through ``--engine``, or start serving
on invalid flags (argparse exits with code 2 and a usage line instead).
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Optional

import uvloop

from pipegen.cpu_server.model_backend import load_backend_class
from pipegen.cpu_server.lifecycle import serve
from pipegen.cpu_server.server import CRASH_EXIT_CODE
from pipegen.observe.logs import watch_parent
from pipegen.config.schema import HF_BACKEND, CpuServers

PROG = "python -m pipegen.cpu_server"


def _engine_name(argv: Optional[list[str]]) -> str:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--engine", default=HF_BACKEND)
    return pre.parse_known_args(argv)[0].engine


def build_parser(engine: str) -> argparse.ArgumentParser:
    """The full parser: common flags, then the flags of the class ``backend`` names (added by the class)."""
    p = argparse.ArgumentParser(
        prog=PROG, description="pipegen's CPU reference server (SGLang 0.5.12 native /generate protocol)",
        epilog="--help lists the flags of the model backend chosen with --engine (default hf).")
    p.add_argument("--model-path", default=None,
                   help="local Hugging Face folder (or a pipegen short name such as smollm2-135m); required by "
                        "backends that load weights (hf), else optional (vocab/eos/context then default to "
                        "32000/2/4096)")
    p.add_argument("--host", default=CpuServers.host, help="bind address (loopback by default)")
    p.add_argument("--port", type=int, default=30000, help="0 = any free port (see --port-file)")
    p.add_argument("--port-file", default=None, help="write the bound port here once listening (atomic)")
    p.add_argument("--engine", default=HF_BACKEND, metavar="hf|package.module:ClassName",
                   help="hf = transformers on CPU (default); or the import path of a ModelBackend subclass")
    p.add_argument("--context-length", type=int, default=None, help="default: from config.json")
    p.add_argument("--seed", type=int, default=0, help="server seed (the backend draws without a sampling_seed, "
                                                       "fault draws)")
    p.add_argument("--threads", type=int, default=CpuServers.threads, help="torch intra-op threads (1 is best on small boxes)")
    p.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default=CpuServers.dtype,
                   help="auto = bfloat16 where the CPU has avx512_bf16/amx_bf16, else float32")
    p.add_argument("--max-batch", type=int, default=CpuServers.max_batch, help="max requests running together")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--incremental-streaming-output", action="store_true",
                   help="a streamed answer's chunks carry only their new ids and log-probs (SGLang's flag); "
                        "without it each chunk holds the answer so far")
    p.add_argument("--unknown-key-status", type=int, choices=(400, 500), default=400,
                   help="unknown sampling_params key: 400 (SGLang 0.5.23) or bare 500 (0.5.12)")
    faults = p.add_argument_group("fault injection")
    faults.add_argument("--fail-rate", type=float, default=0.0,
                        help="fraction of /generate answered 503 (queue full)")
    faults.add_argument("--hang-rate", type=float, default=0.0, help="fraction of /generate never answered")
    faults.add_argument("--crash-after", type=int, default=None,
                        help=f"the (K+1)-th /generate request kills the process (exit code {CRASH_EXIT_CODE})")
    faults.add_argument("--startup-delay", type=float, default=0.0,
                        help="seconds to wait after binding before loading (tests of the 503 startup window)")
    p.add_argument("--stats-interval", type=float, default=30.0, help="seconds between stats log lines (0 = off)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    try:
        backend_class = load_backend_class(engine)
    except ValueError as exc:
        p.error(str(exc))
    backend_class.add_arguments(p)
    p.set_defaults(backend_class=backend_class)
    return p


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """Parse and check the command line; ``args.backend_class`` is the ModelBackend subclass to build."""
    p = build_parser(_engine_name(argv))
    args = p.parse_args(argv)
    if args.backend_class.requires_model_path and not args.model_path:
        p.error(f"--model-path is required for --engine {args.engine}")
    for name in ("fail_rate", "hang_rate"):
        if not 0.0 <= getattr(args, name) <= 1.0:
            p.error(f"--{name.replace('_', '-')} must be in [0, 1]")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s.%(msecs)03d %(levelname)s %(name)s: %(message)s",
                        datefmt="%Y-%m-%d %H:%M:%S", force=True)  # a fork (launch/forks.py) has handlers
    watch_parent()  # started by a launcher: exit with it, even when it is SIGKILLed
    return uvloop.run(serve(args))

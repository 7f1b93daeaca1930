"""The CPU reference server's process life: bind the port first and load the model after, so liveness
(`/health` 503, `/get_model_info`) is visible while the model loads; then serve until SIGTERM/SIGINT.

Owns: resolving the model path, building the model backend and the app (server.py), the port file, the
periodic stats log, and an orderly shutdown.
Must never: handle a request itself (server.py does), or bind anything but the given host.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import time
from pathlib import Path

from aiohttp import web

from pipegen.cpu_server.model_backend import read_model_facts
from pipegen.cpu_server.server import ReferenceServer, build_app
from pipegen.run.atomic import replace_unsynced

log = logging.getLogger("pipegen.cpu_server")


async def serve(args: argparse.Namespace) -> int:
    """Bind, then load, then serve until SIGTERM/SIGINT. Returns the exit code."""
    if args.model_path and not Path(args.model_path).is_dir():
        from pipegen.inputs.models import resolve_model_path

        args.model_path = resolve_model_path(args.model_path)
    facts = read_model_facts(args.model_path)
    backend = args.backend_class.from_args(facts, args)
    server = ReferenceServer(args, backend, facts)
    app = build_app(server)
    runner = web.AppRunner(app, handler_cancellation=True,
                           access_log=logging.getLogger("aiohttp.access") if args.log_level == "debug" else None)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port, reuse_address=True)
    await site.start()
    sockets = getattr(getattr(site, "_server", None), "sockets", None) or []
    server.port = sockets[0].getsockname()[1] if sockets else args.port
    log.info("pipegen reference server listening on http://%s:%d (backend=%s, model=%s, context=%d)",
             args.host, server.port, backend.name, args.model_path or "-", backend.context_length)
    if args.port_file:
        replace_unsynced(Path(args.port_file), str(server.port).encode())

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    if args.startup_delay > 0:
        await asyncio.sleep(args.startup_delay)
    t0 = time.monotonic()
    try:
        await asyncio.to_thread(backend.load)
    except Exception:
        log.exception("model load failed: %s", args.model_path)
        await runner.cleanup()
        return 1
    await backend.start()
    server.ready.set()
    log.info("model backend %s loaded in %.2f s; The server is fired up and ready to roll!", backend.name,
             time.monotonic() - t0)
    stats_task = loop.create_task(server.log_stats_periodically(args.stats_interval)) \
        if args.stats_interval > 0 else None
    await stop.wait()
    log.info("shutting down")
    if stats_task:
        stats_task.cancel()
    await backend.close()
    await runner.cleanup()
    return 0

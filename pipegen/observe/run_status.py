"""`python -m pipegen.status DIR [--json]`: a snapshot of any run directory, live, finished or crashed.
(`--verify` checks it against its contract instead: observe/verify.py; `--follow` prints each finished unit's
line as it lands, across every shard, surviving a relaunch and an empty directory.)

Shows: the run's state (running / finished / finished with failures / stopped before completion),
progress (done/total: committed, and finished in the shards not yet batched, which a Ctrl-C leaves durable;
batches, pending, in flight, failed units with their reasons), rates from
the stats stream (units/s and output tokens/s, recent and over the current processes; latency
p50/p95), what the outputs look like over every launch of the run (finish reasons, response lengths,
turns, mean reward, errors by kind, duplicates dropped, torn lines skipped), per-role liveness (the pid of each role's latest
stats line, whether that process is alive, the age of that line; who holds DIR/.writer.lock) and
where the logs are. Exit status 0 for any run directory; 2 with one line for a path that is not one.

Owns: reading a run directory into a human (or --json) report.
A storage url (s3://bucket/prefix) is read from the store alone (transport/store_read.py) into a local read cache.

Must never: write anything under DIR, take or break the writer lock, signal a process, or import
verl/torch (it must answer in well under a second beside a busy run).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import orjson

from pipegen.run.checkpoint import failure_summary, load_checkpoint
from pipegen.run.integrity import DamagedFile
from pipegen.run.layout import BATCH_GLOB, RunDir
from pipegen.run.ownership import LockStatus, lock_status
from pipegen.run.store import StoreError, read_publish_state
from pipegen.observe.progress import snapshot
from pipegen.run.unit_progress import progress_summary
from pipegen.observe.startup import startup_phases
from pipegen.observe.stats import (CPU_BOUND, aggregate, across_processes, history_rates, human_rate, line_alive,
                                   stats_history, tail_text)
from pipegen.run.stats_line import ActorStats, ClusterStats, WriterStats


@dataclass
class RoleStatus:
    name: str
    pid: int | None = None
    host: str | None = None
    alive: bool | None = None  # None: on another host, unknown from here
    stats_age_s: float | None = None
    final: bool = False
    log: str | None = None
    log_age_s: float | None = None
    cpu_busy: float | None = None  # an actor's CPU time / wall time over its last stats interval


@dataclass
class RunStatus:
    root: str
    state: str
    hint: str
    progress: dict[str, Any]
    rates: dict[str, Any]
    metrics: dict[str, Any]
    roles: list[RoleStatus]
    writer_lock: LockStatus
    failed_units: dict[str, Any]
    logs: str
    logs_files: list[dict[str, Any]] = field(default_factory=list)
    servers: list[dict[str, Any]] = field(default_factory=list)  # {"url", "answering"}
    startup: dict[str, Any] | None = None  # this launch's start-up phases (pipegen/observe/startup.py)
    cluster: ClusterStats | None = None  # cluster=ray: the launcher's latest cluster line (launch/ray_placement.py)
    store: str = ""  # storage.url: what the writer published to the object store and what it waits on


class NotARun(Exception):
    pass


def _storage_url(run: RunDir) -> str:
    """The run's storage.url ('' for a run without a store, or a config that cannot be read)."""
    from pipegen.run.config import load_run_config

    try:
        return str(load_run_config(run).storage.url or "")
    except Exception:  # noqa: BLE001 (status names a damaged config elsewhere)
        return ""


def _n_from_config(run: RunDir) -> int:
    """n from the saved config, without composing anything (a plain YAML read)."""
    from pipegen.run.config import load_run_config

    return int(load_run_config(run).actor_rollout_ref.rollout.n)


def _log_files(run: RunDir, now: float) -> list[dict[str, Any]]:
    out = []
    if run.logs.is_dir():
        for p in run.log_files():
            try:
                st = p.stat()
            except OSError:
                continue
            out.append({"file": p.name, "bytes": st.st_size, "age_s": now - st.st_mtime})
    return out


def gather(run: RunDir, ignore_pid: int | None = None) -> RunStatus:
    """Read everything status shows. Raises NotARun for a path that is not a run directory. `ignore_pid`: a
    process whose liveness does not make the run "running" (the launcher writing its run's report at its end)."""
    if not run.root.is_dir():
        raise NotARun(f"{run.root} does not exist")
    if not run.config_file.exists():
        raise NotARun(f"{run.root} is not a pipegen run directory (no conf/config.yaml)")
    now = time.time()
    n = _n_from_config(run)
    load_checkpoint(run.checkpoint)  # a damaged one is said (DamagedFile, with its fix), not shown as empty
    snap = snapshot(run, n)
    history = stats_history(run.stats)
    rates = history_rates(history)
    snap.metrics = aggregate(across_processes(history))  # outputs of every launch, not the newest only
    lock = lock_status(run.writer_lock)
    logs = _log_files(run, now)
    log_by_role = {Path(entry["file"]).stem: entry for entry in logs if entry["file"].endswith(".log")}

    roles: list[RoleStatus] = []
    names = sorted(set(snap.roles) | {r for r in log_by_role if not r.startswith("launch")},
                   key=lambda r: (not r.startswith("launch"), not r.startswith("writer"), r))
    for name in names:
        line = snap.roles.get(name)
        rs = RoleStatus(name)
        if line is not None:
            rs.pid = int(line.pid) if line.pid is not None else None
            rs.host = line.host
            rs.alive = line_alive(line)
            rs.stats_age_s = now - float(line.time or now)
            rs.final = bool(line.final)
            rs.cpu_busy = line.cpu_busy if isinstance(line, ActorStats) else None
        entry = log_by_role.get(name)
        if entry is not None:
            rs.log = str(run.logs / entry["file"])
            rs.log_age_s = entry["age_s"]
        roles.append(rs)

    anything_alive = bool(lock.held) or any(r.alive for r in roles if r.pid is not None and r.pid != ignore_pid)
    committed_all = snap.total > 0 and snap.committed >= snap.total
    legacy = run.legacy_batch_files()
    if legacy:
        from pipegen.run.batchfile import legacy_format_message  # numpy and pyarrow: only when needed

        state = "refused: batch files in the old pickle format"
        hint = legacy_format_message(run.root, legacy)
    elif snap.complete and committed_all:
        state = "finished"
        url = _storage_url(run)
        if snap.merged and url and not run.rollouts.exists():  # read back from the store: the output is there
            from pipegen.transport.store_read import store_output

            hint = f"trajectories: {store_output(url, run)}"
        else:
            hint = (f"trajectories: {run.merged_output() or run.trajectories}" if snap.merged
                    else f"batches: {run.root / BATCH_GLOB} (not merged: generation.final_merge=false)")
    elif anything_alive and not any(r.alive is not False for r in roles if r.pid is not None and r.name != WriterStats.ROLE):
        # a writer started by hand, or left after the launcher: it commits what the shards hold, generates nothing
        state = "writer only"
        hint = ("only the writer is alive (no launcher, actor or server): it commits what the shards hold, merges "
                f"that partial output and exits; relaunch the same command to generate the rest (python -m "
                f"pipegen.launch output_dir={run.root} ...)")
    elif anything_alive:
        state = "running"
        hint = "live; rerun this command to refresh"
    elif snap.failed and snap.pending == 0:
        state = "finished with failures"
        partial = f"partial output: {run.merged_output()}; " if run.merged_output() is not None else ""
        hint = (f"{partial}{snap.failed} unit(s) failed, listed in {run.failed_units}; relaunch the same command to "
                "retry only them")
    elif not snap.roles and snap.committed == 0 and not run.checkpoint.exists():
        state = "not started"
        hint = "no process has reported yet; start it with: python -m pipegen.launch output_dir=" + str(run.root)
    else:
        state = "stopped before completion"
        partial = (f"partial output: {run.merged_output()} ({snap.committed} committed; the units left out are "
                   f"listed in {run.failed_units}); " if snap.merged and run.merged_output() is not None else "")
        hint = (f"{partial}no pipegen process of this run is alive (crashed, killed or interrupted); relaunch the same "
                "command to resume")

    progress = {
        "total": snap.total,
        "done": snap.done,  # committed + buffered: every finished unit durable on disk
        "committed": snap.committed,
        "buffered": snap.buffered,
        "batches": snap.batches,
        "pending": snap.pending,
        "in_flight": snap.in_flight,
        "requests_in_flight": snap.requests_in_flight,
        "failed": snap.failed,
        "complete": snap.complete,
        "merged": snap.merged,
    }
    # progress inside answers (run/unit_progress.py): units a crash left mid-answer, or mid-session, and their tokens
    progress["partial_units"], progress["partial_tokens"] = progress_summary(run.progress)
    servers: list[dict[str, Any]] = []
    for url in run.read_launch().servers[:16]:
        servers.append({"url": url, "answering": _answers(url) if state != "finished" else None})
    phases = startup_phases(snap.roles, run.read_launch().started)
    cluster = snap.roles.get(ClusterStats.ROLE)
    return RunStatus(str(run.root), state, hint, progress, rates, snap.metrics, roles, lock,
                     dict(snap.failed_units), str(run.logs), logs, servers,
                     {**phases.as_dict(), "text": phases.render()} if phases else None,
                     cluster if isinstance(cluster, ClusterStats) else None, store_line(run))


def store_line(run: RunDir, now: float | None = None) -> str:
    """storage.url: the writer's publishing in words (its publish.json), '' for a run without a store."""
    state = read_publish_state(run.publish_state)
    if state is None:
        return ""
    now = time.time() if now is None else now
    waiting = f"{state.waiting} batch(es) waiting to publish"
    if state.stopped:
        return f"{state.url}: publishing stopped: {state.stopped}"
    if state.down_since is not None:
        return (f"{state.url}: store unreachable for {now - state.down_since:.0f} s: {waiting} (retrying with "
                f"backoff; the run goes on locally; last error: {state.error[:160]})")
    done = "; outputs uploaded" if state.outputs_published else ""
    return f"{state.url}: {state.published} batch(es) published by writer {state.writer}, {waiting}{done}"


def _answers(url: str, timeout_s: float = 0.3) -> bool | None:
    """Whether something accepts TCP connections at url's host:port (no request is sent)."""
    import socket
    from urllib.parse import urlparse

    try:
        u = urlparse(url)
        with socket.create_connection((u.hostname, u.port or 80), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f}s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m ago"
    return f"{seconds / 3600:.1f}h ago"


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def render(st: RunStatus) -> str:
    p, m, r = st.progress, st.metrics, st.rates
    done = p["committed"] + p.get("buffered", 0)
    pct = 100.0 * done / p["total"] if p["total"] else 0.0
    out = [f"pipegen run {st.root}: {st.state.upper()}", f"  {st.hint}"]
    if p.get("buffered"):  # finished units durable in the shards count as done: nothing of them is lost
        headline = (f"{done}/{p['total']} samples done ({pct:.1f}%): {p['committed']} committed yet in "
                    f"{p['batches']} batches, {p['buffered']} durable in shards, not yet batched")
    else:
        headline = f"{p['committed']}/{p['total']} samples committed ({pct:.1f}%) in {p['batches']} batches"
    out.append(f"  progress   {headline} | pending {p['pending']} | in flight {p['in_flight']} | failed {p['failed']}")
    if p.get("partial_units"):
        out.append(f"  partial    {p['partial_units']} unit(s) hold {p['partial_tokens']} tokens of progress inside "
                   "their answers (streams/progress/; the next launch continues them)")
    if r or "latency/p50_s" in m or "gpu/busy_percent_while_generating" in m:
        parts = []
        if r:
            parts.append(f"recent {human_rate(r['recent_units_per_s'], 'units')}, "
                         f"{human_rate(r['recent_output_tokens_per_s'], 'output tok')}")
            parts.append(f"per process {human_rate(r['overall_units_per_s'], 'units')}, "
                         f"{human_rate(r['overall_output_tokens_per_s'], 'output tok')}")
        if "gpu/busy_percent_while_generating" in m:
            parts.append(f"GPUs {m['gpu/busy_percent_while_generating']:.0f}% busy while generating")
        if "latency/p50_s" in m:
            parts.append(f"latency p50 {m['latency/p50_s']:.2f}s p95 {m.get('latency/p95_s', 0):.2f}s")
        out.append("  rates      " + " | ".join(parts))
    finish = {k.split("/", 1)[1]: v for k, v in m.items() if k.startswith("finish_reason/")}
    outputs = []
    if finish:
        outputs.append("finish reasons: " + ", ".join(f"{k} {v}" for k, v in sorted(finish.items())))
    if "response_length/mean" in m:
        outputs.append(f"mean response {m['response_length/mean']:.1f} tokens")
    if "turns/mean" in m:
        outputs.append(f"mean assistant turns {m['turns/mean']:.2f}")
    if "reward/mean" in m:
        outputs.append(f"mean reward {m['reward/mean']:.3f}")
    if "actors/output_tokens" in m and m.get("actors/total"):
        outputs.append(f"output tokens {m['actors/output_tokens']}")
    if outputs:
        out.append("  outputs    " + " | ".join(outputs))
    errors = {k.split("/", 1)[1]: v for k, v in m.items() if k.startswith("errors/") and k != "errors/total"}
    if errors:
        out.append("  errors     " + ", ".join(f"{k}: {v}" for k, v in sorted(errors.items())))
    if any(m.get(f"requests/{k}") for k in ("stalled", "aborts_sent", "hedges")):
        out.append(f"  watchdog   stalled {m.get('requests/stalled', 0)} | aborted on servers "
                   f"{m.get('requests/aborts_sent', 0)} | hedged {m.get('requests/hedges', 0)} "
                   f"(won {m.get('requests/hedge_wins', 0)}, {m.get('requests/hedge_tokens', 0)} extra tokens)")
    tail = tail_text(m)
    if tail:
        out.append("  tail       " + tail)
    if any(k.startswith("writer/") for k in m):
        out.append(f"  writer     duplicates dropped {m.get('writer/duplicates', 0)} | torn lines skipped "
                   f"{m.get('writer/torn_lines', 0)} | buffered {m.get('writer/buffered', 0)} | "
                   f"unknown units {m.get('writer/unknown_units', 0)}")
    if st.store:
        out.append("  store      " + st.store)
    if st.startup:
        out.append("  start-up   " + st.startup["text"] + "  (seconds since the launch started)")
    if st.cluster:
        out += render_cluster(st.cluster)
    out.append("  processes  (pid from each role's latest stats line)")
    for role in st.roles:
        if role.pid is None:
            life = "no stats stream" if role.name.startswith("server") else "no stats yet"
            out.append(f"    {role.name:<10} {life:<28} log {_age(role.log_age_s)}")
            continue
        if role.alive is None:
            life = f"pid {role.pid} on {role.host} (other host)"
        else:
            life = f"pid {role.pid} {'alive' if role.alive else 'not running'}"
            if not role.alive and (role.final or st.state == "finished"):
                life = f"pid {role.pid} exited (done)"
        busy = f", CPU {role.cpu_busy:.0%} busy" if role.cpu_busy is not None else ""
        out.append(f"    {role.name:<10} {life:<28} last stats {_age(role.stats_age_s)}{busy}"
                   + (f", log {_age(role.log_age_s)}" if role.log else ""))
    bound = [r.name for r in st.roles if r.alive and not r.final and (r.cpu_busy or 0) >= CPU_BOUND]
    if bound:
        out.append(f"  note       {', '.join(bound)} near 100% CPU: one actor process is what limits this run; "
                   f"more actors go faster (actors.num_actors=N on the next launch)")
    lock = st.writer_lock
    if lock.held:
        out.append(f"  writer lock  held by pid {lock.pid}")
    elif lock.pid is not None:
        out.append(f"  writer lock  free (last holder pid {lock.pid})")
    else:
        out.append("  writer lock  free (no writer has run)")
    if st.failed_units:
        out.append(f"  failed units ({len(st.failed_units)}, index:sample, by reason; all in "
                   f"{RunDir(Path(st.root)).checkpoint}):")
        out.extend(f"    {line[:300]}" for line in failure_summary(st.failed_units))
    if st.servers:
        def answering(s: dict[str, Any]) -> str:
            return "" if s["answering"] is None else (" (answering)" if s["answering"] else " (not answering)")

        def driven(s: dict[str, Any]) -> str:
            limit = m.get(f"concurrency/{s['url']}")
            return "" if limit is None else f" driven at {limit} in flight"

        out.append("  servers    " + ", ".join(f"{s['url']}{answering(s)}{driven(s)}" for s in st.servers))
    files = ", ".join(f"{f['file']} ({_size(f['bytes'])}, {_age(f['age_s'])})" for f in st.logs_files)
    out.append(f"  logs       {st.logs}/  {files}")
    out.append(f"  stats      {RunDir(Path(st.root)).stats}/  (tail -f one of them to watch)")
    return "\n".join(out)


def render_cluster(line: ClusterStats) -> list[str]:
    """cluster=ray: each node's state and leases out, and the units leased again after a loss."""
    out = [f"  cluster    {len(line.nodes)} node runner(s) | units not leased yet "
           f"{line.units_queued} | leased again after a loss {line.units_released}"]
    for name, node in sorted(line.nodes.items()):
        state = "rejoined" if node.rejoined else node.state
        where = f" on {node.host}, incarnation {node.incarnation}" if node.host else ""
        error = f" ({node.error})" if node.error else ""
        out.append(f"    {name:<8} {state}{error}{where}: {node.leases_out} lease(s) out "
                   f"({node.units_out} units), {node.leases_done} done, {node.leases_lost} lost"
                   + (f", {node.units_taken_back} unstarted unit(s) taken back for idle nodes"
                      if node.units_taken_back else "")
                   + (f"; at its stop its actors had completed {node.completed} sample(s), {node.output_tokens} output "
                      f"tokens" if node.output_tokens is not None else ""))
    for release in line.releases:
        if release.units:
            after = release.all_leased_again_after_s
            when = (f"all leased again {after:.1f}s after the loss" if after is not None
                    else f"{release.left} still waiting")
            out.append(f"    lost lease of {release.node}: {release.units} open unit(s), {when}")
    return out


def usage() -> str:
    """The usage line, naming the command the user typed (`pipegen status` or `python -m pipegen.status`)."""
    from pipegen.config.invocation import command

    return (f"usage: {command('status')} DIR [--json | --verify | --follow]   (DIR: a run's output_dir; --verify "
            "checks it against its contract, every unit exactly once, and exits 1 on a problem; --follow prints "
            "each finished unit's line as it lands, in every shard of every launch, until Ctrl-C)")


FOLLOW_CHARS = 200  # of each line --follow prints: index, sample, reward, finish and the response's start
FOLLOW_POLL_S = 0.5


def follow(run: RunDir, stop_when_complete: bool = False) -> int:
    """--follow: every rollout line's start as it lands, from the first, across shards a relaunch or a new actor
    adds later (an empty or missing directory waits); Ctrl-C ends it with exit 0. `stop_when_complete`: return
    once the checkpoint says complete and every line is printed (the tests' way out)."""
    from pipegen.run.medium import ROLLOUTS, open_medium

    tailer = open_medium(run).tail(ROLLOUTS)  # the shards, or the run's Redis stream (XRANGE: no group touched)
    try:
        while True:
            for _, _, line in tailer.lines():
                sys.stdout.write(line[:FOLLOW_CHARS].decode(errors="replace").rstrip("\n") + "\n")
            sys.stdout.flush()
            if stop_when_complete and load_checkpoint(run.checkpoint).complete:
                return 0
            time.sleep(FOLLOW_POLL_S)
    except KeyboardInterrupt:
        return 0
    except BrokenPipeError:  # `--follow | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    as_json = "--json" in argv
    verify = "--verify" in argv
    following = "--follow" in argv
    args = [a for a in argv if a not in ("--json", "--verify", "--follow")]
    if any(a in ("-h", "--help") for a in args):
        print(usage())
        return 0
    if len(args) != 1:
        print(f"error: {usage()}", file=sys.stderr)
        return 2
    from pipegen.transport.store_read import StoreRun

    read = StoreRun(args[0], outputs=verify)  # a store url: the store alone, its segments as a run directory
    if read.url and following:
        print("pipegen.status: error: --follow reads a node's shards: pass its scratch folder (output_dir)",
              file=sys.stderr)
        return 2
    try:
        with read as run:
            if read.url:
                print(f"pipegen.status: {read.url} read from the store into {run.root}", file=sys.stderr)
            return show(run, as_json, verify, following)
    except StoreError as e:
        print(f"pipegen.status: error: {e}", file=sys.stderr)
        return 2


def show(run: RunDir, as_json: bool, verify: bool, following: bool) -> int:
    """`pipegen status` of one run directory: --follow, --verify, or the snapshot (text or --json)."""
    if following:
        return follow(run)
    if verify:
        if not run.root.is_dir():
            print(f"pipegen.status: error: {run.root} does not exist", file=sys.stderr)
            return 2
        from pipegen.observe.verify import main as verify_main

        return verify_main(run)
    try:
        st = gather(run)
    except NotARun as e:
        print(f"pipegen.status: error: {e}", file=sys.stderr)
        return 2
    except DamagedFile as e:
        print(f"pipegen.status: error: {e}", file=sys.stderr)
        return 2
    except (OSError, ValueError, KeyError) as e:
        print(f"pipegen.status: error: cannot read {run.root}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    try:
        if as_json:
            sys.stdout.write(orjson.dumps(asdict(st), option=orjson.OPT_INDENT_2).decode() + "\n")
        else:
            print(render(st))
        sys.stdout.flush()
    except BrokenPipeError:
        # `... | head` closed the pipe: what it wanted is shown; point stdout at /dev/null so the
        # interpreter's final flush does not fail again (the recipe of Python's signal docs)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


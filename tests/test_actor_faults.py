"""Faults around the actors: the client's routing and retries against real fake-engine servers, an actor
SIGKILLed mid-run, a flaky server (503s and hangs), a server that dies mid-run, and seeded reruns.

Servers are pipegen's CPU server with the fake model backend
(`--engine pipegen.bench.doubles.fake_backend:FakeBackend`) in real subprocesses on loopback ports. The
pipeline scenarios attach the real launcher to them with `llm=external`, so the test can give each server
its own fault flags and read its /pipegen_stats after the run; a recording proxy counts the requests per
unit (the request's `sampling_seed` is `unit_seed(seed, index, sample)`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import re
import signal
import time
from pathlib import Path

import pytest
import torch

from conftest import FAKE_ENGINE, FAST, launch, load_trajectories, wait_for_lines
from fake_servers import FakeServer, RecordingProxy, launch_external, pids_where, read_records
from pipegen.launch.world import free_port

TOKEN_LATENCY = "0.002"
FAST_EXTERNAL = [o for o in FAST if not o.startswith("llm.")]  # llm=external has no server knobs

# ------------------------------------------------------------------------------ the client (ServerPool)


@pytest.fixture(scope="module")
def servers(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pool")
    procs = {
        "a": FakeServer("a", tmp, tiny_model, "--token-latency", "0.01", "--slots", "64"),
        "b": FakeServer("b", tmp, tiny_model, "--token-latency", "0.01", "--slots", "64"),
        "always503": FakeServer("always503", tmp, tiny_model, "--fail-rate", "1.0"),
        "hangs": FakeServer("hangs", tmp, tiny_model, "--hang-rate", "1.0"),
        "oneslot": FakeServer("oneslot", tmp, tiny_model, "--token-latency", "0.05", "--slots", "1"),
        "slow": FakeServer("slow", tmp, tiny_model, "--token-latency", "0.05", "--slots", "64"),
        # one slot, and its first /generate never answered (fault_seed: the first draw a hang, the next ten not)
        "oneslot_first_hangs": FakeServer("oneslot_first_hangs", tmp, tiny_model, "--token-latency", "0.05",
                                          "--slots", "1", "--hang-rate", "0.2", seed=first_hangs_seed(0.2, LOST_BEHIND + 1)),
    }
    try:
        for p in procs.values():
            p.wait_ready()
        yield procs
    finally:
        for p in procs.values():
            p.stop()


def pool_run(urls: list[str], body, **limit_kw):
    """Run `await body(pool)` with a fresh ServerPool over urls; returns (result, pool)."""
    import aiohttp

    from pipegen.actor.admission import Admission, WatchdogLimits
    from pipegen.actor.attempts import ClientLimits, ServerPool

    async def main():
        kw = dict(request_timeout_s=10.0, max_attempts=4, backoff_base_s=0.01, backoff_max_s=0.05,
                  probe_interval_s=0.2, vocab_size=2048)
        kw.update(limit_kw)
        watchdog = kw.pop("watchdog", WatchdogLimits())  # the actor's admission policy sets the stall deadline
        limits = ClientLimits(prompt_length=64, response_length=8, max_model_len=8192, **kw)
        async with aiohttp.ClientSession() as session:
            pool = ServerPool(urls, limits, session, admission=Admission(watchdog))
            try:
                return await body(pool), pool
            finally:
                pool.close()

    return asyncio.run(main())


PARAMS = dict(temperature=1.0, top_p=1.0, top_k=-1, repetition_penalty=1.0, logprobs=True)


def gen(pool, key, seed=1, ids=(10, 11, 12), **params):
    return pool.generate("rid", prompt_ids=list(ids), sampling_params={**PARAMS, **params}, sticky_key=key,
                         sampling_seed=seed)


def test_routing_is_sticky_per_prompt_and_least_in_flight(servers):
    a, b = servers["a"], servers["b"]
    before = {n: servers[n].stats()["requests_total"] for n in ("a", "b")}

    async def body(pool):
        # 8 prompts x 3 requests each, all at once: new prompts go to the less busy server, and every
        # request of a prompt goes where its first one went
        outs = await asyncio.gather(*(gen(pool, key, seed=key * 10 + s) for key in range(8) for s in range(3)))
        return outs, {key: pool._sticky[key].url for key in range(8)}

    (outs, pinned), pool = pool_run([a.url, b.url], body)
    assert all(len(o.token_ids) == len(o.log_probs) > 0 for o in outs)
    by_url = {s.url: s.requests for s in pool.servers}
    assert by_url[a.url] == 12 and by_url[b.url] == 12  # balanced by in-flight count
    for key, url in pinned.items():
        assert sum(1 for k, u in pinned.items() if u == url) == 4
    after = {n: servers[n].stats()["requests_total"] for n in ("a", "b")}
    assert after["a"] - before["a"] == 12 and after["b"] - before["b"] == 12

    # a prompt keeps its server even when that server is busier
    async def body2(pool):
        await gen(pool, "p")
        first = pool._sticky["p"].url
        pool._sticky["p"].in_flight += 100  # pretend it is overloaded
        await gen(pool, "p")
        return first, pool

    (first, _), pool = pool_run([a.url, b.url], body2)
    assert {s.url: s.requests for s in pool.servers}[first] == 2


def test_failing_servers_leave_rotation_and_requests_go_elsewhere(servers):
    a, bad = servers["a"], servers["always503"]
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there: connection refused
    bad_before = bad.stats()["requests_total"]

    seen: dict[str, int] = {}

    async def body(pool):
        first = await asyncio.gather(*(gen(pool, key) for key in range(12)))
        seen["bad"] = bad.stats()["requests_total"] - bad_before
        second = await asyncio.gather(*(gen(pool, key) for key in range(12, 24)))
        return first + second

    outs, pool = pool_run([bad.url, dead, a.url], body, quarantine_after=2, probe_interval_s=60)
    assert all(o.token_ids for o in outs)  # every request succeeded, on the healthy server
    state = {s.url: s for s in pool.servers}
    assert not state[bad.url].healthy and not state[dead].healthy and state[a.url].healthy
    # concurrent requests may all hit a failing server before it leaves rotation, but none after
    assert state[bad.url].errors["http_503"] >= 2 and state[dead].errors["connection"] >= 2
    assert state[a.url].requests == 24 and state[a.url].successes == 24
    assert bad.stats()["requests_total"] - bad_before == seen["bad"] == state[bad.url].errors["http_503"]


def test_stalled_request_is_aborted_on_its_server_and_retried_elsewhere(servers):
    """The watchdog's mechanism (its deadline is shortened here; the pipeline test below runs the defaults):
    past the deadline the request is aborted on the hanging server by rid and re-sent elsewhere."""
    from pipegen.actor.admission import WatchdogLimits

    a, hangs = servers["a"], servers["hangs"]
    before = hangs.stats()["hung_aborted"]

    async def body(pool):
        t0 = time.monotonic()
        out = await gen(pool, "k")
        return out, time.monotonic() - t0

    (out, took), pool = pool_run([hangs.url, a.url], body, watchdog=WatchdogLimits(stall_floor_s=0.5, hedge=False))
    assert out.token_ids and took >= 0.5  # the deadline: floor + margin x 8 tokens x the prior s/token
    state = {s.url: s for s in pool.servers}
    assert state[hangs.url].errors == {"stalled": 1} and state[a.url].requests == 1
    assert pool.stalled == 1 and pool.aborts_sent == 1
    assert hangs.stats()["hung_aborted"] == before + 1 and hangs.stats()["hung_pending"] == 0


def test_a_request_waiting_in_the_engines_queue_is_never_called_stalled(servers):
    """Queued is not stalled: a server that runs one request at a time holds ten, so the last waits ~3.6 s in its
    queue, past its first look (every 2 s, whatever the clock's deadline). Its load says it holds
    every request this actor sent there: nothing is aborted, nothing re-sent, the server stays in rotation."""
    from pipegen.actor.admission import WatchdogLimits

    one = servers["oneslot"]
    before = one.stats()["requests_total"]

    async def body(pool):
        return await asyncio.gather(*(gen(pool, "k", seed=s) for s in range(10)))

    outs, pool = pool_run([one.url], body, watchdog=WatchdogLimits())  # the defaults a user gets
    assert all(o.token_ids and len(o.token_ids) == len(o.log_probs) for o in outs)  # every one answered
    assert pool.stalled == 0 and pool.aborts_sent == 0 and pool.retries == 0 and pool.servers[0].healthy
    assert one.stats()["requests_total"] - before == 10


def test_a_lost_request_is_found_while_the_engine_still_works_through_its_queue(servers, caplog):
    """A request the engine lost (accepted, never counted, never answered) on a busy server is found while later
    requests run, not once the queue has drained: the engine schedules in arrival order, so requests sent after it
    that have started long since show it is not waiting its turn. The one-slot server answers one request in 0.4 s
    while another arrives every 0.25 s, so its queue grows until ~5 s and drains at ~8 s; the defaults a user gets. (Judged from the latest start instead of the first that
    overtook it, a busy engine's steady starts hid it until the queue was empty.)"""
    import verl.workers.rollout.replica  # noqa: F401  (an answer's TokenOutput: imported up front, as an actor does)

    from pipegen.actor.admission import WatchdogLimits

    one = servers["oneslot_first_hangs"]

    async def body(pool):
        sent = []
        for s in range(LOST_BEHIND + 1):  # the lost one first; then one every 0.25 s, each in its own request
            sent.append(asyncio.ensure_future(gen(pool, "k", seed=s)))
            await asyncio.sleep(0.25)
        return await asyncio.gather(*sent)

    with caplog.at_level(logging.WARNING, logger="pipegen.client"):
        outs, pool = pool_run([one.url], body, watchdog=WatchdogLimits())
    assert all(o.token_ids for o in outs)  # the lost one re-sent and answered
    assert pool.stalled == 1 and one.stats()["hung_aborted"] == 1
    verdicts = [r.getMessage() for r in caplog.records if "stalled" in r.getMessage()]
    assert len(verdicts) == 1 and "later ones ran" in verdicts[0], verdicts


def test_a_tail_request_on_a_slower_server_is_hedged_elsewhere_from_its_streamed_tokens(servers):
    """A hedge that can win: in the tail, a long answer streaming from a server five times slower per token than
    another gets a copy there, which continues from the tokens already streamed (prompt plus those ids), not from
    token 0; the copy's answer completes the first's, the slow one is aborted. On the fastest server nothing is
    hedged: a copy there could only lose."""
    from pipegen.actor.admission import Admission, WatchdogLimits
    from pipegen.actor.concurrency import ConcurrencyControl

    fast, slow = servers["a"], servers["slow"]
    kept: list[list[int]] = []

    async def body(pool):
        from pipegen.actor.admission import TokenClock

        for rnd in range(2):  # a server's first answers pay its start-up: measure the second round only
            for srv in pool.servers:
                srv.clock = TokenClock()
            pool.admission.answers = TokenClock(window=1024)
            for s in range(10):  # each server's time per token (4 answers each at least), the latencies' p90
                await gen(pool, f"warm{rnd}-{s}", seed=s)
        pool.admission.draining = True  # the tail: nothing left to admit, capacity idle
        pool._sticky["long"] = next(srv for srv in pool.servers if srv.url == slow.url)
        out = await pool.generate("long", prompt_ids=[10, 11, 12], sticky_key="long", sampling_seed=5,
                                  sampling_params={**PARAMS, "max_new_tokens": 60, "ignore_eos": True},
                                  on_tokens=lambda rid, ids, lps: kept.append(list(ids)))
        # the same on the fastest server: no server is measurably faster, so no copy can win and none is sent
        pool._sticky["again"] = next(srv for srv in pool.servers if srv.url == fast.url)
        await pool.generate("again", prompt_ids=[10, 11, 12], sticky_key="again", sampling_seed=5,
                            sampling_params={**PARAMS, "max_new_tokens": 60, "ignore_eos": True})
        return out

    async def main():
        import aiohttp

        from pipegen.actor.attempts import ClientLimits, ServerPool

        limits = ClientLimits(prompt_length=64, response_length=8, max_model_len=8192, vocab_size=2048)
        control = ConcurrencyControl([fast.url, slow.url], 4, sharing=1, memory_cap_units=100)
        admission = Admission(WatchdogLimits(), control)  # the defaults: hedging on, at the recent p90
        async with aiohttp.ClientSession() as session:
            pool = ServerPool([fast.url, slow.url], limits, session, admission=admission)
            try:
                return await body(pool), pool
            finally:
                pool.close()

    out, pool = asyncio.run(main())
    assert pool.hedges == 1 and pool.hedge_wins == 1 and len(out.token_ids) == 60 and out.stop_reason == "length"
    prefix = max((ids for ids in kept if out.token_ids[:len(ids)] == ids), key=len)
    assert 0 < len(prefix) < 60  # the copy continued after streamed tokens, not from token 0
    assert len(out.log_probs) == 60


def test_deadline_follows_what_the_request_asks_and_what_the_server_showed():
    from pipegen.actor.admission import TokenClock, WatchdogLimits, stall_deadline

    wd = WatchdogLimits()
    clock = TokenClock()
    assert stall_deadline(clock, 100, wd) == pytest.approx(wd.stall_floor_s + wd.stall_margin * 100 * 0.1)  # prior
    for _ in range(10):
        clock.observe(2.0, 100)  # 20 ms per token
    assert stall_deadline(clock, 100, wd) == pytest.approx(wd.stall_floor_s + wd.stall_margin * 100 * 0.02)
    # a long generation gets a long deadline, never the floor alone; each stall doubles it
    assert stall_deadline(clock, 8192, wd) > 8192 * 0.02 * 2
    assert stall_deadline(clock, 100, wd, stalls=2) == pytest.approx(4 * stall_deadline(clock, 100, wd))


def test_the_hedge_threshold_follows_the_recent_p90_latency():
    """The tail hedges requests older than the recent p90; asked on every wake, it is re-sorted only every
    few answers, but it must still follow the window: a slower server shows up within a few dozen answers."""
    from pipegen.actor.admission import TokenClock

    clock = TokenClock(window=512)
    assert clock.latency_p90() is None  # nothing observed yet: no hedging
    for i in range(4):
        clock.observe(1.0 + i, 10)
    assert clock.latency_p90() == 4.0  # a short window is exact after every answer
    for _ in range(512):
        clock.observe(1.0, 10)
    assert clock.latency_p90() == 1.0
    for _ in range(100):  # a fifth of the window now takes 100 s
        clock.observe(100.0, 10)
        clock.latency_p90()
    assert clock.latency_p90() == 100.0


def test_budget_spent_raises_and_client_errors_are_not_retried(servers):
    from pipegen.actor.attempts import RequestRejected, RetriesExhausted

    bad, a = servers["always503"], servers["a"]
    before = bad.stats()["requests_total"]

    async def exhaust(pool):
        with pytest.raises(RetriesExhausted, match="HTTP 503"):
            await gen(pool, "k")

    pool_run([bad.url], exhaust, max_attempts=3, quarantine_after=10)
    assert bad.stats()["requests_total"] - before == 3

    before = a.stats()["requests_total"]

    async def rejected(pool):
        with pytest.raises(RequestRejected, match="HTTP 400"):
            await gen(pool, "k", temperature=-1.0)  # the server's 400: a client bug, never retried
        with pytest.raises(RequestRejected, match="outside the vocabulary"):
            await gen(pool, "k", ids=(10, 5000))  # refused before sending
        with pytest.raises(RequestRejected, match="context length"):
            await gen(pool, "k", ids=[10] * 9000)

    pool_run([a.url], rejected)
    assert a.stats()["requests_total"] - before == 1


def test_all_servers_down_waits_for_the_probe_to_bring_one_back(tiny_model, tmp_path):
    port = free_port()
    first = FakeServer("first", tmp_path, tiny_model, port=port).wait_ready()
    url = first.url
    first.stop()  # gone: connection refused
    later: dict[str, FakeServer] = {}

    async def body(pool):
        task = asyncio.create_task(gen(pool, "k"))
        while pool.servers[0].healthy:  # 3 refused connections take it out of rotation
            await asyncio.sleep(0.02)
        later["s"] = FakeServer("second", tmp_path, tiny_model, port=port)  # back on the same address
        return await task

    try:
        out, pool = pool_run([url], body, max_attempts=4, quarantine_after=3, probe_interval_s=0.2,
                             request_timeout_s=30)
    finally:
        if "s" in later:
            later["s"].stop()
    assert out.token_ids and pool.servers[0].healthy and pool.servers[0].quarantines == 1
    assert pool.servers[0].errors == {"connection": 3}


# ------------------------------------------------------------------------------------ pipeline scenarios


def units_of(data) -> list[tuple[int, int]]:
    nt = data.non_tensor_batch
    return [(int(i), int(s)) for i, s in zip(nt["index"], nt["sample"])]


def find_actor_pid(out: Path, rank: int = 0) -> int | None:
    """The pid of this run's actor (matched on its exact command line, never by a broad name)."""
    want = [b"pipegen.actor", f"output_dir={out}".encode(), f"rank={rank}".encode()]
    pids = pids_where("cmdline", lambda argv: all(w in argv for w in want))
    return pids[0] if pids else None


def test_actor_sigkill_mid_run_loses_nothing_duplicates_nothing_and_never_resends_a_done_unit(
        tmp_path, tiny_model):
    import subprocess
    import sys

    from conftest import REPO
    from pipegen.run.stream import unit_seed

    server = FakeServer("slow", tmp_path, tiny_model, "--token-latency", "0.02", "--slots", "4").wait_ready()
    proxy = RecordingProxy("proxy", tmp_path, server.url).wait_ready()
    out = tmp_path / "run"
    # the writer commits nothing before the end (big batches, long pull timeout): the restarted actor can
    # only learn what is done from the shard lines themselves
    overrides = [f"model_path={tiny_model}", *FAST_EXTERNAL, "max_samples=16", "actors.concurrency=4", "seed=3",
                 "generation.save_batch_size=1000", "generation.partial_batch_quiet_s=60",
                 "llm=external", f"llm.urls=[{proxy.url}]"]
    launcher = subprocess.Popen([sys.executable, "-m", "pipegen.launch", f"output_dir={out}", *overrides], cwd=REPO,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_lines(launcher, out / "streams" / "rollouts" / "actor_0" / "000000.jsonl", 8, 120)
        pid = find_actor_pid(out)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        killed_at = time.time()
        stdout, stderr = launcher.communicate(timeout=180)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        entries = proxy.entries()
        proxy.stop()
        server.stop()
    assert launcher.returncode == 0, stderr[-3000:]

    # the launcher restarted the actor, which opened a new shard and left out what the old one holds
    actor_log = (out / "logs" / "actor_0.log").read_text()
    assert actor_log.count("starting actor_0") == 2
    records = read_records(out)
    shards = {r["_shard"] for r in records}
    assert shards == {"actor_0/000000.jsonl", "actor_0/000001.jsonl"}
    before_kill = [r for r in records if r["_shard"] == "actor_0/000000.jsonl"]
    assert f"actor 0: {32 - len(before_kill)} units pending" in actor_log.split("starting actor_0")[2]

    # nothing missing, nothing duplicated
    expected = sorted((i, s) for i in range(16) for s in range(2))
    assert sorted((r["index"], r["sample"]) for r in records) == expected
    data = load_trajectories(out / "trajectories.pkl")
    assert units_of(data) == expected

    # no unit already in a shard was asked for again; units in flight at the kill were
    requests_per_seed: dict[int, list[dict]] = {}
    for e in entries:
        requests_per_seed.setdefault(e["seed"], []).append(e)
    assert len(before_kill) >= 8
    for r in before_kill:
        assert r["seed"] == unit_seed(3, r["index"], r["sample"])
        assert len(requests_per_seed[r["seed"]]) == 1, (r["index"], r["sample"])
    resent = 0
    for r in records:
        calls = requests_per_seed[r["seed"]]
        assert calls and calls[-1]["status"] == 200
        if len(calls) > 1:  # only a unit that was in flight at the kill is sent again, after it
            assert len(calls) == 2 and r["_shard"] == "actor_0/000001.jsonl"
            assert calls[0]["t"] < killed_at < calls[1]["t"]
            resent += 1
    assert len(entries) == len(expected) + resent
    assert resent <= 4  # at most actors.concurrency units were in flight


LOST_BEHIND = 20  # requests sent after the lost one


def first_hangs_seed(hang: float, after: int) -> int:
    """A server --seed whose first fault draw is a hang (with --hang-rate `hang`, no --fail-rate) and whose next
    `after` draws are not (the requests sent after it, and its own re-send)."""
    for seed in range(10000):
        rng = random.Random(f"pipegen-faults-{seed}")
        u = [rng.random() for _ in range(after + 1)]
        if u[0] < hang and all(x >= hang for x in u[1:]):
            return seed
    raise AssertionError("no seed found")


def fault_seed(fail: float, hang: float, draws: int, hangs_after: int = 0, min_hangs: int = 1) -> int:
    """A server --seed whose fault draws hold at least `min_hangs` hangs after the first `hangs_after`
    draws (and before `draws`), and some 503s early on.

    The reference server draws one `random.Random(f"pipegen-faults-{seed}").random()` per /generate in
    arrival order (u < fail: 503, u < fail + hang: never answers), so the requests' fates are fixed."""
    for seed in range(10000):
        rng = random.Random(f"pipegen-faults-{seed}")
        u = [rng.random() for _ in range(draws)]
        hangs = sum(fail <= x < fail + hang for x in u[hangs_after:])
        fails = sum(x < fail for x in u[:20])
        if hangs >= min_hangs and fails >= 3:
            return seed
    raise AssertionError("no seed found")


@pytest.mark.slow  # a whole launch with an actor restart (~40 s on 2 cores): the Done-when scenario of issue 11
def test_hangs_503s_and_a_killed_actor_with_default_timeouts(tmp_path, tiny_model):
    """20% of requests answered 503, 2% never answered, the actor SIGKILLed mid-run; nothing shortened
    (default llm.request_timeout_s, stall watchdog, concurrency and attempts): every unit exactly once,
    and every hung request was aborted on the server (/abort_request) or dropped with its killed client."""
    seed = fault_seed(0.2, 0.02, 40, hangs_after=18, min_hangs=2)  # hangs after the kill, within the run
    server = FakeServer("flaky", tmp_path, tiny_model, "--fail-rate", "0.2", "--hang-rate", "0.02",
                        "--token-latency", "0.02", seed=seed).wait_ready()
    out = tmp_path / "run"
    overrides = [f"model_path={tiny_model}", *[o for o in FAST_EXTERNAL if not o.startswith("actors.concurrency")],
                 "max_samples=16", "llm=external", f"llm.urls=[{server.url}]"]
    import subprocess
    import sys

    from conftest import REPO

    launcher = subprocess.Popen([sys.executable, "-m", "pipegen.launch", f"output_dir={out}", *overrides], cwd=REPO,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_lines(launcher, out / "streams" / "rollouts" / "actor_0" / "000000.jsonl", 6, 120)
        pid = find_actor_pid(out)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        _, stderr = launcher.communicate(timeout=240)
        stats = server.stats()
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        server.stop()
    assert launcher.returncode == 0, stderr[-3000:]
    assert stats["injected_503"] >= 3 and stats["hung"] >= 1, stats
    expected = sorted((i, s) for i in range(16) for s in range(2))
    records = read_records(out)
    assert len({r["_shard"] for r in records}) == 2  # the actor really was restarted
    assert sorted((r["index"], r["sample"]) for r in records) == expected  # each unit written exactly once
    assert not read_records(out, "failures")
    assert units_of(load_trajectories(out / "trajectories.pkl")) == expected
    # no hung request is left behind: each was aborted by the client, or went with the killed actor
    assert stats["hung_pending"] == 0, stats
    assert stats["hung_aborted"] >= 1 and stats["hung_aborted"] + stats["hung_disconnected"] == stats["hung"], stats
    from pipegen.observe.stats import read_stats

    actor = read_stats(out / "streams" / "stats" / "actor_0.jsonl")[-1]  # the last line, as `tail -f` shows it
    assert actor["aborts_sent"] >= 1 and actor["stalled"] + actor["hedges"] >= 1, actor
    # the status command shows what the watchdog did and the concurrency the server was driven at
    status = subprocess.run([sys.executable, "-m", "pipegen.status", str(out)], cwd=REPO, capture_output=True,
                            text=True, timeout=60).stdout
    assert "watchdog   stalled" in status and re.search(rf"{server.url} driven at \d+ in flight", status), status


def test_server_dying_mid_run_is_routed_around(tmp_path, tiny_model):
    dying = FakeServer("dying", tmp_path, tiny_model, "--crash-after", "4", "--token-latency", TOKEN_LATENCY)
    healthy = FakeServer("healthy", tmp_path, tiny_model, "--token-latency", TOKEN_LATENCY)
    out = tmp_path / "run"
    try:
        dying.wait_ready()
        healthy.wait_ready()
        result = launch_external(out, [dying.url, healthy.url], f"model_path={tiny_model}", *FAST_EXTERNAL,
                                 "max_samples=12", "llm.request_timeout_s=10")
        assert result.returncode == 0, result.stderr[-3000:]
        dying.proc.wait(10)
        stats = healthy.stats()
    finally:
        dying.stop()
        healthy.stop()
    assert dying.proc.returncode == 86  # --crash-after: it really died on its 5th request
    expected = sorted((i, s) for i in range(12) for s in range(2))
    assert sorted((r["index"], r["sample"]) for r in read_records(out)) == expected
    assert units_of(load_trajectories(out / "trajectories.pkl")) == expected
    assert stats["responses_by_status"]["200"] >= len(expected) - 4  # the survivor did (almost) everything
    from pipegen.observe.stats import read_stats

    actor = read_stats(out / "streams" / "stats" / "actor_0.jsonl")[-1]  # the last line, as `tail -f` shows it
    assert actor["servers_out_of_rotation"] == [dying.url]
    assert actor["errors"].get(f"{dying.url} connection", 0) >= 1


@pytest.mark.slow  # two whole launches (~45 s on 2 cores)
def test_n_samples_have_distinct_recorded_seeds_and_reruns_are_identical(tmp_path, tiny_model):
    from pipegen.run.stream import unit_seed

    args = [f"model_path={tiny_model}", *FAST, "max_samples=4", "n=3", "seed=7", FAKE_ENGINE,
            f"llm.engine_args=[--token-latency,{TOKEN_LATENCY}]"]
    runs = []
    for name in ("first", "second"):
        out = tmp_path / name
        result = launch(out, *args)
        assert result.returncode == 0, result.stderr[-3000:]
        runs.append((out, load_trajectories(out / "trajectories.pkl")))
    (out1, a), (_, b) = runs
    assert len(a) == 12 and units_of(a) == units_of(b)
    for key in a.batch.keys():
        assert torch.equal(a.batch[key], b.batch[key]), key
    records = read_records(out1)
    seeds = {(r["index"], r["sample"]): r["seed"] for r in records}
    assert len(set(seeds.values())) == 12
    assert all(seed == unit_seed(7, i, s) for (i, s), seed in seeds.items())
    # the seeds matter: the 3 samples of each prompt are different generations
    for i in range(4):
        responses = {tuple(r["trajectories"][0]["response_ids"]) for r in records if r["index"] == i}
        assert len(responses) == 3

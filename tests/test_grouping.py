"""Grouped requests: generations that are ready together go to SGLang as one batched, streamed /generate, and
every per-unit guarantee still holds. Against the fake SGLang (pipegen/bench/doubles/fake_sglang.py: SGLang's
batched protocol, each member's chunks tagged with its `index`, per-rid abort) in real subprocesses:
- a group partly aborted (two of four units stopped): only those are aborted on the server, by their own rids;
  the others are answered on the same connection;
- a group whose server dies mid-request: each unit is retried once on the other server, none twice;
- a group whose members finish at different times: each unit is answered when its own member ends;
- a server that refuses groups (pipegen's CPU server: it streams no batch): each member alone, then no groups;
- the whole pipeline on the fake: every unit once in the output, its requests grouped;
- a long answer whose tokens its unit keeps: a member of its group like any other, streamed, its chunks to its
  keeper; a keeper that cannot write fails the request once, never the server.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from conftest import FAST, load_trajectories
from fake_servers import FakeSGLang, FakeServer, launch_external, read_records
from test_actor_faults import PARAMS, pool_run


def gen(pool, key, seed, max_new=8, ids=(10, 11, 12)):
    return pool.generate(f"r{seed}", prompt_ids=list(ids), sampling_params={**PARAMS, "max_new_tokens": max_new},
                         sticky_key=key, sampling_seed=seed)


@pytest.fixture(scope="module")
def fakes(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("grouping")
    procs = {"steady": FakeSGLang("steady", tmp, "--step-ms", "20", "--front-ms", "0")}
    try:
        for p in procs.values():
            p.wait_ready()
        yield procs, tmp
    finally:
        for p in procs.values():
            p.stop()


def steady(fakes):
    """The module's steady fake SGLang and its counters before the test, once nothing is in flight there: a member
    an earlier test left behind (its client gone after a streamed chunk) ends on the fake's clock, and must not
    count in this test."""
    fake = fakes[0]["steady"]
    deadline = time.monotonic() + 10
    while (stats := fake.stats())["in_flight"] and time.monotonic() < deadline:
        time.sleep(0.02)
    return fake, stats


def test_the_group_body_keeps_each_members_ids_seed_and_rid():
    from pipegen.actor.limits import ClientLimits
    from pipegen.engines import engine
    from pipegen.engines.request import Generation

    sglang = engine("sglang")
    limits = ClientLimits(prompt_length=64, response_length=16, max_model_len=128, vocab_size=1000)
    reqs = [sglang.build(Generation.of([5, 6, i], {**PARAMS, "max_new_tokens": 4 + i}, limits, seed=100 + i))
            for i in range(3)]
    assert len({sglang.group_key(r) for r in reqs}) == 1
    body = sglang.group_body(reqs, [r.max_new_tokens + 2 for r in reqs])
    assert body["rid"] == [r.rid for r in reqs] and body["stream"] is True and body["return_logprob"] is True
    assert body["input_ids"] == [[5, 6, 0], [5, 6, 1], [5, 6, 2]]
    assert [p["sampling_seed"] for p in body["sampling_params"]] == [100, 101, 102]
    assert [p["max_new_tokens"] for p in body["sampling_params"]] == [4, 5, 6]
    # each member's own chunk interval (a member that is not kept: its first token's chunk and its last)
    assert [p["stream_interval"] for p in body["sampling_params"]] == [6, 7, 8]
    assert "n" not in body["sampling_params"][0]
    images = sglang.build(Generation.of([5, 6], PARAMS, limits, pictures=["data:image/png;base64,AAAA"]))
    assert sglang.group_key(images) is None  # pictures go one request each


def test_members_finish_at_different_times_and_each_is_answered_when_it_ends(fakes):
    fake, before = steady(fakes)

    from verl.workers.rollout.replica import TokenOutput  # noqa: F401  (imported once, before the clock starts)

    async def body(pool):
        await pool.learn_group_limits()
        t0 = time.monotonic()
        ended: dict[int, float] = {}

        async def one(seed, max_new):
            out = await gen(pool, "p", seed, max_new=max_new)
            ended[seed] = time.monotonic() - t0
            return out

        outs = await asyncio.gather(one(1, 2), one(2, 30), one(3, 4), one(4, 30))
        return outs, ended

    (outs, ended), pool = pool_run([fake.url], body)
    after = fake.stats()
    assert [len(o.token_ids) for o in outs] == [2, 30, 4, 30]
    assert all(len(o.log_probs) == len(o.token_ids) and o.stop_reason == "length" for o in outs)
    assert after["http_requests"] - before["http_requests"] == 1 and after["batch_requests"] - before["batch_requests"] == 1
    assert pool.grouped == 4 and pool.http_requests == 1
    # 20 ms a token: the 2- and 4-token members are answered long before the 30-token ones end (0.6 s). Relative,
    # not a wall-clock bound: a group answered only as a whole would end all four together
    assert max(ended[1], ended[3]) < 0.5 * min(ended[2], ended[4]), ended


def test_an_answer_kept_as_it_comes_streams_inside_its_group_and_its_chunks_reach_its_keeper(fakes):
    """A long answer whose tokens the unit keeps (actor/continuation.py) goes in the same grouped request as the
    short ones ready with it (a user's default 4,096-token job gets both grouping and kept tokens), and each
    unfinished chunk's ids and log-probs so far reach the keeper, a prefix of the answer."""
    fake, before = steady(fakes)
    kept: list[tuple[str, list[int], list[float] | None]] = []

    async def body(pool):
        await pool.learn_group_limits()
        return await asyncio.gather(
            pool.generate("long", prompt_ids=[10, 11, 12], sampling_params={**PARAMS, "max_new_tokens": 12},
                          sticky_key="p", sampling_seed=1, on_tokens=lambda *a: kept.append(a)),
            gen(pool, "p", 2, max_new=4), gen(pool, "p", 3, max_new=4))

    (long, *_), pool = pool_run([fake.url], body)
    after = fake.stats()
    assert len(long.token_ids) == 12 and long.stop_reason == "length"
    assert kept and all(ids == long.token_ids[:len(ids)] and lps == long.log_probs[:len(ids)]
                        for _, ids, lps in kept)
    # the three went together
    assert after["batch_requests"] - before["batch_requests"] == 1 and after["http_requests"] - before["http_requests"] == 1
    assert pool.grouped == 3


def test_tokens_that_cannot_be_kept_fail_the_request_once_and_never_the_server(fakes):
    """The unit's progress file cannot be written (a full disk): the request fails at once with ProgressLost, is
    never re-sent, and the server stays in rotation (the next request is answered)."""
    from pipegen.actor.attempts import ProgressLost

    fake, before = steady(fakes)

    def full_disk(*_):
        raise OSError(28, "No space left on device")

    async def body(pool):
        with pytest.raises(ProgressLost, match="No space left on device"):
            await pool.generate("long", prompt_ids=[10, 11, 12], sampling_params={**PARAMS, "max_new_tokens": 12},
                                sticky_key="p", sampling_seed=1, on_tokens=full_disk)
        return await gen(pool, "p", 2, max_new=4)

    after_out, pool = pool_run([fake.url], body)
    assert len(after_out.token_ids) == 4 and pool.retries == 0
    assert fake.stats()["http_requests"] - before["http_requests"] == 2


def test_a_group_partly_aborted_aborts_only_those_members_by_their_own_rids(fakes):
    fake, before = steady(fakes)

    async def body(pool):
        await pool.learn_group_limits()
        tasks = [asyncio.ensure_future(gen(pool, "q", seed, max_new=20)) for seed in range(10, 14)]
        await asyncio.sleep(0.15)  # the group is out, its members running
        for t in tasks[:2]:
            t.cancel()  # what stopping a unit does (the actor's shutdown cancels its units)
        done = await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.sleep(0.1)  # the aborts' answers reach the (ignored) stream
        return done

    done, pool = pool_run([fake.url], body)
    after = fake.stats()
    assert isinstance(done[0], asyncio.CancelledError) and isinstance(done[1], asyncio.CancelledError)
    assert [len(o.token_ids) for o in done[2:]] == [20, 20]
    assert after["http_requests"] - before["http_requests"] == 1  # one grouped request, its connection kept
    assert after["abort_requests"] - before["abort_requests"] == 2 and after["aborted"] - before["aborted"] == 2
    assert after["finished"] - before["finished"] == 2 and after["disconnects"] == before["disconnects"]
    assert pool.aborts_sent == 2 and pool.retries == 0


def test_a_group_whose_server_dies_mid_request_retries_each_unit_once(fakes):
    procs, tmp = fakes
    dying = FakeSGLang("dying", tmp, "--step-ms", "50", "--front-ms", "0", "--crash-on-request", "1",
                       "--crash-delay-s", "0.2").wait_ready()
    steady = procs["steady"]
    before = steady.stats()

    async def body(pool):
        await pool.learn_group_limits()
        pool._sticky["d"] = next(s for s in pool.servers if s.url == dying.url)  # the group goes to the dying one
        return await asyncio.gather(*(gen(pool, "d", seed, max_new=16) for seed in range(20, 24)))

    try:
        outs, pool = pool_run([dying.url, steady.url], body)
        assert dying.proc.wait(10) == 86
    finally:
        dying.stop()
    after = steady.stats()
    assert [len(o.token_ids) for o in outs] == [16] * 4
    assert pool.retries == 4  # each unit once
    new_rids = after["rids"][len(before["rids"]):]
    assert len(new_rids) == len(set(new_rids)) == 4  # each re-sent once, with a new id, none twice
    state = {s.url: s for s in pool.servers}
    assert state[dying.url].errors == {"connection": 1}  # one failure of the server, not one per member


def test_a_run_on_grouped_sglang_writes_every_unit_once(tmp_path, fakes):
    procs, _ = fakes
    fake = FakeSGLang("run", tmp_path, "--step-ms", "5", "--front-ms", "0.5").wait_ready()
    out = tmp_path / "run"
    try:
        proc = launch_external(out, [fake.url], *[o for o in FAST if not o.startswith("llm.")], "n=4",
                               "max_samples=8", "max_response_length=8", "llm.protocol=sglang")
        stats = fake.stats()
    finally:
        fake.stop()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = read_records(out)
    keys = [(r["index"], r["sample"]) for r in records]
    assert len(keys) == len(set(keys)) == 32
    assert stats["items"] == 32 and stats["batch_requests"] >= 1 and stats["http_requests"] < 32
    data = load_trajectories(out / "trajectories.pkl")
    assert len(data) == 32


def test_a_server_that_refuses_groups_gets_each_member_alone_then_no_more_groups(tmp_path, tiny_model):
    """pipegen's CPU server refuses `stream=true` (400): a group sent to it anyway (its group limit forced
    here; it reports none) is sent again member by member, every unit answered once; after GROUP_GIVE_UP such
    refusals in a row the server gets one request per generation."""
    from verl.workers.rollout.replica import TokenOutput  # noqa: F401  (its first import outlasts a deadline here)

    from pipegen.actor.supervision import SUPERVISION

    GROUP_GIVE_UP = SUPERVISION.group_give_up

    server = FakeServer("cpu", tmp_path, tiny_model, "--token-latency", "0.001").wait_ready()

    async def body(pool):
        pool.servers[0].group_limit = 4
        outs = []
        for round_ in range(GROUP_GIVE_UP + 1):
            outs += await asyncio.gather(*(gen(pool, "c", 100 * round_ + s, max_new=4) for s in range(4)))
        return outs

    try:
        outs, pool = pool_run([server.url], body)
        stats = server.stats()
    finally:
        server.stop()
    assert len(outs) == 4 * (GROUP_GIVE_UP + 1) and all(len(o.token_ids) == 4 for o in outs)
    assert pool.servers[0].group_limit == 1 and pool.retries == 0
    assert pool.http_requests == GROUP_GIVE_UP * 5 + 4  # each refused group, its members alone, then singles
    assert stats["responses_by_status"].get("400") == GROUP_GIVE_UP and stats["generations_total"] == len(outs)

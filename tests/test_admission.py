"""Concurrency that sizes itself: the GPU-like fake engine reports its limits and load the way SGLang does,
and the actor's controller follows them (grow while the queue is empty and the batch has room, shrink
when requests queue)."""

from __future__ import annotations

import asyncio

import orjson

from fake_servers import FakeServer


def post(url: str, path: str, body: dict, timeout: float = 30) -> tuple[int, dict | None]:
    import urllib.request

    req = urllib.request.Request(f"{url}{path}", data=orjson.dumps(body), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        raw = resp.read()
        return resp.status, orjson.loads(raw) if raw else None


def test_gpu_like_engine_reports_its_limits_and_load_and_aborts_like_sglang(tiny_model, tmp_path):
    import concurrent.futures

    # 4 slots, slow steps: 12 long requests = 4 running + 8 waiting. A step of 0.5 s keeps the first four
    # running for ~5 s, so all 12 are in before any finishes even on a loaded 2-core CI box (at 0.05 s the
    # first answers came back before the last requests were sent, and the snapshot below never happened).
    server = FakeServer("gpu", tmp_path, tiny_model, "--slots", "4", "--step-time", "0.5",
                        "--step-time-per-request", "0.01", "--eos-prob", "0").wait_ready()
    try:
        info = orjson.loads(server.get("/get_server_info")[1])
        assert info["max_running_requests"] == 4
        body = {"input_ids": [10, 11, 12], "sampling_params": {"max_new_tokens": 10}, "return_logprob": True}
        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            futures = [pool.submit(post, server.url, "/generate", {**body, "rid": f"r{i}"}) for i in range(12)]
            for _ in range(250):  # up to 5 s
                load = orjson.loads(server.get("/get_load")[1])
                if load[0]["num_reqs"] == 12 and load[0]["num_waiting_reqs"] == 8:  # free slots fill at a step's end
                    break
                asyncio.run(asyncio.sleep(0.02))
            assert load == [{"dp_rank": 0, "num_reqs": 12, "num_waiting_reqs": 8, "num_tokens": 0}]
            assert post(server.url, "/abort_request", {"rid": "r11"})[0] == 200  # the last one is still waiting
            answers = {f"r{i}": f.result()[1] for i, f in enumerate(futures)}
        assert answers["r11"]["meta_info"]["finish_reason"] == {"type": "abort", "message": "Abort in waiting queue"}
        for i in range(11):
            meta = answers[f"r{i}"]["meta_info"]
            assert meta["finish_reason"] == {"type": "length", "length": 10}
            assert len(answers[f"r{i}"]["output_ids"]) == len(meta["output_token_logprobs"]) == 10
        stats = server.stats()
        assert stats["max_batch_size"] == 4 and stats["running"] == 0 and stats["waiting"] == 0
    finally:
        server.stop()


def test_controller_grows_to_fill_the_batch_and_shrinks_a_long_queue():
    from pipegen.engines.sglang import parse_load
    from pipegen.actor.concurrency import ConcurrencyControl

    control = ConcurrencyControl(["http://s"], "auto", sharing=1, memory_cap_units=10_000)
    s = control.servers[0]
    s.max_running, s.limit = 100, 110
    control.adapt(s, running=60, waiting=0, binding=True)  # e.g. tool calls: batch not full
    assert s.limit == 150
    control.adapt(s, running=100, waiting=100, binding=True)  # a batch queued behind the running one: kept
    assert s.limit == 150
    control.adapt(s, running=100, waiting=135, binding=True)  # a queue beyond one batch
    assert s.limit == 115
    control.adapt(s, running=60, waiting=0, binding=False)  # the actor is not the limit
    assert s.limit == 115
    assert control.total() == 115
    control.servers[0].max_running = 4096
    assert control._start_limit(control.servers[0]) == 8192  # SGLang's small-model limit: a batch queued too
    assert ConcurrencyControl(["http://s"], "auto", 1, memory_cap_units=50).total() <= 50  # memory bound
    assert ConcurrencyControl(["http://s"], 32, 1, 10).total() == 32  # a fixed number stays fixed
    assert parse_load([{"num_reqs": 10, "num_waiting_reqs": 3}, {"num_reqs": 5, "num_waiting_reqs": 0}]) == (12, 3)


def test_after_a_burst_of_answers_the_next_requests_go_out_before_the_records_are_built():
    """Slots: a unit frees its slot when the server answers it, and builds its record only once the units
    admitted in its place have asked the server, so a burst of answers never leaves the server idle while
    the actor writes records. The slot count stays at the limit, and a replacement that never asks holds an
    answered unit back by at most ANSWER_HOLD_S."""
    from pipegen.actor.admission import Slots
    from pipegen.actor.supervision import SUPERVISION

    ANSWER_HOLD_S = SUPERVISION.answer_hold_s

    async def scenario() -> list[str]:
        events: list[str] = []
        wake = asyncio.Event()
        slots = Slots(wake)
        running: set[asyncio.Task] = set()
        answers: dict[int, asyncio.Future] = {}
        limit, units = 4, 12

        async def unit(i: int, slot) -> None:
            try:
                slot.ask()
                events.append(f"ask {i}")
                assert slots.holding(len(running)) <= limit
                answers[i] = asyncio.get_running_loop().create_future()
                await answers[i]
                await slot.answered()
                events.append(f"record {i}")
            finally:
                slot.release()

        async def server() -> None:  # answers every request in flight at once, as a burst
            while True:
                await asyncio.sleep(0.01)
                for f in answers.values():
                    if not f.done():
                        f.set_result(None)

        async def admission() -> None:
            for i in range(units):
                while slots.holding(len(running)) >= limit or len(running) >= Slots.held_cap(limit, memory_cap=100):
                    slots.round_done()
                    wake.clear()
                    await wake.wait()
                task = asyncio.create_task(unit(i, slots.admitted()))
                running.add(task)
                task.add_done_callback(lambda t: (running.discard(t), wake.set()))
            slots.round_done(closed=True)
            while running:
                await asyncio.gather(*list(running))

        answering = asyncio.create_task(server())
        await admission()
        answering.cancel()
        return events

    events = asyncio.run(scenario())
    for first, last in ((0, 4), (4, 8)):  # each burst's records come after the next burst's requests
        for i in range(first, last):
            assert events.index(f"record {i}") > max(events.index(f"ask {j}") for j in range(last, last + 4)), events
    assert {e for e in events if e.startswith("record")} == {f"record {i}" for i in range(12)}

    async def replacement_never_asks() -> float:
        slots = Slots(asyncio.Event())
        answered_unit = slots.admitted()
        slots.admitted()  # its replacement, which never asks
        answered_unit.ask()
        slots.round_done()
        started = asyncio.get_running_loop().time()
        await answered_unit.answered()
        return asyncio.get_running_loop().time() - started

    assert asyncio.run(replacement_never_asks()) < ANSWER_HOLD_S + 0.5


def test_hedging_waits_for_the_tail_and_idle_capacity():
    """A slow request is hedged only once nothing is left to admit and a slot is idle: before the tail a
    second copy would take a slot from a unit that has not started yet. The pool learns when the tail
    starts through `Admission.tail_started` (its watched requests wake at once), nothing set on the pool."""
    from pipegen.actor.admission import Admission, WatchdogLimits
    from pipegen.actor.concurrency import ConcurrencyControl

    async def main():
        admission = Admission(WatchdogLimits(hedge=True, hedge_min_s=1.0),
                              ConcurrencyControl(["http://s"], 2, sharing=1, memory_cap_units=100))
        for _ in range(10):
            admission.answered(3.0, 10)  # recent answers took 3 s: the p90
        tail = admission.tail_started()
        assert tail is not None and not tail.done() and admission.hedge_after() is None

        units = [(0, 0), (1, 0), (2, 0)]
        before_tail: list = []
        release = asyncio.Event()

        class Source:
            async def next(self, free):
                return units.pop(0) if units else None

        async def start(pos, sample, slot):
            slot.ask()  # waiting on a server
            if units:  # units left to admit
                before_tail.append(admission.hedge_after())
            if pos == 2:  # the last unit: it stays on its server while the others end
                await release.wait()
            await slot.answered()
            slot.release()  # the unit ends (as the actor's run_unit does)

        run = asyncio.create_task(admission.run(Source(), start, session=None, engine=None))
        while not admission.draining:
            await asyncio.sleep(0.01)
        assert before_tail == [None, None]  # units were still left to admit: no hedging
        assert tail.done()  # watched requests wake when the tail starts
        assert admission.waiting_on_servers() == 1 and admission.hedge_after() == 3.0  # a slot is idle
        release.set()
        await run

    asyncio.run(main())


def test_units_waiting_on_a_remote_verifier_leave_room_for_new_units_up_to_its_capacity():
    """A 100 ms verifier must not hold the actor back: answered units waiting on it stay out of the held
    count, up to what the verifier checks at once; a score computed on this machine still counts (a slow
    local scorer must not pile units up)."""
    from pipegen.actor.admission import Slots

    async def main() -> None:
        slots = Slots(asyncio.Event())
        units = [slots.admitted() for _ in range(6)]
        for unit in units:
            unit.ask()
        assert slots.held(6) == 6
        with units[0].awaiting_verifier(0):  # scored here: still held
            assert slots.held(6) == 6
        with units[0].awaiting_verifier(2), units[1].awaiting_verifier(2), units[2].awaiting_verifier(2):
            assert slots.wake.is_set()  # the admission loop hears of the room at once
            assert slots.held(6) == 4  # three wait on the verifier, which checks two at once
        assert slots.held(6) == 6

    asyncio.run(main())

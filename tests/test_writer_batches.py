"""The writer's fast path gives verl's rows exactly, batch files round-trip, and a run gets few, full batch files.

The numpy padding of whole batches (pad_text_batch) and the simdjson line parse are shortcuts past
verl's per-trajectory `_agent_loop_postprocess` and orjson; here they meet both on records with every
shape the shortcut handles (short and empty prompts/responses, tool tokens masked out, no log-probs).
tests/test_verl_parity.py holds the whole output to verl's real AgentLoopWorker.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from pipegen.bench import common as c
from pipegen.run.stream import RolloutRecord
from pipegen.verl_private import postprocess_batch


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_model):
    from pipegen.inputs.dataset import load_tokenizer
    from pipegen.writer.batches import BatchBuilder

    cfg, run = c.prepare_run(tmp_path_factory.mktemp("run"), "n=2", "max_samples=40", "max_prompt_length=300",
                             "max_response_length=64")
    return cfg, run, BatchBuilder(cfg, load_tokenizer(cfg))


def _odd_records(cfg, count: int) -> list[RolloutRecord]:
    records = c.RecordFactory(cfg).records(count, 64, seed=3)
    for k, rec in enumerate(records):
        t = rec.trajectories[0]
        keep = 0 if k == 5 else 64 - 5 * k  # 64, 59, ..., and one empty response
        t["response_ids"], t["response_logprobs"] = t["response_ids"][:keep], list(t["response_logprobs"][:keep])
        t["response_mask"] = [0 if 3 <= i < 7 else 1 for i in range(keep)]  # a tool response inside
        t["prompt_ids"] = t["prompt_ids"][: 256 - 21 * k]
    return records


def _verl_rows(builder, records):
    async def run():
        return [await builder._verl_postprocess(traj, rec.agent_kwargs(builder.default_agent))
                for rec in records for traj in rec.trajectories]

    return asyncio.run(run())


def _assert_same(a, b):
    assert set(a.batch.keys()) == set(b.batch.keys())
    for key in a.batch.keys():
        assert a.batch[key].dtype == b.batch[key].dtype and torch.equal(a.batch[key], b.batch[key]), key
    assert list(a.non_tensor_batch) == list(b.non_tensor_batch)
    for key, values in a.non_tensor_batch.items():
        assert values.dtype == b.non_tensor_batch[key].dtype and repr(values.tolist()) == \
            repr(b.non_tensor_batch[key].tolist()), key
    assert a.meta_info == b.meta_info


@pytest.mark.parametrize("with_logprobs", [True, False])
def test_fast_rows_equal_verls_per_trajectory_postprocess(setup, with_logprobs):
    from pipegen.writer.batches import from_storage
    from pipegen.run.stream import LineParser

    cfg, _, builder = setup
    records = _odd_records(cfg, 12)
    if not with_logprobs:
        for rec in records:
            rec.trajectories[0]["response_logprobs"] = None
    parser = LineParser()
    fast_records = [parser.record(rec.to_line()) for rec in records]
    assert isinstance(fast_records[0].trajectories[0]["response_ids"], np.ndarray)
    fast = asyncio.run(builder.build(fast_records))
    plain = [RolloutRecord.from_line(rec.to_line()) for rec in records]
    row_keys = [*plain[0].agent_kwargs(builder.default_agent), "sample", "trajectory", "seed", "session_id",
                "loss_weight"]
    reference = postprocess_batch(builder.worker, _verl_rows(builder, plain),
                                  {k: fast.non_tensor_batch[k] for k in row_keys})
    _assert_same(fast, reference)
    _assert_same(from_storage(asyncio.run(builder.build(fast_records, int32=True))), reference)


def test_batch_file_round_trips_to_the_same_dataproto(setup, tmp_path):
    from pipegen.writer.batches import encode_batch, from_storage, load_batch

    cfg, _, builder = setup
    records = _odd_records(cfg, 8)
    batch = asyncio.run(builder.build(records))
    for int32 in (True, False):
        path = tmp_path / f"batch_{int32}.arrow"
        path.write_bytes(b"".join(encode_batch(batch, int32)))
        back = load_batch(path)
        token_dtype = torch.int32 if int32 else torch.int64
        assert back.batch["input_ids"].dtype == back.batch["attention_mask"].dtype == token_dtype
        _assert_same(from_storage(back), batch)
    # the writer's own path: storage-form batch, tensors known to be derivable by construction
    stored, derived = asyncio.run(builder.build_for_storage(records, int32=True))
    (tmp_path / "stored.arrow").write_bytes(b"".join(encode_batch(stored, True, derived)))
    _assert_same(from_storage(load_batch(tmp_path / "stored.arrow")), batch)
    # tensors off verl's layout are kept exactly: rm_scores with a value off the last token and a
    # -0.0, an attention mask with a hole in a response
    odd = batch.batch["rm_scores"]
    odd[0, 0], odd[1, 1] = 0.5, -0.0
    batch.batch["attention_mask"][2, batch.batch["prompts"].shape[1] + 1] = 0
    (tmp_path / "odd.arrow").write_bytes(b"".join(encode_batch(batch, True)))
    back = from_storage(load_batch(tmp_path / "odd.arrow"))
    assert torch.equal(back.batch["rm_scores"].view(torch.int32), odd.view(torch.int32))
    _assert_same(back, batch)


def test_lines_the_fast_parser_cannot_read_go_through_the_record_contract():
    from pipegen.run.stream import LineParser

    parser = LineParser()
    odd = b'{"index":1,"sample":0,"uid":"u","priority":0,"seed":null,"agent_name":"a","launch":"l","row":{},' \
          b'"trajectories":[{"prompt_ids":[1,2.5],"response_ids":[],"response_mask":[],"metrics":{}}],"zzz":1}\n'
    rec = parser.record(odd)  # a float among token ids: orjson's lists, and the unknown key is ignored
    assert rec.trajectories[0]["prompt_ids"] == [1, 2.5]
    with pytest.raises(ValueError):
        parser.record(b'{"index":1,"sample"\n')
    assert parser.record(odd).index == 1  # the parser is usable after an error


def test_a_run_with_pauses_writes_full_batches_and_one_partial_last(setup):
    """Default save_batch_size (64) and quiet period: 80 rows that arrive with a 3 s pause (longer
    than the old 2 s flush) become exactly two batch files, 64 rows and the last 16."""
    from pipegen.run.checkpoint import load_checkpoint
    from pipegen.writer.commit import Writer
    from pipegen.writer.modes import LauncherWriter

    cfg, run, builder = setup
    assert int(cfg.generation.save_batch_size) == 64 and float(cfg.generation.partial_batch_quiet_s) >= 60
    records = c.RecordFactory(cfg).records(80, 64, seed=5)

    from pipegen.run.ownership import DirectoryLock

    # a live launcher (its lock, held by this process) stands in for the actors still writing: a writer run alone,
    # with nothing alive that could write, would commit what it found at once (writer/alone.py)
    launcher_lock = DirectoryLock(run.root / ".launcher.lock", "launcher", name_host=True)
    launcher_lock.acquire()

    async def scenario():
        c.write_records(run.rollouts, records[:50])
        writer = Writer(cfg, run, LauncherWriter())
        task = asyncio.create_task(writer.main())
        await asyncio.sleep(3)
        assert not run.batch_files_on_disk() and not task.done()
        c.write_records(run.rollouts, records[50:])
        try:
            return await asyncio.wait_for(task, 120)
        finally:
            writer.committer.close()

    try:
        assert asyncio.run(scenario()) == 0
    finally:
        launcher_lock.release()
    ckpt = load_checkpoint(run.checkpoint)
    assert ckpt.complete and ckpt.num_committed == 80 and ckpt.batches.sizes == [[64, 64, 1], [16, 16, 1]]
    assert len(run.batch_files_on_disk()) == 2 and run.trajectories.exists()

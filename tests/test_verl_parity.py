"""pipegen's trajectories.pkl equals what verl's own AgentLoopWorker produces for the same server outputs.

The reference is verl's real `AgentLoopWorker(cfg, llm_client=...).generate_sequences(batch)` (built
without Ray), fed the batch verl's trainer would build: the dataset collated by verl's collate_fn,
`uid` per prompt, `repeat(n, interleave=True)`, `priority = arange`. Both sides talk to the same
deterministic fake SGLang-protocol server, so every tensor must match exactly, padding included.
"""

from __future__ import annotations

import asyncio
import subprocess

import numpy as np
import torch

from conftest import FAKE_ENGINE, FAST, launch, load_trajectories
from pipegen.run.layout import RunDir
from pipegen.run.config import load_run_config
from pipegen.launch.servers import cpu_server_command, wait_ready
from pipegen.launch.world import ServerPlan, free_port


def _verl_reference(cfg, url: str, uids_by_index: dict, worker_cls=None):
    """`worker_cls`: an AgentLoopWorker subclass to run instead of verl's own (test_agent_loops.py's ForkWorker)."""
    import aiohttp
    from transformers import AutoConfig
    from verl import DataProto
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
    from verl.utils.dataset.rl_dataset import collate_fn

    from pipegen.actor.attempts import ClientLimits, ServerPool
    from pipegen.inputs.dataset import load_dataset, load_processor, load_tokenizer
    from pipegen.run.pictures import load_pictures

    processor = load_processor(cfg)  # a vision model's processor too
    dataset = load_dataset(cfg, load_tokenizer(cfg), processor)
    rows = [dataset[i] for i in range(len(dataset))]
    for row in rows:  # pictures decoded once: PIL's lazy decode races when a prompt's samples share one
        load_pictures(row["raw_prompt"])
    batch = DataProto.from_single_dict(collate_fn(rows))
    batch.non_tensor_batch["uid"] = np.array([uids_by_index[int(i)] for i in batch.non_tensor_batch["index"]],
                                             dtype=object)
    batch = batch.repeat(int(cfg.actor_rollout_ref.rollout.n), interleave=True)
    batch.non_tensor_batch["priority"] = np.arange(len(batch), dtype=np.int64)
    rollout = cfg.actor_rollout_ref.rollout
    hf = AutoConfig.from_pretrained(cfg.actor_rollout_ref.model.path)
    hf = getattr(hf, "text_config", None) or hf  # a vision-language model's limits are its language model's

    async def run():
        async with aiohttp.ClientSession() as session:
            limits = ClientLimits(int(rollout.prompt_length), int(rollout.response_length), hf.max_position_embeddings)
            worker = (worker_cls or AgentLoopWorker)(cfg, llm_client=ServerPool([url], limits, session))
            if worker.processor is None:  # verl's hf_processor builds none without torchvision: the run's PIL one
                worker.processor = processor
            return await worker.generate_sequences(batch)

    return asyncio.run(run())


def test_trajectories_equal_verl_agent_loop_output(tmp_path, tiny_model):
    out = tmp_path / "run"
    overrides = [f"model_path={tiny_model}", *FAST, FAKE_ENGINE, "actors.per_unit_seed=false",
                 "actors.scoring=false"]
    result = launch(out, *overrides)
    assert result.returncode == 0, result.stderr[-3000:]
    ours = load_trajectories(out / "trajectories.pkl")

    theirs = verl_reference_for(out, ours)

    assert len(ours) == len(theirs) == 12
    assert set(ours.batch.keys()) == set(theirs.batch.keys())
    for key in theirs.batch.keys():
        a, b = ours.batch[key], theirs.batch[key]
        assert a.dtype == b.dtype and a.shape == b.shape, key
        assert torch.equal(a, b), key
    pipegen_only = {"sample", "trajectory", "seed", "session_id", "loss_weight"}
    assert set(ours.non_tensor_batch) - set(theirs.non_tensor_batch) == pipegen_only
    assert set(theirs.non_tensor_batch) <= set(ours.non_tensor_batch)
    for key, theirs_values in theirs.non_tensor_batch.items():
        mine = ours.non_tensor_batch[key]
        assert mine.dtype == theirs_values.dtype, key
        assert [_plain(x) for x in mine] == [_plain(x) for x in theirs_values], key
    # the padding verl uses is the tokenizer's pad id (2000 for the tiny model), not 0
    P = ours.batch["prompts"].shape[1]
    assert (ours.batch["responses"][ours.batch["attention_mask"][:, P:] == 0] == 2000).all()


def verl_reference_for(out, ours):
    """verl's AgentLoopWorker's output for run `out`'s config and prompts (uids as in `ours`), against a fresh
    CPU server of the run's own settings."""
    cfg = load_run_config(RunDir(out))
    plan = ServerPlan("parity", "127.0.0.1", free_port())
    argv, env = cpu_server_command(plan, cfg.actor_rollout_ref.model.path, dict(cfg.llm), int(cfg.seed))
    server = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(plan.url, 60, lambda: server.poll() is None)
        uids = {int(i): u for i, u in zip(ours.non_tensor_batch["index"], ours.non_tensor_batch["uid"])}
        theirs = _verl_reference(cfg, plan.url, uids)
    finally:
        server.kill()
        server.wait()

    return theirs


def _plain(x):
    if isinstance(x, np.ndarray):
        return [_plain(v) for v in x.tolist()]
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    return x

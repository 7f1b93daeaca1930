"""The output as users load it: a sharded-output run, and its Parquet / JSON-lines exports, hold exactly the rows
of the single merged trajectories.pkl, in order, once each."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import orjson
import torch

from conftest import FAKE_ENGINE, FAST, FAST_REPORTED, launch
from test_verl_parity import _plain


def _single_merge(run_dir):
    """The same batches merged the default way (generation.merge_output=single), as the writer does it."""
    from verl import DataProto

    from pipegen.run.checkpoint import load_checkpoint
    from pipegen.run.config import load_run_config
    from pipegen.run.layout import RunDir
    from pipegen.writer.merge import merge_run

    run = RunDir(run_dir)
    cfg = load_run_config(run)
    cfg.generation.merge_output = "single"
    cfg.generation.export_format = None
    merge_run(cfg, run, load_checkpoint(run.checkpoint))
    return DataProto.load_from_disk(str(run.trajectories))


@pytest.mark.slow  # one whole-pipeline launch + the three Parquet loaders: 60 s on the shared 2-core box
def test_sharded_run_and_exports_hold_the_merged_rows(tmp_path, tiny_model):
    from verl import DataProto

    from pipegen.run.layout import RunDir
    from pipegen.writer.merge import load_shards

    out = tmp_path / "run"
    result = launch(out, f"model_path={tiny_model}", *FAST_REPORTED, FAKE_ENGINE, "generation.merge_output=sharded",
                    "generation.merge_shard_rows=5", "generation.export_format=parquet")
    assert result.returncode == 0, result.stderr[-3000:]
    run = RunDir(out)
    assert not run.trajectories.exists() and str(run.output_index) in result.stdout
    index = orjson.loads(run.output_index.read_bytes())
    parts = list(load_shards(run))  # each part through verl's DataProto.load_from_disk
    assert [len(p) for p in parts] == [s["rows"] for s in index["shards"]] == [5, 5, 2] and index["rows"] == 12

    ref = _single_merge(shutil.copytree(out, tmp_path / "single"))
    keys = [tuple(int(p.non_tensor_batch[k][i]) for k in ("index", "sample", "trajectory"))
            for p in parts for i in range(len(p))]
    assert keys == sorted(set(keys)) and len(keys) == 12  # ordered, no duplicates
    assert {(i, s) for i, s, _ in keys} == {(i, s) for i in range(6) for s in range(2)}  # nothing lost
    for shard, part in zip(index["shards"], parts):
        assert shard["first"] == list(keys[shard["first_row"]]) and part.meta_info["temperature"] == 1.0
    sharded = DataProto.concat(parts)
    assert set(sharded.batch.keys()) == set(ref.batch.keys())
    for key in ref.batch.keys():
        assert sharded.batch[key].dtype == ref.batch[key].dtype and torch.equal(sharded.batch[key], ref.batch[key])
    assert set(sharded.non_tensor_batch) == set(ref.non_tensor_batch)
    for key, values in ref.non_tensor_batch.items():
        assert [_plain(x) for x in sharded.non_tensor_batch[key]] == [_plain(x) for x in values], key

    # The export written at the end of the run loads with pandas, pyarrow and Hugging Face datasets.
    import datasets
    import pandas as pd
    import pyarrow.parquet as pq

    path = run.export_file("parquet")
    frame = pd.read_parquet(path)
    table = pq.read_table(path)
    hf = datasets.load_dataset("parquet", data_files=str(path), split="train", cache_dir=str(tmp_path / "hf"))
    assert len(frame) == table.num_rows == len(hf) == 12
    rows = table.to_pylist()
    assert [dict(r) for r in hf] == rows and frame["uid"].tolist() == [r["uid"] for r in rows]
    assert _assert_rows_equal(rows, ref)  # some responses end in <|im_end|>: their response_text leaves it out

    # Beside it, its Hugging Face dataset card: load_dataset reads the folder through the card's configs, and the
    # card states the run's facts (the report's numbers)
    card = (out / "README.md").read_text()
    assert card.startswith("---\n") and "configs:" in card and "path: trajectories.parquet" in card
    folder = datasets.load_dataset(str(out), split="train", cache_dir=str(tmp_path / "hf-card"))
    assert [dict(r) for r in folder] == rows
    numbers = orjson.loads((out / "report.json").read_bytes())
    (source, stats), = numbers["sources"].items()
    from importlib.metadata import version

    from pipegen.distribution import DISTRIBUTION

    assert str(tmp_path) not in card and str(Path.home()) not in card  # the card travels: no local path
    for fact in (f"pipegen version: {version(DISTRIBUTION)}", f"model: `{Path(tiny_model).name}` (a local folder)",
                 "revision: not known", "license: not known",
                 "temperature 1.0", "n 2 samples per prompt", "responses up to 24 tokens",
                 f"config fingerprint (run key): `{run.run_key()}`", "12 rows, 12 of 12 units committed, 0 failed",
                 f"| {source} | 12 | 6 | {stats['mean_reward']} | "
                 f"[{stats['reward_ci95'][0]}, {stats['reward_ci95'][1]}] |",
                 f"{stats['at_length_limit']} ({stats['at_length_limit_share']})",
                 "hf upload USER/NAME . . --repo-type dataset"):
        assert fact in card, fact

    # The CLI (in-process: verl is already imported), in another format and smaller writes, gives the same rows.
    from pipegen.export.__main__ import main as export_main

    assert export_main([str(out), "--format", "jsonl", "--row-group-rows", "5"]) == 0
    lines = [orjson.loads(line) for line in run.export_file("jsonl").read_bytes().splitlines()]
    _assert_rows_equal(lines, ref)
    assert [line["reward_model"] for line in lines] == [r["reward_model"] for r in rows]


def test_the_dataset_card_names_no_local_path_and_a_license(tmp_path):
    """The card travels with the data: the model by its Hub id or folder name, the prompts by file name, the upload
    run from the card's folder; the license is export.license, else the model card's."""
    from omegaconf import OmegaConf

    from pipegen.export.card import card_text
    from pipegen.run.layout import RunDir

    model = tmp_path / "hub" / "models--Org--Model-1B" / "snapshots" / "abc123"
    model.mkdir(parents=True)
    (model / "README.md").write_text("---\nlicense: mit\nlanguage: en\n---\n# Model-1B\n")
    prompts = tmp_path / "data" / "my_prompts.parquet"
    cfg = OmegaConf.create({"actor_rollout_ref": {"rollout": {}, "model": {"path": str(model)}},
                            "data": {"train_files": [str(prompts)]}, "export": {"license": None}})
    sampling = dict.fromkeys(("temperature", "top_p", "top_k", "n", "response_length", "prompt_length", "seed"), 1)
    numbers = {"progress": {"rows_read": 1, "committed": 1, "units": 1, "failed": 0}, "n": 1, "sources": {},
               "engine": {"sampling": sampling, "llm": "cpu", "agent_loop": None}, "response_limit": 8,
               "statistics": {"interval": "-", "resampling_unit": "-", "draws": 0, "seed": 0, "pass_at_k": "-"}}
    run = RunDir(tmp_path / "run")
    card = card_text(cfg, run, run.root / "trajectories.parquet", numbers)
    assert str(tmp_path) not in card
    assert "license: mit\n" in card.partition("\n---\n")[0] and "- license: `mit`" in card
    assert "- model: `Org/Model-1B`; revision: `abc123`" in card and "- prompts from: `my_prompts.parquet`" in card
    assert "upload USER/NAME . . --repo-type dataset --include README.md --include trajectories.parquet" in card
    # how pipegen is installed today (no package index serves it): no link to an index page that does not exist
    assert "pypi.org" not in card and "installed from a checkout of pipegen with `pip install .`" in card, card
    cfg.export.license = "cc-by-4.0"
    assert "license: cc-by-4.0\n" in card_text(cfg, run, run.root / "trajectories.parquet", numbers)


def _assert_rows_equal(rows: list[dict], ref) -> int:
    """Export rows against the merged DataProto: order, tokens, mask, log-probs, reward, prompt, dataset fields.
    Returns how many responses end in a special token (<|im_end|>, <|endoftext|>)."""
    b, nt = ref.batch, ref.non_tensor_batch
    width = b["prompts"].shape[1]
    assert len(rows) == len(ref)
    ended_special = 0
    for i, row in enumerate(rows):
        for key in ("index", "sample", "trajectory", "uid", "data_source"):
            assert row[key] == _plain(nt[key][i]), key
        attn = b["attention_mask"][i].bool()
        assert row["prompt_ids"] == b["prompts"][i][attn[:width]].tolist()
        response = b["responses"][i][attn[width:]]
        assert row["response_ids"] == response.tolist()
        assert row["response_mask"] == b["response_mask"][i][attn[width:]].tolist()
        assert np.array_equal(np.array(row["rollout_log_probs"], dtype=np.float32),
                              b["rollout_log_probs"][i][attn[width:]].numpy())
        assert row["reward"] == float(b["rm_scores"][i].sum())
        assert row["raw_prompt"] == _plain(nt["raw_prompt"][i])
        assert row["finish_reason"] == ("stop" if int(response[-1]) in (2000, 2002) else "length")
        # text, unless the answer is special tokens alone (an <|im_end|> at once)
        assert isinstance(row["response_text"], str) and (
            row["response_text"] or all(int(t) in (2000, 2001, 2002) for t in response))
        # the text a reader uses carries none of the tokenizer's special tokens; the ids keep them
        assert not any(t in row["response_text"] for t in ("<|im_end|>", "<|endoftext|>", "<|im_start|>")), row
        ended_special += int(response[-1]) in (2000, 2002)
        # SFT's messages: the prompt's, then the single-turn answer; verl's internal columns are left out
        prompt = [{"role": m["role"], "content": m["content"]} for m in nt["raw_prompt"][i]]
        assert row["messages"][:-1] == prompt and row["messages"][-1]["role"] == "assistant"
        assert not {"global_steps", "min_global_steps", "extras", "tool_rewards", "turn_scores"} & set(row)
    return ended_special


def test_merge_sorts_batches_committed_out_of_order(tmp_path):
    """Batches whose rows interleave (several actors, retries): single file, parts and export agree, sorted."""
    import asyncio

    import pyarrow.parquet as pq
    from verl import DataProto

    from pipegen.inputs.dataset import load_tokenizer
    from pipegen.bench import common as c
    from pipegen.export.writers import export_plan
    from pipegen.run.atomic import atomic_write_bytes
    from pipegen.run.checkpoint import Checkpoint
    from pipegen.writer.batches import BatchBuilder, encode_batch
    from pipegen.writer.merge import MergePlan, output_meta, save_dataproto, write_shards

    cfg, run = c.prepare_run(tmp_path / "run", "n=2", "max_samples=8", "max_response_length=16")
    records = c.RecordFactory(cfg).records(16, 16)
    builder = BatchBuilder(cfg, load_tokenizer(cfg))
    ckpt = Checkpoint()
    for number, chunk in enumerate([records[1::3], records[0::3], records[2::3]]):  # interleaved, out of order
        batch = asyncio.run(builder.build(chunk))
        atomic_write_bytes(run.batch_file(number), b"".join(bytes(c) for c in encode_batch(batch, True)))
        ckpt.batches.add(len(batch), len(batch))
    plan = MergePlan.scan([run.batch_file(i) for i in ckpt.batches.numbers()], output_meta(cfg))
    with open(run.trajectories, "wb") as f:
        save_dataproto(plan.rows(0, plan.num_rows), f)
    single = DataProto.load_from_disk(str(run.trajectories))
    keys = list(zip(single.non_tensor_batch["index"], single.non_tensor_batch["sample"]))
    assert keys == sorted(keys) and len(set(keys)) == 16 and single.meta_info["temperature"] == 1.0
    assert single.batch["input_ids"].dtype == torch.int64
    write_shards(plan, run, 5)
    from pipegen.writer.merge import load_shards

    parts = DataProto.concat(list(load_shards(run)))
    for key in single.batch.keys():
        assert torch.equal(parts.batch[key], single.batch[key]), key
    export_plan(cfg, plan, run.export_file("parquet"), "parquet", row_group_rows=3)
    _assert_rows_equal(pq.read_table(run.export_file("parquet")).to_pylist(), single)
    assert pq.ParquetFile(run.export_file("parquet")).metadata.num_row_groups == 6

"""Vision-language models: a multimodal parquet in verl's layout (an `images` column, `<image>` in the prompt) runs
end to end with a tiny random-weight Qwen2-VL and its processor, and what comes out is verl's.

- parity: trajectories.pkl equals what verl's own AgentLoopWorker (with the processor) produces for the same
  server outputs, multi_modal_inputs and the (B, 4, L) M-RoPE position ids included;
- the CPU server's log-probs agree with a transformers forward given the pictures;
- a killed writer and a killed actor, then the same command again: the clean run's output;
- the refusals at launch: images with a text-only model, images with vLLM.

The processor is verl's own (`hf_processor`); verl's picture reader, qwen_vl_utils, imports torchvision, which
launch.sh installs with its matching torch, so every test here runs on a CPU-only machine. Where the reader cannot
be imported the launch refuses the image column in one line (tested below).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import orjson
import pytest
import torch

from conftest import FAKE_ENGINE, REPO, assert_same_trajectories, launch, load_trajectories, wait_for_lines
from fake_servers import pids_where
from test_verl_parity import verl_reference_for

ROWS, N = 4, 2
RUN = [f"n={N}", "max_response_length=16", "actors.concurrency=8", "actors.stats_interval_s=0.5",
       "generation.save_batch_size=3", "generation.partial_batch_quiet_s=0.3",
       "actors.scoring=false"]


@pytest.fixture(scope="session")
def vision_parquet(tmp_path_factory) -> str:
    from support.tiny_vlm import write_image_parquet

    return write_image_parquet(tmp_path_factory.mktemp("vision") / "images.parquet", rows=ROWS)


@pytest.fixture(scope="session")
def tiny_vlm() -> str:
    from support.tiny_vlm import tiny_vlm_path

    return tiny_vlm_path()


@pytest.fixture(scope="session")
def fake_vision_run(tmp_path_factory, tiny_vlm, vision_parquet) -> tuple[Path, list[str]]:
    """One clean run on the deterministic fake engine: the reference of the parity and crash tests."""
    out = tmp_path_factory.mktemp("vision-run") / "clean"
    overrides = [f"model_path={tiny_vlm}", f"train_files={vision_parquet}", *RUN, FAKE_ENGINE,
                 "actors.per_unit_seed=false"]
    result = launch(out, *overrides)
    assert result.returncode == 0, result.stderr[-3000:]
    return out, overrides


def test_multimodal_rows_equal_verl_agent_loop_output(fake_vision_run):
    out, _ = fake_vision_run
    ours = load_trajectories(out / "trajectories.pkl")
    theirs = verl_reference_for(out, ours)  # verl's AgentLoopWorker, which loads the processor itself

    assert len(ours) == len(theirs) == ROWS * N  # every unit exactly once (launch() also ran status --verify)
    assert ours.batch["position_ids"].shape[1] == 4  # verl's text row + Qwen2-VL's three M-RoPE rows
    for key in theirs.batch.keys():
        assert ours.batch[key].dtype == theirs.batch[key].dtype and torch.equal(ours.batch[key], theirs.batch[key]), key
    mine = ours.non_tensor_batch["multi_modal_inputs"]
    _assert_same_multi_modal_inputs(mine, theirs.non_tensor_batch["multi_modal_inputs"])
    # the second row holds two pictures: both reach the processor's inputs
    two = [m for m, i in zip(mine, ours.non_tensor_batch["index"]) if int(i) == 1]
    assert all(m["image_grid_thw"].shape[0] == 2 for m in two)


def test_cpu_server_log_probs_agree_with_transformers_given_the_pictures(tmp_path, tiny_vlm, vision_parquet):
    from transformers import AutoModelForImageTextToText
    from verl.utils.torch_functional import logprobs_from_logits

    out = tmp_path / "run"
    # float32 as the text path's check (test_trainer_inputs.py): `auto` is bfloat16 on a CPU with native bf16
    result = launch(out, f"model_path={tiny_vlm}", f"train_files={vision_parquet}", *RUN, "llm.dtype=float32")
    assert result.returncode == 0, result.stderr[-3000:]
    data = load_trajectories(out / "trajectories.pkl")
    assert len(data) == ROWS * N
    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm, dtype=torch.float32).eval()
    b = data.batch
    width = b["prompts"].shape[1]
    gaps, blind = [], []
    with torch.inference_mode():
        for row in range(len(data)):
            mm = data.non_tensor_batch["multi_modal_inputs"][row]
            kwargs = dict(input_ids=b["input_ids"][row:row + 1], attention_mask=b["attention_mask"][row:row + 1],
                          position_ids=b["position_ids"][row:row + 1].transpose(0, 1))  # (4, 1, L), verl's layout
            logits = model(**kwargs, pixel_values=mm["pixel_values"], image_grid_thw=mm["image_grid_thw"]).logits
            without = model(**kwargs).logits  # the same ids with the pictures left out
            mask = b["response_mask"][row].bool()
            lp = logprobs_from_logits(logits[0, width - 1:-1], b["responses"][row])
            gaps.append((lp - b["rollout_log_probs"][row]).abs()[mask].max())
            blind.append((logprobs_from_logits(without[0, width - 1:-1], b["responses"][row])
                           - b["rollout_log_probs"][row]).abs()[mask].max())
    assert max(gaps) < 1e-3, f"max |transformers - rollout| = {max(gaps):.2e}"
    assert max(blind) > 1e-2  # the check tells a server that ignored the pictures apart


def test_parquet_export_carries_multi_modal_inputs(fake_vision_run, tmp_path):
    import pyarrow.parquet as pq

    from pipegen.export.__main__ import main as export_main

    out, _ = fake_vision_run
    target = tmp_path / "vision.parquet"
    assert export_main([str(out), "--output", str(target)]) == 0
    rows = pq.read_table(target).to_pylist()
    ours = load_trajectories(out / "trajectories.pkl")
    assert len(rows) == len(ours) == ROWS * N
    for row, mm in zip(rows, ours.non_tensor_batch["multi_modal_inputs"]):
        exported = row["multi_modal_inputs"]  # nested lists: a plain Parquet column, no pickle
        assert set(exported) == set(mm)
        for name, value in mm.items():
            assert np.array_equal(np.asarray(exported[name], dtype=value.numpy().dtype), value.numpy()), name


def test_a_sampled_picture_placeholder_fails_its_unit_by_name_and_the_run_goes_on(tmp_path, tiny_vlm, vision_parquet):
    """A model that samples its own <|video_pad|> (or <|image_pad|>): verl cannot compute M-RoPE positions for
    the row, so the unit is a named failure and the writer, which never sees it, commits the rest."""
    script = tmp_path / "script.json"
    script.write_text('["<|video_pad|>"]')  # every reply: that one token, then EOS
    out = tmp_path / "run"
    result = launch(out, f"model_path={tiny_vlm}", f"train_files={vision_parquet}", *RUN, FAKE_ENGINE,
                    f"llm.engine_args=[--script,{script}]")  # generation.max_attempts (HTTP retries) never applies
    assert result.returncode == 1, result.stderr[-3000:]
    assert "writer crashed" not in result.stderr and "rerun the same command" in result.stderr
    ckpt = orjson.loads((out / "checkpoint.json").read_bytes())
    assert len(ckpt["failed"]) == ROWS * N and ckpt["num_committed"] == 0
    for info in ckpt["failed"].values():
        assert "sampled its video placeholder token (id" in info["reason"], info["reason"]
    assert "Traceback" not in (out / "logs" / "writer.log").read_text()


def test_placeholders_are_refused_only_where_the_model_sampled_them(tiny_vlm):
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput

    from pipegen.actor.rollout import InvalidTrajectory, check_trajectories, vision_placeholders
    from pipegen.inputs.media import load_model_processor

    processor, _ = load_model_processor(tiny_vlm)
    placeholders = vision_placeholders(processor)
    image = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert set(placeholders) == {image, processor.tokenizer.convert_tokens_to_ids("<|video_pad|>")}
    assert vision_placeholders(None) == {}

    def out(mask: list[int]) -> AgentLoopOutput:
        return AgentLoopOutput(prompt_ids=[1, 2], response_ids=[5, image, 6], response_mask=mask,
                               metrics=AgentLoopMetrics())

    assert check_trajectories(out([1, 0, 1]), 8, 8, placeholders)  # a tool's reply holding a picture's span
    assert check_trajectories(out([1, 1, 1]), 8, 8)  # a text model: nothing to refuse
    with pytest.raises(InvalidTrajectory, match=rf"sampled its image placeholder token \(id {image}\) at response "
                                                r"position 1"):
        check_trajectories(out([1, 1, 1]), 8, 8, placeholders)


def _pid(out: Path, module: str) -> int | None:
    want = [module.encode(), f"output_dir={out}".encode()]
    pids = pids_where("cmdline", lambda argv: all(w in argv for w in want))
    return pids[0] if pids else None


def test_killed_writer_and_actor_then_the_same_command_give_the_clean_output(tmp_path, fake_vision_run):
    clean, overrides = fake_vision_run
    out = tmp_path / "killed"
    cmd = [*overrides, "llm.engine_args=[--token-latency,0.3]"]
    # two units at a time: with all eight in flight they finish together, and the actor is gone before the kill
    launcher = subprocess.Popen([sys.executable, "-m", "pipegen.launch", f"output_dir={out}", *cmd,
                                 "actors.concurrency=2"], cwd=REPO,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_lines(launcher, out / "streams" / "rollouts" / "actor_0" / "000000.jsonl", 2, 180)
        for module in ("pipegen.writer", "pipegen.actor"):
            pid = _pid(out, module)
            assert pid is not None, module
            os.kill(pid, signal.SIGKILL)
        os.kill(launcher.pid, signal.SIGKILL)  # the whole launch gone: only the same command brings it back
        launcher.wait()
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        for module in ("pipegen.cpu_server", "pipegen.actor", "pipegen.writer"):  # orphans of this run only
            pid = _pid(out, module)
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
    result = launch(out, *cmd)
    assert result.returncode == 0, result.stderr[-3000:]
    killed, reference = load_trajectories(out / "trajectories.pkl"), load_trajectories(clean / "trajectories.pkl")
    _assert_same_multi_modal_inputs(killed.non_tensor_batch.pop("multi_modal_inputs"),
                                    reference.non_tensor_batch.pop("multi_modal_inputs"))
    assert_same_trajectories(killed, reference)


def _assert_same_multi_modal_inputs(mine, ref) -> None:
    assert len(mine) == len(ref)
    for a, b in zip(mine, ref):
        assert set(a) == set(b) >= {"pixel_values", "image_grid_thw"}
        for name in b:
            assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


def test_images_with_a_text_only_model_are_refused_at_launch(tmp_path, tiny_model, vision_parquet):
    result = launch(tmp_path / "run", f"model_path={tiny_model}", f"train_files={vision_parquet}", *RUN, FAKE_ENGINE)
    assert result.returncode == 2
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("pipegen: error: train_files: column 'images' (data.image_key) holds images"), line
    assert "no processor" in line and "vision-language model" in line
    assert not list((tmp_path / "run").glob("batch_*"))


def test_images_with_vllm_are_refused_at_launch(tmp_path, vision_parquet):
    from omegaconf import OmegaConf

    from pipegen.inputs.media import MediaError, check_media

    cfg = OmegaConf.create({"data": {"image_key": "images"}, "llm": {"protocol": "vllm"},
                            "actor_rollout_ref": {"model": {"path": "unused", "trust_remote_code": False}}})
    with pytest.raises(MediaError) as refused:
        check_media(cfg, [vision_parquet], processor_loaded=(object(), ""))  # a processor: only the engine is wrong
    line = str(refused.value)
    assert "\n" not in line
    assert line.startswith("train_files: column 'images' (data.image_key) holds images, but llm.protocol=vllm")
    assert "SGLang" in line


def test_vllm_engine_never_drops_images():
    from pipegen.actor.limits import ClientLimits
    from pipegen.engines.request import Generation
    from pipegen.engines.vllm import NO_IMAGES, VLLM

    with pytest.raises(ValueError, match="cannot be sent") as refused:
        VLLM().build(Generation.of([1, 2, 3], {"max_tokens": 4}, ClientLimits(16, 8, 64),
                                   pictures=["data:image/png;base64,"]))
    assert str(refused.value) == NO_IMAGES


def test_video_columns_are_refused(tmp_path):
    import pandas as pd
    from omegaconf import OmegaConf

    from pipegen.inputs.media import MediaError, check_media

    path = tmp_path / "video.parquet"
    pd.DataFrame([{"prompt": [{"role": "user", "content": "<video>?"}], "videos": ["a.mp4"]}]).to_parquet(path)
    cfg = OmegaConf.create({"data": {}, "llm": {"protocol": "sglang"},
                            "actor_rollout_ref": {"model": {"path": "unused", "trust_remote_code": False}}})
    with pytest.raises(MediaError, match=r"^train_files: column 'videos' \(data.video_key\) holds video data"):
        check_media(cfg, [str(path)], processor_loaded=(object(), ""))


def test_batch_file_carries_multi_modal_inputs_without_pickle(tmp_path):
    from pipegen.run.batchfile import encode_batch_file, object_array, read_batch

    rows = 3
    tensors = {"prompts": np.arange(rows * 4, dtype=np.int64).reshape(rows, 4),
               "position_ids": np.arange(rows * 4 * 6, dtype=np.int64).reshape(rows, 4, 6)}
    mm = [{"pixel_values": np.random.default_rng(i).random((4 * (i + 1), 1176), dtype=np.float32),
           "image_grid_thw": np.array([[1, 2, 2 * (i + 1)]], dtype=np.int64)} for i in range(rows)]
    non_tensor = {"index": object_array([0, 1, 2]), "multi_modal_inputs": object_array(mm)}
    path = tmp_path / "batch_00000.arrow"
    path.write_bytes(b"".join(bytes(c) for c in encode_batch_file(tensors, non_tensor, {}, int32=True)))
    assert b"\x80\x04" not in path.read_bytes()[:2]
    back = read_batch(path)
    assert np.array_equal(back.tensors["position_ids"], tensors["position_ids"])
    for a, b in zip(back.non_tensor["multi_modal_inputs"], mm):
        assert set(a) == set(b)
        for k in b:
            assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), k


def test_line_images_round_trip_to_the_same_pixels():
    from PIL import Image

    from pipegen.run.pictures import decode_multi_modal_data, encode_multi_modal_data, strip_media

    pixels = np.random.default_rng(0).integers(0, 256, (28, 42, 3), dtype=np.uint8)
    image = Image.fromarray(pixels, "RGB")
    back = decode_multi_modal_data(encode_multi_modal_data({"images": [image]}))["images"][0]
    assert np.array_equal(np.asarray(back), pixels)
    with pytest.raises(ValueError, match="images only"):
        encode_multi_modal_data({"videos": [object()]})
    messages = [{"role": "user", "content": [{"type": "image", "image": image, "bytes": b"x"},
                                             {"type": "text", "text": "what?"}]}]
    assert strip_media(messages) == [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what?"}]}]


def test_the_processor_is_verls_own(tiny_vlm):
    from pipegen.inputs.media import load_model_processor

    processor, why = load_model_processor(tiny_vlm)
    assert why == "" and type(processor).__name__ == "Qwen2VLProcessor"  # the name verl matches on
    assert processor.get_rope_index.__func__.__qualname__.startswith("Qwen2VLModel.")  # bound by verl's hf_processor


def test_images_without_the_picture_reader_are_refused_at_launch(vision_parquet, monkeypatch):
    import sys

    from omegaconf import OmegaConf

    from pipegen.inputs.media import MediaError, check_media

    monkeypatch.setitem(sys.modules, "qwen_vl_utils", None)  # what a missing or broken torchvision leaves
    cfg = OmegaConf.create({"data": {"image_key": "images"}, "llm": {"protocol": "sglang"},
                            "actor_rollout_ref": {"model": {"path": "unused", "trust_remote_code": False}}})
    with pytest.raises(MediaError) as refused:
        check_media(cfg, [vision_parquet], processor_loaded=(object(), ""))
    line = str(refused.value)
    assert "\n" not in line and line.startswith("train_files: column 'images' (data.image_key) holds images")
    assert "qwen_vl_utils" in line and "install the torchvision that matches your torch" in line

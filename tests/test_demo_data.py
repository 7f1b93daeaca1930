"""The packaged demo data set and train-file resolution: what a user running `train_files=demo` relies on."""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd
import pytest

from pipegen.inputs.demo import DEMO_PARQUET, resolve_train_files
from pipegen.inputs.make_demo import FEW_SHOT, INSTRUCTION, make_rows, write_parquet


@pytest.fixture(scope="module")
def demo() -> pd.DataFrame:
    return pd.read_parquet(DEMO_PARQUET)


def test_demo_has_enough_uniquely_indexed_gsm8k_rows(demo: pd.DataFrame) -> None:
    assert len(demo) >= 64
    assert list(demo.columns) == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    indexes = [e["index"] for e in demo["extra_info"]]
    assert sorted(indexes) == list(range(len(demo)))
    assert set(demo["data_source"]) == {"openai/gsm8k"} and set(demo["ability"]) == {"math"}
    questions = [e["question"] for e in demo["extra_info"]]
    assert len(set(questions)) == len(questions)
    for prompt, extra, rm in zip(demo["prompt"], demo["extra_info"], demo["reward_model"]):
        # two worked examples as earlier turns, then the question: the answer format is shown, not only asked
        assert [dict(m) for m in prompt[:-1]] == FEW_SHOT and prompt[-1]["role"] == "user"
        assert prompt[-1]["content"] == f"{extra['question']} {INSTRUCTION}"
        assert sum(len(m["content"]) for m in prompt) < 220  # keeps the CPU demo's prefill short
        assert rm["style"] == "rule" and rm["ground_truth"].lstrip("-").isdigit()
        assert extra["split"] == "train" and extra["answer"].endswith(f"#### {rm['ground_truth']}")


def test_every_ground_truth_scores_through_verl(demo: pd.DataFrame) -> None:
    from verl.utils.reward_score import default_compute_score

    assert default_compute_score("openai/gsm8k", "... #### 42", "42") == 1.0
    for source, rm, extra in zip(demo["data_source"], demo["reward_model"], demo["extra_info"]):
        truth = rm["ground_truth"]
        assert default_compute_score(source, f"Step by step.\n#### {truth}", truth) == 1.0
        assert default_compute_score(source, extra["answer"], truth) == 1.0
        assert default_compute_score(source, f"#### {int(truth) + 1}", truth) == 0
        assert default_compute_score(source, f"The answer is {truth}.", truth) == 0  # no "####": strict format


def test_packaged_file_matches_the_generator(tmp_path: Path, demo: pd.DataFrame) -> None:
    assert make_rows(96) == make_rows(96)  # deterministic
    regenerated = pd.read_parquet(write_parquet(make_rows(len(demo)), tmp_path / "demo.parquet"))
    pd.testing.assert_frame_equal(regenerated, demo)


def test_make_demo_cli_writes_requested_count(tmp_path: Path) -> None:
    import subprocess
    import sys

    out = tmp_path / "d.parquet"
    proc = subprocess.run([sys.executable, "-m", "pipegen.inputs.make_demo", "--out", str(out), "--count", "70"],
                          cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert len(pd.read_parquet(out)) == 70


def test_verl_rlhf_dataset_loads_demo_with_tiny_tokenizer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer
    from verl.trainer.ppo.utils import create_rl_dataset

    from pipegen.config.compose import verl_config_dir
    from pipegen.bench.doubles.tiny_models import tiny_model_path

    # keep the HF datasets cache out of the user's home
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-datasets"))
    data_cfg = OmegaConf.load(os.path.join(verl_config_dir(), "data", "legacy_data.yaml"))
    data_cfg.train_files = resolve_train_files("demo")
    data_cfg.filter_overlong_prompts = True  # exercises the chat template over every row
    tok = AutoTokenizer.from_pretrained(tiny_model_path())
    ds = create_rl_dataset(data_cfg.train_files, data_cfg, tok, None, is_train=True, max_samples=-1)
    assert len(ds) == len(pd.read_parquet(DEMO_PARQUET))
    rows = [ds[i] for i in range(len(ds))]
    assert sorted(r["index"] for r in rows) == list(range(len(ds)))
    first = rows[0]
    assert first["raw_prompt"][-1]["role"] == "user" and first["raw_prompt"][-1]["content"].endswith(INSTRUCTION)
    assert first["data_source"] == "openai/gsm8k" and first["reward_model"]["ground_truth"].isdigit()
    assert first["index"] == first["extra_info"]["index"]


def test_resolve_train_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from omegaconf import OmegaConf

    assert resolve_train_files("demo") == [str(DEMO_PARQUET)]
    a, b = tmp_path / "a.parquet", tmp_path / "b.parquet"
    a.write_bytes(b"")
    b.write_bytes(b"")
    assert resolve_train_files(str(a)) == [str(a)]
    assert resolve_train_files([str(a), "demo", b]) == [str(a), str(DEMO_PARQUET), str(b)]
    assert resolve_train_files(OmegaConf.create([str(a)])) == [str(a)]  # Hydra hands over a ListConfig
    monkeypatch.chdir(tmp_path)
    assert resolve_train_files("a.parquet") == [str(a)]  # absolute, for children with another cwd
    monkeypatch.setenv("HOME", str(tmp_path))
    assert resolve_train_files("~/b.parquet") == [str(b)]


@pytest.mark.parametrize("spec", ["missing.parquet", ["demo", "missing.parquet"], [], None])
def test_resolve_train_files_errors_are_one_line_and_name_the_fix(spec: object, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as e:
        resolve_train_files(spec)  # type: ignore[arg-type]
    msg = str(e.value)
    assert "\n" not in msg and "'demo'" in msg
    if spec and spec != []:
        assert "missing.parquet" in msg

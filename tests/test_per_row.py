"""verl's per-row settings and a dataset's indices, checked as a user meets them: a row's `__do_sample__=False`
makes that row greedy (its samples equal a temperature=0 run of it), a per-row column pipegen does not honour is
refused in one line, a duplicate `extra_info.index` is refused before any server starts, and rows the default
reward cannot score are said to be so, before and after."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import FAKE_ENGINE, launch, load_trajectories
from pipegen.config.schema import DEMO_PARQUET

SHORT = ["max_response_length=12", "llm.max_batch=8", "actors.concurrency=8", "generation.save_batch_size=4",
         "generation.partial_batch_quiet_s=0.3", "generation.report=false"]


def _rows(tmp_path: Path, name: str, **columns) -> Path:
    import pandas as pd

    demo = pd.read_parquet(DEMO_PARQUET).head(2)
    for column, values in columns.items():
        demo[column] = values
    demo.to_parquet(path := tmp_path / f"{name}.parquet")
    return path


def _responses(out: Path) -> dict[tuple[int, int], list[int]]:
    data = load_trajectories(out / "trajectories.pkl")
    mask = data.batch["response_mask"].bool()
    return {(int(i), int(s)): data.batch["responses"][k][mask[k]].tolist()
            for k, (i, s) in enumerate(zip(data.non_tensor_batch["index"], data.non_tensor_batch["sample"]))}


def test_a_row_with_do_sample_false_is_greedy(tmp_path: Path, tiny_model: str) -> None:
    rows = _rows(tmp_path, "rows", __do_sample__=[False, True])
    sampled = launch(tmp_path / "sampled", f"model_path={tiny_model}", f"train_files={rows}", "n=3",
                     "temperature=1.0", *SHORT)
    assert sampled.returncode == 0, sampled.stderr[-3000:]
    greedy = launch(tmp_path / "greedy", f"model_path={tiny_model}", f"train_files={_rows(tmp_path, 'plain')}",
                    "n=1", "temperature=0", *SHORT)
    assert greedy.returncode == 0, greedy.stderr[-3000:]
    got, want = _responses(tmp_path / "sampled"), _responses(tmp_path / "greedy")
    (first, second) = sorted({i for i, _ in got})
    assert [got[(first, s)] for s in range(3)] == [want[(first, 0)]] * 3  # the greedy row: each sample greedy
    assert len({tuple(got[(second, s)]) for s in range(3)}) > 1  # the other row is sampled


@pytest.mark.parametrize(("columns", "line"), [
    ({"__remax_baseline__": [True, False]},
     "train_files: column '__remax_baseline__' is a per-row setting pipegen does not honour (it honours "
     "__do_sample__: false makes that row greedy); drop the column"),
    ({"extra_info": [{"index": 7, "split": "train"}, {"index": 7, "split": "train"}]},
     "train_files: extra_info.index 7 appears at rows 0 and 1; indices must be unique"),
])
def test_a_dataset_pipegen_cannot_run_as_written_is_refused_before_a_server_starts(
        tmp_path: Path, tiny_model: str, columns: dict, line: str) -> None:
    rows = _rows(tmp_path, "rows", **columns)
    result = launch(tmp_path / "run", f"model_path={tiny_model}", f"train_files={rows}", timeout=120)
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1] == f"pipegen: error: {line}", \
        result.stderr[-2000:]
    assert not list((tmp_path / "run" / "logs").glob("server_*")), "a server was started"


def test_rows_the_default_reward_cannot_score_are_named_before_and_after(tmp_path: Path, tiny_model: str) -> None:
    import pandas as pd

    demo = pd.read_parquet(DEMO_PARQUET).head(3).drop(columns=["reward_model"])
    demo.to_parquet(rows := tmp_path / "no_truth.parquet")
    result = launch(tmp_path / "run", f"model_path={tiny_model}", f"train_files={rows}", FAKE_ENGINE, "n=1", *SHORT)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert ("warning: the first row has no reward_model.ground_truth, which verl's default_compute_score scores by: "
            "such rows are generated and stay unscored; set custom_reward_function.path=my_reward.py or "
            "reward.verifier_url=URL to score them") in lines, result.stdout
    assert any(line.startswith("  warning:      3 of 3 trajectories have no score (rows verl's default_compute_score "
                               "cannot score: no data_source it knows, or no reward_model.ground_truth); set "
                               "custom_reward_function.path=my_reward.py or reward.verifier_url=URL, then ")
               and line.endswith(f"rescore {(tmp_path / 'run').resolve()} scores them without generating")
               for line in lines), result.stdout

"""`pipegen rescore`: a user fixes a reward that raised on some rows, and the finished run is scored again with
it, generating nothing; the old scores stay beside the new ones, each row names the reward that scored it, and
the run still verifies. The same launch command, before the rescore, points to it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FAKE_ENGINE, FAST, FAST_REPORTED, REPO, assert_verified, launch, load_trajectories, response_texts

# v1 raises on odd rows (their units fail, their samples kept); v2, the fix, scores every row differently
REWARD_V1 = '''
def my_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    if extra_info["index"] % 2 == 1:
        raise ValueError("cannot verify odd rows")
    return {"score": (len(solution_str) % 7) / 6, "length": len(solution_str)}
'''
REWARD_V2 = '''
def my_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return {"score": 1.0 + (len(solution_str) % 7) / 6, "length": len(solution_str)}
'''


def scores(data) -> list[float]:
    width = data.batch["prompts"].shape[1]
    return [float(data.batch["rm_scores"][i, int(data.batch["attention_mask"][i, width:].sum()) - 1])
            for i in range(len(data))]


def test_rescore_after_a_reward_fix_scores_every_row_keeps_the_old_scores_and_generates_nothing(tmp_path, tiny_model):
    reward = tmp_path / "my_reward.py"
    reward.write_text(REWARD_V1)
    out = tmp_path / "run"
    command = [f"model_path={tiny_model}", FAKE_ENGINE, *FAST_REPORTED, f"custom_reward_function.path={reward}",
               "custom_reward_function.name=my_score"]
    first = launch(out, *command)
    assert first.returncode != 0  # the odd rows' units failed (their samples kept for a rescore)
    import orjson

    stale = orjson.loads((out / "report.json").read_bytes())
    assert stale["progress"]["failed"] > 0
    before = load_trajectories(out / "trajectories.pkl")
    old = {(int(i), int(s)): score for i, s, score in zip(before.non_tensor_batch["index"],
                                                          before.non_tensor_batch["sample"], scores(before))}
    assert old and all(index % 2 == 0 for index, _ in old)

    reward.write_text(REWARD_V2)  # the fix
    refused = launch(out, *command)
    assert refused.returncode != 0
    assert "pipegen rescore" in refused.stderr.strip().splitlines()[-1], refused.stderr[-2000:]

    server_log = out / "logs" / "server_0.log"
    server_bytes = server_log.stat().st_size
    done = subprocess.run([sys.executable, "-m", "pipegen.command", "rescore", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "0 generation requests" in done.stdout, done.stdout
    assert server_log.stat().st_size == server_bytes  # no server started, nothing generated

    data = load_trajectories(out / "trajectories.pkl")
    units = sorted(zip((int(i) for i in data.non_tensor_batch["index"]), (int(s) for s in data.non_tensor_batch["sample"])))
    assert units == [(i, s) for i in range(6) for s in range(2)]  # the failed units are delivered now, once each
    texts = response_texts(data, tiny_model)
    reward_by = set(data.non_tensor_batch["reward_by"])
    assert len(reward_by) == 1 and next(iter(reward_by)).startswith("my_score in my_reward.py @ ")
    for i, score in enumerate(scores(data)):
        unit = (int(data.non_tensor_batch["index"][i]), int(data.non_tensor_batch["sample"][i]))
        assert score == pytest.approx(1.0 + (len(texts[i][0]) % 7) / 6, abs=1e-6)  # the fixed reward's
        assert data.non_tensor_batch["length"][i] == len(texts[i][0])
        previous, previous_by = data.non_tensor_batch["previous_score"][i], data.non_tensor_batch["previous_reward_by"][i]
        if unit in old:  # scored at generation by v1: that score kept beside the new one
            assert previous == pytest.approx(old[unit], abs=1e-6) and "at generation" in previous_by
        else:  # its reward failed: no score before, and why
            assert previous is None and previous_by.startswith("none (its reward failed") and "cannot verify odd rows" in previous_by
    assert_verified(Path(out))

    # the rescore refreshed the report: the run's state now, and the new rewards
    assert f"  report:       {out.resolve() / 'report.html'}" in done.stdout, done.stdout
    fresh = orjson.loads((out / "report.json").read_bytes())
    assert fresh["state"] == "finished" and (fresh["progress"]["committed"], fresh["progress"]["failed"]) == (12, 0)
    new_mean = sum(scores(data)) / len(data)
    assert next(iter(fresh["sources"].values()))["mean_reward"] == pytest.approx(new_mean, abs=1e-4)
    # and the same launch command, run again, finds it complete and reports the rewards the output holds
    again = launch(out, *command)
    assert again.returncode == 0 and "already complete" in again.stdout, again.stderr[-2000:]
    assert f"  rewards:      mean {new_mean:.3f} over 12 samples" in again.stdout, again.stdout
    assert "this launch generated nothing (the run was complete)." in again.stdout

    # the report says which reward scored the rows, with the extra key's statistics and the best and worst answers
    from pipegen.report.write import write_report
    from pipegen.run.layout import RunDir

    write_report(RunDir(out))
    numbers = orjson.loads((out / "report.json").read_bytes())
    assert numbers["scored_by"] == {next(iter(reward_by)): 12}
    source = next(iter(numbers["sources"].values()))
    lengths = [len(text) for text, _ in texts]
    assert source["reward_extras"]["length"] == {"rows": 12, "mean": round(sum(lengths) / 12, 4),
                                                 "min": min(lengths), "max": max(lengths)}
    best, worst = next(iter(numbers["examples"].values()))
    rewards = scores(data)
    assert best["which"] == "best" and best["reward"] == pytest.approx(max(rewards), abs=1e-4)
    assert worst["which"] == "worst" and worst["reward"] == pytest.approx(min(rewards), abs=1e-4)
    assert best["text"] in {text for text, _ in texts} and worst["text"] in {text for text, _ in texts}
    assert "Best and worst answers" in (out / "report.html").read_text()
    from pipegen.export.card import card_text
    from pipegen.run.config import load_run_config

    card = card_text(load_run_config(RunDir(out)), RunDir(out), out / "trajectories.parquet", numbers)
    assert f"- scored by: {next(iter(reward_by))} (12 rows)" in card  # the dataset card names the reward too

    only_unscored_rescores_a_batch_without_scores_and_skips_one_with(out, tiny_model)


def only_unscored_rescores_a_batch_without_scores_and_skips_one_with(out: Path, tiny_model: str) -> None:
    """--only-unscored on a batch file whose rows have no score (rm_scores and the provenance columns taken out, as a
    batch of rows no reward applied to holds), then on the same file again: the first call scores every row, the
    second finds them scored and leaves the file alone."""
    import asyncio
    import shutil

    from pipegen.actor.scoring import Scorer
    from pipegen.inputs.dataset import load_tokenizer
    from pipegen.rescore.batch_file import rescore_batch
    from pipegen.run.atomic import atomic_write
    from pipegen.run.batchfile import encode_batch_file, read_batch
    from pipegen.run.config import load_run_config
    from pipegen.run.layout import RunDir
    from pipegen.run.provenance import COLUMNS, current_reward

    run = RunDir(out)
    path = out.parent / "unscored.arrow"
    shutil.copy(run.batch_file(0), path)
    stored = read_batch(path)
    tensors = {k: v for k, v in stored.tensors.items() if k != "rm_scores"}
    non_tensor = {k: v for k, v in stored.non_tensor.items() if k not in COLUMNS}
    atomic_write(path, lambda f: [f.write(c) for c in encode_batch_file(tensors, non_tensor, stored.meta_info, True)])
    assert "rm_scores" not in read_batch(path).tensors

    cfg = load_run_config(run)

    async def rescore(only_unscored: bool):
        scorer = Scorer(cfg, load_tokenizer(cfg))
        try:
            return await rescore_batch(path, scorer, current_reward(cfg), "at generation", only_unscored)
        finally:
            await scorer.close()

    first = asyncio.run(rescore(True))
    assert (first.rescored, first.skipped, first.failed) == (stored.rows, 0, {})
    again = read_batch(path)
    assert "rm_scores" in again.tensors and list(again.non_tensor["previous_score"]) == [None] * stored.rows
    before = path.read_bytes()
    second = asyncio.run(rescore(True))
    assert (second.rescored, second.skipped) == (0, stored.rows) and path.read_bytes() == before


def test_rescore_takes_the_rewards_own_keys_only_each_checked_as_a_launch_checks_it(tmp_path):
    from omegaconf import OmegaConf

    from pipegen.rescore.rescore_run import with_reward_overrides

    cfg = OmegaConf.create({"reward": {"verifier_url": None},
                            "custom_reward_function": {"path": None, "name": "compute_score", "reward_kwargs": {}}})
    with pytest.raises(ValueError, match=r"temperature=0.5: rescore takes only the reward's keys"):
        with_reward_overrides(cfg, ["temperature=0.5"])
    with pytest.raises(ValueError, match="is not an http"):
        with_reward_overrides(cfg, ["reward.verifier_url=localhost:8000"])
    with pytest.raises(ValueError, match="no such file"):
        with_reward_overrides(cfg, [f"custom_reward_function.path={tmp_path / 'missing.py'}"])
    reward = tmp_path / "v3.py"
    reward.write_text(REWARD_V2.replace("my_score", "v3"))
    given = with_reward_overrides(cfg, [f"custom_reward_function.path={reward}", "custom_reward_function.name=v3",
                                        "+custom_reward_function.reward_kwargs.scale=2"])
    assert (given.custom_reward_function.path, given.custom_reward_function.name) == (str(reward), "v3")
    assert given.custom_reward_function.reward_kwargs.scale == 2 and cfg.custom_reward_function.path is None

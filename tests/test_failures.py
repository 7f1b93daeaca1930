"""Units that fail after their retries are reported, never written as samples, and retried on relaunch; the run
report of each launch agrees with `status` and the summary."""

from __future__ import annotations

import re
import subprocess
import sys

import orjson

from pipegen.run.layout import RunDir

from conftest import FAKE_ENGINE, FAST, FAST_REPORTED, assert_verified, launch, load_trajectories


def test_failed_units_are_reported_kept_out_and_retried_by_the_next_launch(tmp_path, tiny_model):
    out = tmp_path / "run"
    base = [f"model_path={tiny_model}", *FAST_REPORTED, FAKE_ENGINE, "generation.max_attempts=1"]
    first = launch(out, *base, "llm.engine_args=[--fail-rate,0.5]")
    assert first.returncode == 1, first.stderr[-3000:]
    assert "unit(s) failed to generate: rerun the same command to retry only them (each with a fresh seed)" in first.stderr
    assert "partial output:" in first.stderr  # the closing line says the output is partial

    ckpt = orjson.loads((out / "checkpoint.json").read_bytes())
    failed = set(ckpt["failed"])
    assert failed, "with half the requests refused and one attempt, some units must fail"
    assert all("503" in info["reason"] for info in ckpt["failed"].values())
    assert ckpt["num_committed"] + len(failed) == 12 and not ckpt["complete"]
    # the output is delivered all the same: every other unit is in trajectories.pkl (and the zip), the failed
    # ones are named in failed_units.json and in the closing summary, grouped by reason with counts
    partial = load_trajectories(out / "trajectories.pkl")
    delivered = {f"{i}:{s}" for i, s in zip(partial.non_tensor_batch["index"], partial.non_tensor_batch["sample"])}
    assert len(delivered) == ckpt["num_committed"] and not delivered & failed
    # and says so itself: a trainer reading only trajectories.pkl learns it is partial, and where the rest is named
    assert {k: partial.meta_info[k] for k in ("complete", "committed_units", "total_units", "failed_units",
                                              "pending_units", "failed_units_file")} == {
        "complete": False, "committed_units": ckpt["num_committed"], "total_units": 12, "failed_units": len(failed),
        "pending_units": 0, "failed_units_file": "failed_units.json"}
    listing = orjson.loads((out / "failed_units.json").read_bytes())
    assert set(listing["units"]) == failed and listing["failed"] == len(failed)
    assert (out / "trajectories.zip").exists()
    assert_verified(out)  # a partial output is a consistent run directory, not a complete one
    assert f"{len(failed)} unit(s) (" in first.stderr and "503" in first.stderr
    failure_lines = [orjson.loads(l) for p in RunDir(out).failures.rglob("*.jsonl")
                     for l in p.read_bytes().splitlines()]
    assert {f"{r['index']}:{r['sample']}" for r in failure_lines} == failed
    assert {r["attempt"] for r in failure_lines} == {0}, "a unit's first try is attempt 0"
    # a failed unit is never in a batch, not even as an empty or zero-reward row
    from pipegen.writer.batches import from_storage, load_batch

    in_batches = set()
    for number in range(ckpt["batches"]["count"]):
        data = from_storage(load_batch(RunDir(out).batch_file(number)))
        in_batches |= {f"{i}:{s}" for i, s in zip(data.non_tensor_batch["index"], data.non_tensor_batch["sample"])}
    assert not in_batches & failed and len(in_batches) == ckpt["num_committed"]

    assert_report_matches_status(out, first.stderr)

    # the server recovered: the same setup relaunched retries exactly the failed units
    second = launch(out, *base)
    assert second.returncode == 0, second.stderr[-3000:]
    # the summary counts the whole run and this launch apart, and names the reward
    assert "pipegen: done: 12 samples (12 trajectories), " in second.stdout, second.stdout
    assert f"; this launch: {len(failed)} samples, " in second.stdout, second.stdout
    assert "  reward:       verl's default_compute_score by data_source" in second.stdout
    tokens = re.search(r"trajectories\), (\d+) output tokens; this launch: \d+ samples, (\d+) output tokens",
                       second.stdout)
    assert tokens and int(tokens[1]) > int(tokens[2]) > 0, second.stdout  # the run's tokens, then this launch's
    data = load_trajectories(out / "trajectories.pkl")
    units = sorted(zip((int(i) for i in data.non_tensor_batch["index"]), (int(s) for s in data.non_tensor_batch["sample"])))
    assert units == [(i, s) for i in range(6) for s in range(2)]
    assert "failed_units" not in data.meta_info and "complete" not in data.meta_info  # complete: nothing to say
    ckpt = orjson.loads((out / "checkpoint.json").read_bytes())
    assert ckpt["complete"] and ckpt["failed"] == {}
    # each record says which try produced it: a retried unit is attempt 1, every other unit attempt 0
    records = [orjson.loads(l) for p in RunDir(out).rollouts.rglob("*.jsonl") for l in p.read_bytes().splitlines()]
    attempts = {f"{r['index']}:{r['sample']}": r["attempt"] for r in records}
    assert len(records) == len(attempts) == 12
    assert attempts == {unit: 1 if unit in failed else 0 for unit in attempts}
    # each retry draws a fresh seed: its attempt is mixed in
    first_seeds = {f"{r['index']}:{r['sample']}": r["seed"] for r in failure_lines}
    retried = {f"{r['index']}:{r['sample']}": r["seed"] for r in records if r["attempt"] == 1}
    assert all(retried[u] != first_seeds[u] for u in failed)
    assert not (out / "failed_units.json").exists()
    numbers = assert_report_matches_status(out, second.stdout)
    (source,) = numbers["sources"].values()
    summary = re.search(r"rewards: +mean ([0-9.]+) over (\d+) samples; pass@2 ([0-9.]+) \((\d+) of (\d+) prompts",
                        second.stdout)
    assert summary, second.stdout
    assert f"{source['mean_reward']:.3f}" == summary[1] and source["scored_rows"] == int(summary[2]) == 12
    assert f"{source['pass_at_k']['2']['value']:.2f}" == summary[3]
    assert (source["prompts_with_a_pass"], source["prompts"]) == (int(summary[4]), int(summary[5]))
    cut = re.search(r"responses: +(\d+) of (\d+) reached", second.stdout)
    assert (source["at_length_limit"], source["rows"]) == (int(cut[1]), int(cut[2]))


def assert_report_matches_status(out, output: str) -> dict:
    """The launch's summary ends with the line naming the report, whose progress, state and failures (grouped by
    reason) are those `python -m pipegen.status --json` shows."""
    assert output.strip().splitlines()[-1] == f"  report:       {out / 'report.html'}", output[-2000:]
    numbers = orjson.loads((out / "report.json").read_bytes())
    status = orjson.loads(subprocess.run([sys.executable, "-m", "pipegen.status", str(out), "--json"],
                                         capture_output=True, check=True).stdout)
    assert numbers["state"] == status["state"]
    progress = status["progress"]
    assert [numbers["progress"][k] for k in ("units", "committed", "failed", "pending", "complete")] == \
        [progress[k] for k in ("total", "committed", "failed", "pending", "complete")]
    assert numbers["progress"]["rows_read"] == progress["committed"]  # one row per unit here
    assert sum(g["units"] for g in numbers["failures"]) == len(status["failed_units"])
    assert {u for g in numbers["failures"] for u in g["examples"]} <= set(status["failed_units"])
    assert all("503" in g["reason"] for g in numbers["failures"])
    return numbers


STUBBORN_LOOP = """
from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop


class StubbornLoop(SingleTurnAgentLoop):
    \"\"\"verl's single-turn loop, except that one row fails every time: a user's bug that no retry fixes.\"\"\"

    async def run(self, sampling_params, **kwargs):
        if int(kwargs["index"]) == 2:
            raise ValueError("row 2 trips the loop")
        return await super().run(sampling_params, **kwargs)
"""


def test_a_unit_that_always_fails_leaves_every_other_unit_delivered(tmp_path, tiny_model):
    """With the defaults (its attempts, the output delivered), one stubborn unit does not withhold the others:
    trajectories.pkl holds every other unit, failed_units.json and the closing summary name the failed one
    with its reason, and the exit code says the output is partial."""
    (tmp_path / "stubborn_loop.py").write_text(STUBBORN_LOOP)
    (tmp_path / "loops.yaml").write_text("- name: stubborn\n  _target_: stubborn_loop.StubbornLoop\n")
    out = tmp_path / "run"
    result = launch(out, f"model_path={tiny_model}", *FAST, FAKE_ENGINE, "max_samples=4", "n=1",
                    f"actor_rollout_ref.rollout.agent.agent_loop_config_path={tmp_path / 'loops.yaml'}",
                    "actor_rollout_ref.rollout.agent.default_agent_loop=stubborn",
                    env={"PYTHONPATH": str(tmp_path)})
    assert result.returncode == 1, result.stderr[-3000:]
    assert "partial output:" in result.stderr and "1 unit(s) (" in result.stderr, result.stderr[-3000:]
    assert "row 2 trips the loop" in result.stderr  # the reason, not only a count
    data = load_trajectories(out / "trajectories.pkl")
    assert sorted(int(i) for i in data.non_tensor_batch["index"]) == [0, 1, 3]
    listing = orjson.loads((out / "failed_units.json").read_bytes())
    assert list(listing["units"]) == ["2:0"] and "row 2 trips the loop" in orjson.dumps(listing).decode()
    assert_verified(out)


def test_final_merge_false_keeps_batches_only(tmp_path, tiny_model):
    out = tmp_path / "run"
    result = launch(out, f"model_path={tiny_model}", *FAST, FAKE_ENGINE, "generation.final_merge=false")
    assert result.returncode == 0, result.stderr[-3000:]
    assert not (out / "trajectories.pkl").exists()
    ckpt = orjson.loads((out / "checkpoint.json").read_bytes())
    assert ckpt["complete"] and ckpt["batches"]["rows"] == 12
    assert "batch_" in result.stdout

"""Tasks: `tasks=[...]` resolves names to data and a reward through manifests,
offline; a user's manifest file adds a task (its own generator and reward); rows of several tasks keep
their data_source and each is scored by its own task's reward; `python -m pipegen.tasks` lists them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FAKE_ENGINE, FAST, REPO, directory_bytes, launch, load_trajectories, response_texts

GENERATOR = '''
def make(size, seed, offset=8):
    """A user's generator: the same entries for the same seed."""
    return [{"question": f"What is {seed + i} - {offset}?", "answer": str(seed + i - offset)} for i in range(size)]
'''

REWARD = '''
import re


def exact(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    found = re.findall(r"<answer>(.*?)</answer>", solution_str)
    return 1.0 if found and found[-1].strip() == ground_truth else 0.25
'''

MANIFEST = """
name: my_subtraction
description: a user's own task
data:
  generator: gen.py:make
  size: 4
  seed: 2
  config: {offset: 8}
prompt:
  system: Answer inside <answer></answer>.
  template: "Question: {question}"
reward:
  path: my_reward.py
  name: exact
defaults: {n: 3, max_response_length: 64}
"""

REPLY = "<answer>-4</answer>"  # every reply of the scripted fake engine


@pytest.fixture
def user_task(tmp_path) -> Path:
    folder = tmp_path / "my_task"
    folder.mkdir()
    (folder / "gen.py").write_text(GENERATOR)
    (folder / "my_reward.py").write_text(REWARD)
    (folder / "task.yaml").write_text(MANIFEST)
    return folder / "task.yaml"


def test_python_m_pipegen_tasks_lists_built_in_and_given_tasks(user_task):
    result = subprocess.run([sys.executable, "-m", "pipegen.tasks", str(user_task)], cwd=REPO, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    names = {line.split()[0] for line in result.stdout.splitlines() if line.startswith("  ") and line.strip()
             and not line.startswith("   ")}
    assert {"gsm_symbolic", "chain_sum", "leg_counting", "basic_arithmetic", "my_subtraction"} <= names
    assert "reasoning_gym:gsm_symbolic" in result.stdout and str(user_task.resolve()) in result.stdout


def test_tasks_resolve_defaults_deterministic_files_and_clear_errors(tmp_path, user_task):
    from pipegen.run.layout import RunDir
    from pipegen.tasks.manifest import TaskError
    from pipegen.launch.job import compose_job as compose
    from pipegen.tasks.materialize import task_data, write_task_files

    cfg = compose([f"output_dir={tmp_path}", f"tasks=[{user_task},gsm_symbolic]", "n=5"])
    # the command line wins (n); lengths are the longest any task asks for; verl's keys follow
    assert cfg.actor_rollout_ref.rollout.n == 5
    assert cfg.actor_rollout_ref.rollout.response_length == 1024 and cfg.data.max_prompt_length == 1024
    with pytest.raises(TaskError, match="set different defaults for n"):
        compose([f"output_dir={tmp_path}", f"tasks=[{user_task},gsm_symbolic]"])  # 3 vs 4
    with pytest.raises(TaskError, match="no task named 'nope'; built-in: basic_arithmetic, chain_sum"):
        compose([f"output_dir={tmp_path}", "tasks=[nope]"])

    # the same manifest and seed give the same file (named by its digest), rows numbered across tasks
    first = task_data([str(user_task), "chain_sum"], RunDir(tmp_path / "a"))
    assert not (tmp_path / "a").exists()  # computed, not written: the launcher writes them holding the lock
    again = task_data([str(user_task), "chain_sum"], RunDir(tmp_path / "b"))
    write_task_files(first + again)
    assert [t.path.name for t in first] == [t.path.name for t in again]
    assert [t.path.read_bytes() for t in first] == [t.path.read_bytes() for t in again]
    import pyarrow.parquet as pq

    rows = pq.read_table(first[0].path).to_pylist() + pq.read_table(first[1].path).to_pylist()
    assert [r["extra_info"]["index"] for r in rows] == list(range(504))
    assert rows[0]["prompt"] == [{"role": "system", "content": "Answer inside <answer></answer>."},
                                 {"role": "user", "content": "Question: What is 2 - 8?"}]
    assert rows[0]["data_source"] == "my_subtraction" and rows[4]["data_source"] == "chain_sum"
    # max_samples across tasks takes from each in turn, not every row from the first
    limited = task_data([str(user_task), "chain_sum"], RunDir(tmp_path / "d"), max_samples=6)
    write_task_files(limited)
    assert [t.rows for t in limited] == [3, 3]
    rows = pq.read_table(limited[0].path).to_pylist() + pq.read_table(limited[1].path).to_pylist()
    assert [r["extra_info"]["index"] for r in rows] == list(range(6))

    bad = user_task.parent / "bad.yaml"
    bad.write_text(MANIFEST.replace("size: 4", "size: 4\n  sizes: 5"))
    with pytest.raises(TaskError, match=r"bad.yaml: data.sizes: Extra inputs are not permitted"):
        task_data([str(bad)], RunDir(tmp_path / "c"))


def test_builtin_and_user_tasks_run_offline_each_row_scored_by_its_own_task(tmp_path, tiny_model, user_task):
    from pipegen.tasks.reasoning_gym import compute_score as task_score

    script = tmp_path / "script.json"
    script.write_text(json.dumps([REPLY]))
    out = tmp_path / "run"
    result = launch(out, f"model_path={tiny_model}", FAKE_ENGINE, *FAST, f"tasks=[{user_task},chain_sum]",
                    "max_samples=7", f"llm.engine_args=[--script,{script}]",
                    env={"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    data = load_trajectories(out / "trajectories.pkl")
    assert len(data) == 7 * 2
    sources = list(data.non_tensor_batch["data_source"])
    assert sources == ["my_subtraction"] * 8 + ["chain_sum"] * 6  # rows sorted by index: the user task first

    scores = []
    for i, (text, length) in enumerate(response_texts(data, tiny_model)):
        assert text == REPLY
        row_reward = data.batch["rm_scores"][i, length - 1].item()
        gt = data.non_tensor_batch["reward_model"][i]["ground_truth"]
        if sources[i] == "chain_sum":  # reasoning-gym's own scorer
            want = task_score(sources[i], text, gt, data.non_tensor_batch["extra_info"][i])
        else:  # the manifest's reward file
            want = 1.0 if gt == "-4" else 0.25
        assert row_reward == pytest.approx(want), (i, sources[i], gt)
        scores.append(row_reward)
    assert sorted(set(scores)) == [0.0, 0.25, 1.0]  # every reward spoke: both tasks, right and wrong answers
    assert data.non_tensor_batch["acc"].tolist() == scores  # a float result's extras: verl's {"acc": score}

    # A relaunch with a changed task (new rows, so a new task file) is refused, and leaves the run directory
    # byte for byte as it was: no task file, config or fingerprint is written before the lock and the guard.
    before = directory_bytes(out)
    user_task.write_text(MANIFEST.replace("seed: 2", "seed: 3"))
    refused = launch(out, f"model_path={tiny_model}", FAKE_ENGINE, *FAST, f"tasks=[{user_task},chain_sum]",
                     "max_samples=7", f"llm.engine_args=[--script,{script}]",
                     env={"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    assert refused.returncode == 2, refused.stderr[-3000:]
    error = refused.stderr.strip().splitlines()[-1]
    assert error.startswith("pipegen: error:") and "data_files" in error, error
    assert directory_bytes(out) == before


def test_task_files_are_written_only_after_the_lock_and_the_resume_guard():
    """What `grep` shows: one place writes task files (materialize.write_task_files), one place calls it,
    prepare(), after it took the launcher lock and the resume guard passed."""
    package = REPO / "pipegen"
    callers = sorted(str(p.relative_to(package)) for p in package.rglob("*.py") if "write_task_files(" in p.read_text())
    assert callers == ["launch/prepare.py", "tasks/materialize.py"]
    prepare = (package / "launch" / "prepare.py").read_text()
    body = prepare[prepare.index("def prepare("):]
    assert body.index("lock.acquire()") < body.index("guard_resume(") < body.index("write_task_files(")
    materialize = (package / "tasks" / "materialize.py").read_text()
    assert materialize.count("atomic_write_bytes(") == 1  # inside write_task_files

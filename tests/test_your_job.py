"""A user's own job, run as a user runs it: their dataset with no other settings gets every row and the
full response limit, the first line says what will run, the closing summary says what was left out, and
docs/outputs.md's live-inspection command shows each finished unit's text and reward."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

from conftest import FAKE_ENGINE, FAST, REPO, launch
from fake_servers import write_dataset

QUESTION = ("Natalia sold clips to {k} of her friends in April, and then she sold half as many clips in May. "
            "How many clips did Natalia sell altogether in April and May? Let's think step by step and output "
            "the final answer after \"####\".")


def test_a_users_parquet_with_no_other_settings_gets_every_row_and_the_full_response_limit(
        tmp_path: Path, tiny_model: str) -> None:
    data = write_dataset(tmp_path / "gsm8k.parquet",
                         [{"content": QUESTION.format(k=2 * i + 2), "ground_truth": str(3 * (i + 1))}
                          for i in range(100)])
    out = tmp_path / "run"
    # model_path and the fake engine only make it cheap: every setting of the job is the default
    result = launch(out, f"model_path={tiny_model}", f"train_files={data}", FAKE_ENGINE, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    # n follows verl's rollout.n (1) for a user's own data
    from pipegen.run.precision import cpu_has_native_bf16

    # the CPU server's precision is stated: bf16 where the CPU has it natively (its log-probs differ from float32)
    dtype = (" in bfloat16 (this CPU has native bf16; llm.dtype=float32 for float32)" if cpu_has_native_bf16()
             else " in float32")
    assert lines[0] == ("pipegen: 100 prompts of gsm8k.parquet (all its 100 rows) x 1 sample = 100 units; "
                        "responses up to 4096 tokens, prompts up to 1024; llm=cpu: no NVIDIA GPU visible, so "
                        f"pipegen's CPU server{dtype}; not reproducible (generation.reproducible=false): a unit's "
                        "numerics follow what shares its batch"), result.stdout
    assert "pipegen: done: 100 samples" in result.stdout
    assert ("  prompts:      100 of the 100 rows of gsm8k.parquet; skipped: 0 by max_samples, 0 as too long "
            "(data.filter_overlong_prompts)") in lines, result.stdout
    responses = next(line for line in lines if line.startswith("  responses:"))
    assert re.fullmatch(r"  responses:    \d+ of 100 reached the response limit \(4096 tokens\).*", responses)

    from verl import DataProto

    merged = DataProto.load_from_disk(str(out / "trajectories.pkl"))
    assert len(merged) == 100
    assert sorted(set(merged.non_tensor_batch["index"].tolist())) == list(range(100))
    assert merged.batch["responses"].shape[1] == 4096  # verl pads to the response limit: nothing cut below it
    assert merged.batch["prompts"].shape[1] == 1024


def test_the_summary_counts_prompts_left_out_by_max_samples_and_as_too_long(tmp_path: Path, tiny_model: str) -> None:
    """With the progress bar off, the terminal holds pipegen's lines alone: the plan line, progress lines in its own
    words and the summary; what verl prints (its console logger's `step:N - ...`, the file logger's path, the
    dataset's class and length) is in the launcher's log."""
    long = "Count the words of this long question. " * 40
    rows = [{"content": long if i in (1, 3) else QUESTION.format(k=i + 2)} for i in range(10)]
    data = write_dataset(tmp_path / "mixed.parquet", rows)
    result = launch(tmp_path / "run", f"model_path={tiny_model}", f"train_files={data}", FAKE_ENGINE,
                    *[o for o in FAST if not o.startswith("max_samples=")], "max_samples=8", "max_prompt_length=160",
                    "data.filter_overlong_prompts=true", "generation.show_progress=false",
                    "trainer.logger=[console,file]")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert all(line.startswith(("pipegen: ", "  ")) for line in lines), result.stdout
    assert "samples on disk (12 committed) | Saved: " in result.stderr, result.stderr
    terminal, log = result.stdout + result.stderr, (tmp_path / "run" / "logs" / "launch.log").read_text()
    for printed in ("step:1 - progress/done:", "Creating file logger at ", "Using dataset class", "dataset len: "):
        assert printed not in terminal and printed in log, printed
    assert lines[0].startswith("pipegen: at most 8 prompts of mixed.parquet (8 of its 10 rows: max_samples=8) x 2 "
                               "samples = at most 16 units; responses up to 24 tokens, prompts up to 160"), lines[0]
    assert "pipegen: done: 12 samples" in result.stdout
    assert ("  prompts:      6 of the 10 rows of mixed.parquet; skipped: 2 by max_samples, 2 as too long "
            "(data.filter_overlong_prompts)") in lines, result.stdout


def _readme_watch_command() -> str:
    readme = (REPO / "docs" / "outputs.md").read_text()
    return next(line.split("#")[0].strip() for line in readme.splitlines()
                if line.startswith("python -m pipegen.status ") and "--follow" in line)


def _watch(command: str, cwd: Path, until: int, timeout_s: float) -> list[str]:
    """What `command` prints on a terminal (a pty, so `cut` writes each line as a person sees it) until it
    has printed `until` unit lines or `timeout_s` passed."""
    import pty
    import select

    master, slave = pty.openpty()
    watcher = subprocess.Popen(["bash", "-c", command], cwd=cwd, stdout=slave, stderr=slave, start_new_session=True)
    os.close(slave)
    text = b""
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline and text.count(b'{"index"') < until:
            if select.select([master], [], [], 0.5)[0]:
                try:
                    text += os.read(master, 65536)
                except OSError:
                    break
    finally:
        os.killpg(watcher.pid, signal.SIGTERM)
        watcher.wait(timeout=30)
        os.close(master)
    return text.decode("utf-8", errors="replace").replace("\r\n", "\n").splitlines()


def test_readmes_live_inspection_shows_each_units_text_reward_and_finish(tmp_path: Path, tiny_model: str) -> None:
    """docs/outputs.md's command, started on a demo run as it goes: one readable line per finished unit."""
    from conftest import assert_verified

    out = tmp_path / "runs" / "demo"
    command = _readme_watch_command()
    assert command == "python -m pipegen.status runs/demo --follow"
    # started before the run: the directory is empty (or not there); it waits for the first shard
    command = command.replace("python", shlex.quote(sys.executable), 1)
    run = subprocess.Popen([sys.executable, "-m", "pipegen.launch", f"output_dir={out}", f"model_path={tiny_model}",
                            *FAST, FAKE_ENGINE, "llm.engine_args=[--token-latency,0.05]"], cwd=REPO,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        printed = _watch(command, tmp_path, until=12, timeout_s=240)
    finally:
        stdout, stderr = run.communicate(timeout=240)
    assert run.returncode == 0, stderr[-3000:]
    assert_verified(out)
    units = [line for line in printed if line.startswith('{"index"')]
    assert len(units) == 12, printed

    from verl import DataProto

    from pipegen.inputs.dataset import load_tokenizer
    from pipegen.run.config import load_run_config
    from pipegen.run.layout import RunDir

    merged = DataProto.load_from_disk(str(out / "trajectories.pkl"))
    tokenizer = load_tokenizer(load_run_config(RunDir(out)))
    expected = {}
    for row in range(len(merged)):
        mask = merged.batch["response_mask"][row].bool()
        text = " ".join(tokenizer.decode(merged.batch["responses"][row][mask].tolist(),
                                         skip_special_tokens=True).split())
        key = (int(merged.non_tensor_batch["index"][row]), int(merged.non_tensor_batch["sample"][row]))
        expected[key] = (float(merged.batch["rm_scores"][row].sum()), text, int(mask.sum()))
    head = re.compile(r'\{"index":(\d+),"sample":(\d+),"reward":(-?[0-9.]+|null),"finish":"(stop|length)",'
                      r'"text":"(.*)')
    full = {}  # the same lines whole, as the writer reads them
    for shard in sorted((out / "streams" / "rollouts" / "actor_0").glob("*.jsonl")):
        for raw in shard.read_bytes().splitlines():
            record = orjson.loads(raw)
            full[(record["index"], record["sample"])] = record
    for line in units:
        assert len(line) <= 200
        m = head.match(line)
        assert m, line
        key = (int(m.group(1)), int(m.group(2)))
        reward, text, tokens = expected[key]
        assert float(m.group(3)) == pytest.approx(reward)
        assert m.group(4) == ("length" if tokens >= 24 else "stop")
        shown = full[key]["text"]
        assert len(shown) >= min(100, len(text) - 3) and text.startswith(shown[:-3]), (shown, text)
        escaped = orjson.dumps(shown).decode()[1:-1]
        visible = m.group(5)
        assert visible.startswith(escaped[:100]) or escaped.startswith(visible), (visible, escaped)


def test_a_plain_string_prompt_column_is_one_user_message_and_the_plan_line_says_so(tmp_path: Path,
                                                                                    tiny_model: str) -> None:
    """A `prompt` column of plain strings (not chat messages): each row is one user message, through verl's own
    dataset class, and the plan line says so (it once failed with "'str' object has no attribute 'role'")."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipegen.inputs.dataset import load_dataset, load_tokenizer
    from pipegen.launch.job import resolve_job
    from pipegen.observe.summary import plan_line

    data = tmp_path / "plain.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": f"What is {i} + 1?", "data_source": "plain",
                                          "reward_model": {"ground_truth": str(i + 1)}, "extra_info": {"index": i}}
                                         for i in range(3)]), data)
    job = resolve_job([f"output_dir={tmp_path / 'run'}", f"train_files={data}", f"model_path={tiny_model}"])
    dataset = load_dataset(job.cfg, load_tokenizer(job.cfg))
    assert len(dataset) == 3
    assert dataset[1]["raw_prompt"] == [{"role": "user", "content": "What is 1 + 1?"}]
    assert "the prompt column holds plain strings: each is sent as one user message" in plan_line(job.cfg, job.run)

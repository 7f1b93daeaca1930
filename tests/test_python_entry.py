"""The Python entry, `pipegen.generate(...)` / `pipegen.run_generation(cfg)`: the demo run from Python with the
command line's keys, its directory and summary back, a resume by calling again, and the launcher's one-line
error as an exception. The demo ends with its report (rendered by a headless chromium) and exports ATIF."""

from __future__ import annotations

import html
import re
import subprocess
import time
from pathlib import Path

import numpy as np
import orjson
import pytest

import pipegen
from conftest import FAKE_ENGINE, FAST, FAST_REPORTED, assert_verified
from pipegen.api import to_overrides
from pipegen.report.page import shown


def test_the_demo_runs_through_generate_and_a_second_call_resumes_it(tmp_path: Path, tiny_model: str) -> None:
    keys = dict(o.split("=", 1) for o in FAST_REPORTED)
    engine = FAKE_ENGINE.split("=", 1)[1]
    out = tmp_path / "demo"
    started = time.monotonic()
    result = pipegen.generate(out, model_path=tiny_model, llm={"engine": engine}, quiet=True, **keys)
    wall = time.monotonic() - started
    assert result.run_dir == out.resolve()
    assert_verified(out)
    s = result.summary
    assert (s.complete, s.samples, s.units, s.prompts, s.n, s.failed) == (True, 12, 12, 6, 2, {})
    assert s.output == out.resolve() / "trajectories.pkl" and s.artifact == out.resolve() / "trajectories.zip"
    assert (s.dataset_rows, s.skipped_by_max_samples, s.skipped_too_long) == (96, 90, 0)
    assert s.response_limit == 24 and 0 <= s.responses_at_limit <= 12 and s.mean_reward is not None

    from verl import DataProto

    assert len(DataProto.load_from_disk(str(s.output))) == 12
    before = s.output.stat().st_mtime_ns
    again = pipegen.run_generation({"output_dir": str(out), "model_path": tiny_model, "llm": {"engine": engine},
                                    **keys}, quiet=True)
    assert again.summary == s and s.output.stat().st_mtime_ns == before  # the same run, found complete

    # the demo ends with its report, holding the summary's numbers. What it cost is printed, never judged here: a
    # test's time depends on what else the machine runs, so costs belong in the bench (python -m pipegen.bench)
    numbers = orjson.loads((out / "report.json").read_bytes())
    (source,) = numbers["sources"].values()
    assert (numbers["state"], numbers["progress"]["committed"], source["rows"], source["prompts"]) == \
        ("finished", 12, 12, 6)
    assert source["mean_reward"] == round(s.mean_reward, 4) and source["at_length_limit"] == s.responses_at_limit
    assert source["pass_at_k"][str(s.n)]["value"] == round(s.pass_at_n, 4)
    print(f"report: {numbers['report_seconds']} s ({numbers['report_cpu_seconds']} s of CPU), the demo run {wall:.1f} s")
    assert_report_renders(out, numbers, tmp_path)

    # a single-turn run exports ATIF as one-step trajectories: the prompt's messages, then one agent step
    from atif import Trajectory

    from pipegen.export.__main__ import main as export_main

    assert export_main([str(out), "--format", "atif"]) == 0
    docs = [orjson.loads(p.read_bytes()) for p in sorted((out / "trajectories.atif").glob("*.json"))]
    assert len(docs) == 12
    for doc in docs:
        Trajectory.model_validate(doc)
        sampled = [st for st in doc["steps"] if "metrics" in st]
        assert len(sampled) == 1 and sampled[0] is doc["steps"][-1] and sampled[0]["source"] == "agent"


def assert_report_renders(out: Path, numbers: dict, tmp_path: Path) -> None:
    """Debian's headless chromium opens report.html from disk, with no network: the screenshot is not blank and
    the page holds report.json's numbers."""
    chromium = Path("/usr/bin/chromium")
    if not chromium.exists():
        pytest.skip("the report's rendering check needs Debian's chromium (/usr/bin/chromium): ./launch.sh --tests "
                    "installs it where apt-get runs as root; here it is absent")
    flags = [str(chromium), "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={tmp_path / 'chr'}"]
    page = (out / "report.html").as_uri()
    shot = tmp_path / "report.png"
    subprocess.run([*flags, f"--screenshot={shot}", "--window-size=1280,2000", page], capture_output=True,
                   timeout=120, check=True)
    from PIL import Image

    pixels = np.asarray(Image.open(shot).convert("L"))
    assert pixels.std() > 10 and (pixels < 128).mean() > 0.01, "the screenshot is blank"
    dom = subprocess.run([*flags, "--dump-dom", page], capture_output=True, text=True, timeout=120, check=True).stdout
    assert dom.count("data:image/png;base64,") >= 3  # the plots, embedded
    text = html.unescape(re.sub(r"<[^>]+>", " ", dom))
    for source, stats in numbers["sources"].items():
        assert source in text
        for value in (stats["rows"], stats["prompts"], stats["mean_reward"], *stats["reward_ci95"],
                      stats["at_length_limit"], stats["at_length_limit_share"], *stats["response_length"].values(),
                      *(p["value"] for p in stats["pass_at_k"].values())):
            assert str(value) in text, value
    for value in numbers["progress"].values():
        assert shown(value) in text


def test_a_refused_setting_raises_the_launchers_one_line_error(tmp_path: Path) -> None:
    with pytest.raises(pipegen.GenerationError) as refused:
        pipegen.generate(tmp_path / "run", quiet=True, **{"trainer.total_epochs": 3})
    assert str(refused.value).startswith("trainer.total_epochs is not used by pipegen: each prompt is generated n "
                                         "times"), refused.value
    assert refused.value.returncode == 2 and "\n" not in str(refused.value)


def test_keys_become_the_command_lines_overrides() -> None:
    assert to_overrides({"output_dir": "runs/a b", "n": 4, "llm": {"kind": "vllm", "tp": 2}, "temperature": 0.7,
                         "data.shuffle": True, "trainer": {"logger": ["console", "wandb"]}, "data": {
                             "apply_chat_template_kwargs": {"enable_thinking": False}}, "llm.context_length": None}) == [
        "output_dir='runs/a b'", "n=4", "llm=vllm", "llm.tp=2", "temperature=0.7", "data.shuffle=true",
        "trainer.logger=[console,wandb]", "data.apply_chat_template_kwargs={enable_thinking:false}",
        "llm.context_length=null"]


def test_an_interrupted_generate_resumes_with_the_next_call(tmp_path: Path, tiny_model: str) -> None:
    """Ctrl-C in the caller stops the launcher and every process of the run; calling again finishes it with
    every unit exactly once. The caller's SIGINT comes while the run cannot finish: the server it runs against
    (the test's own) is paused once the first unit is in a shard, with units still to generate."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from fake_servers import FakeServer

    keys = dict(o.split("=", 1) for o in FAST if not o.startswith("llm."))  # the server's own: its flags
    # two requests at a time, 24 tokens each at 30 ms a token: the first lines land well before the last units
    server = FakeServer("server", tmp_path, tiny_model, "--slots", "2", "--token-latency", "0.03", "--eos-prob", "0")
    try:
        server.wait_ready()
        llm = {"kind": "external", "urls": [server.url]}
        out = tmp_path / "demo"
        call = f"import pipegen; pipegen.generate({str(out)!r}, model_path={tiny_model!r}, quiet=True, llm={llm!r}, **{keys!r})"
        # SIGINT as a terminal's Ctrl-C finds it: a test runner's worker may start its children with SIGINT ignored
        caller = subprocess.Popen([sys.executable, "-c", call], stderr=subprocess.PIPE, text=True,
                                  preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        shards = out / "streams" / "rollouts"
        deadline = time.monotonic() + 240
        while not any(p.stat().st_size for p in shards.glob("actor_*/*.jsonl")) and time.monotonic() < deadline:
            assert caller.poll() is None, caller.stderr.read()[-2000:]
            time.sleep(0.05)
        os.kill(server.proc.pid, signal.SIGSTOP)  # no unit finishes from here on: the run cannot end by itself
        try:
            done = sum(p.read_bytes().count(b"\n") for p in shards.glob("actor_*/*.jsonl"))
            assert 0 < done < 12 and caller.poll() is None, done
            os.kill(caller.pid, signal.SIGINT)
            assert caller.wait(timeout=120) != 0
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        assert "KeyboardInterrupt" in caller.stderr.read()
        assert not (out / "trajectories.pkl").exists()
        # the report of a run cut short: what is committed so far, and the state status gives it
        from pipegen.report import main as report_main

        assert not (out / "report.json").exists() and report_main([str(out)]) == 0
        numbers = orjson.loads((out / "report.json").read_bytes())
        assert numbers["state"] == "stopped before completion" and not numbers["progress"]["complete"]
        assert numbers["progress"]["rows_read"] == numbers["progress"]["committed"] < 12

        result = pipegen.generate(out, model_path=tiny_model, llm=llm, quiet=True, **keys)
        assert_verified(out)
        assert (result.summary.complete, result.summary.samples, result.summary.failed) == (True, 12, {})
    finally:
        server.stop()

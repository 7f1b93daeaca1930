"""The resume guard: a relaunch or a writer restart with a different setup is refused with one line
naming what changed and how to proceed; an unchanged relaunch is accepted."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from conftest import FAKE_ENGINE, FAST, REPO, directory_bytes, launch, load_trajectories

from pipegen.run.fingerprint import OVERRIDE_KEY, check_fingerprint, compute_fingerprint, mismatch_message, sampled_digest

FAKE = [*FAST, FAKE_ENGINE]


def composed(out: Path, *overrides: str):
    """The config exactly as the launcher resolves it (launch/job.py)."""
    from pipegen.launch.job import resolve_job

    return resolve_job([f"output_dir={out}", *overrides]).cfg


def fingerprint(out: Path, *overrides: str) -> dict:
    return orjson.loads(orjson.dumps(compute_fingerprint(composed(out, *overrides))))


def assert_refusal(message: str, *expected: str) -> None:
    assert "\n" not in message.strip(), message
    assert "new output_dir" in message and f"{OVERRIDE_KEY}=true" in message, message
    for text in expected:
        assert text in message, message


@pytest.fixture
def model_copy(tmp_path, tiny_model) -> Path:
    dst = tmp_path / "model"
    shutil.copytree(tiny_model, dst)
    return dst


def test_fingerprint_names_each_kind_of_change(tmp_path, model_copy):
    out = tmp_path / "run"
    base = fingerprint(out, f"model_path={model_copy}")
    assert base == fingerprint(out, f"model_path={model_copy}")  # stable
    assert mismatch_message(base, base, out) is None

    temp = fingerprint(out, f"model_path={model_copy}", "temperature=0.5")
    assert_refusal(mismatch_message(base, temp, out), "sampling.temperature: 1.0 -> 0.5", str(out))

    n = fingerprint(out, f"model_path={model_copy}", "n=3")
    assert "n: 2 -> 3" in mismatch_message(base, n, out)
    loop = fingerprint(out, f"model_path={model_copy}", "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent")
    assert "agent.default_agent_loop" in mismatch_message(base, loop, out)
    fake = fingerprint(out, f"model_path={model_copy}", FAKE_ENGINE)
    assert 'generator: "model" -> "fake engine"' in mismatch_message(base, fake, out)
    # how a multi-trajectory sample's rows are scored and weighed (absent at their defaults: run keys unchanged)
    assert "rows" not in base and fingerprint(out, f"model_path={model_copy}", "rows.reward=own") == base
    rule = fingerprint(out, f"model_path={model_copy}", "rows.reward=final", "rows.loss_weight=one")
    assert "rows" in mismatch_message(base, rule, out) and rule["rows"] == {"reward": "final", "loss_weight": "one"}

    # another model folder with the very same files: the path names it
    other = tmp_path / "other-model"
    shutil.copytree(model_copy, other)
    moved = fingerprint(out, f"model_path={other}")
    msg = mismatch_message(base, moved, out)
    assert_refusal(msg, "model_path:", "other-model")
    assert "weights" not in msg  # identical files are not reported as changed

    # same path, same size, different weights (a re-trained checkpoint): the sampled digest catches it
    weights = next(p for p in model_copy.iterdir() if p.suffix == ".safetensors")
    size = weights.stat().st_size
    before = sampled_digest(weights)
    with open(weights, "r+b") as f:
        f.seek(size // 2)
        byte = f.read(1)
        f.seek(size // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert weights.stat().st_size == size and sampled_digest(weights) != before
    assert_refusal(mismatch_message(base, fingerprint(out, f"model_path={model_copy}"), out),
                   f"weights: {weights.name} changed")

    # the chat template (tokenizer_config.json) changed
    base = fingerprint(out, f"model_path={model_copy}")
    tok = model_copy / "tokenizer_config.json"
    config = orjson.loads(tok.read_bytes())
    config["chat_template"] = "{{ messages[0]['content'] }}"
    tok.write_bytes(orjson.dumps(config))
    assert_refusal(mismatch_message(base, fingerprint(out, f"model_path={model_copy}"), out),
                   "tokenizer.tokenizer_config.json: contents changed")


def test_launch_and_writer_refuse_a_changed_setup_and_accept_an_unchanged_one(tmp_path, model_copy):
    """One run: a relaunch with another temperature or model folder is refused and changes nothing, byte for
    byte; the writer restarted alone refuses a changed setup too; the same command finds the run complete; the
    explicit override is accepted."""
    out = tmp_path / "run"
    first = launch(out, f"model_path={model_copy}", *FAKE)
    assert first.returncode == 0, first.stderr[-3000:]
    before = directory_bytes(out)

    hotter = launch(out, f"model_path={model_copy}", *FAKE, "temperature=0.5")
    assert hotter.returncode == 2
    error = [ln for ln in hotter.stderr.splitlines() if ln.startswith("pipegen: error:")]
    assert len(error) == 1, hotter.stderr
    assert_refusal(error[0], "sampling.temperature: 1.0 -> 0.5")

    other = tmp_path / "other-model"
    shutil.copytree(model_copy, other)
    moved = launch(out, f"model_path={other}", *FAKE)
    assert moved.returncode == 2
    assert_refusal(moved.stderr.strip().splitlines()[-1], "model_path:", "other-model")

    assert directory_bytes(out) == before  # refusals touch nothing

    same = launch(out, f"model_path={model_copy}", *FAKE)
    assert same.returncode == 0, same.stderr[-3000:]
    assert "already complete" in same.stdout
    writer_refuses_a_changed_setup(out, model_copy)

    # the explicit override is accepted and becomes the run's new fingerprint
    forced = launch(out, f"model_path={model_copy}", *FAKE, "temperature=0.5", f"{OVERRIDE_KEY}=true")
    assert forced.returncode == 0, forced.stderr[-3000:]
    assert orjson.loads((out / "conf" / "fingerprint.json").read_bytes())["sampling"]["temperature"] == 0.5


def writer_refuses_a_changed_setup(out: Path, model_copy: Path) -> None:
    """The writer restarted alone on a complete run checks the setup as a launch does."""

    def writer() -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "pipegen.writer", f"output_dir={out}"], cwd=REPO,
                              capture_output=True, text=True, timeout=120)

    # the model's chat template was edited on disk after the run started
    tok = model_copy / "tokenizer_config.json"
    original = tok.read_bytes()
    config = orjson.loads(original)
    config["chat_template"] = "{{ messages[0]['content'] }}"
    tok.write_bytes(orjson.dumps(config))
    refused = writer()
    assert refused.returncode == 2, refused.stderr[-2000:]
    line = refused.stderr.strip().splitlines()[-1]
    assert line.startswith("pipegen.writer:")
    assert_refusal(line, "tokenizer.tokenizer_config.json: contents changed")

    # ... or the saved config was edited by hand
    tok.write_bytes(original)
    config_file = out / "conf" / "config.yaml"
    text = config_file.read_text()
    config_file.write_text(text.replace("temperature: 1.0", "temperature: 0.7"))
    refused = writer()
    assert refused.returncode == 2
    assert_refusal(refused.stderr.strip().splitlines()[-1], "sampling.temperature: 1.0 -> 0.7")

    # restored: the check the writer runs at start passes again (a real writer start on an unchanged
    # setup is what every launcher test does)
    config_file.write_text(text)
    from pipegen.run.layout import RunDir
    from pipegen.run.config import load_run_config

    assert check_fingerprint(load_run_config(RunDir(out)), RunDir(out)) is None


def test_check_fingerprint_passes_a_new_run_and_the_override(tmp_path, model_copy):
    from pipegen.run.layout import RunDir
    from pipegen.run.fingerprint import save_fingerprint

    out = tmp_path / "run"
    run = RunDir(out)
    cfg = composed(out, f"model_path={model_copy}")
    assert check_fingerprint(cfg, run) is None  # nothing stored yet
    run.conf.mkdir(parents=True)
    save_fingerprint(run.fingerprint_file, compute_fingerprint(composed(out, f"model_path={model_copy}", "n=4")))
    assert "n: 4 -> 2" in check_fingerprint(cfg, run)
    forced = composed(out, f"model_path={model_copy}", f"{OVERRIDE_KEY}=true")
    assert check_fingerprint(forced, run) is None


def test_a_larger_n_alone_adds_only_the_new_samples_and_any_other_n_change_is_refused(tmp_path, tiny_model):
    """n=1 -> 2 on a finished run generates sample 1 of each prompt and nothing else: the batch files it committed
    stay byte for byte, its rows are the same in the new output, and a prompt's two samples share its uid; the
    launch says so in one line. A smaller n, or a larger one beside another change, is refused even with
    resume_with_changes=true, and the run is left as it was."""
    out = tmp_path / "run"
    base = [f"model_path={tiny_model}", *[o for o in FAKE if not o.startswith("n=")]]
    first = launch(out, *base, "n=1")
    assert first.returncode == 0, first.stderr[-3000:]
    before = directory_bytes(out)
    refusals = {
        ("n=2", "temperature=0.5"): "pipegen: error: n=2 on a run made with n=1 adds samples only when nothing else "
                                    "changes, and this launch also changes sampling.temperature: 1.0 -> 0.5: keep the "
                                    "rest as the run has it to add samples here, or generate into a new output_dir",
    }
    for extra, line in refusals.items():
        for override in ([], [f"{OVERRIDE_KEY}=true"]):
            more = launch(out, *base, *extra, *override)
            assert more.returncode == 2, more.stdout[-2000:]
            assert more.stderr.strip().splitlines()[-1] == line, more.stderr[-2000:]
    assert directory_bytes(out) == before
    old = load_trajectories(out / "trajectories.pkl")
    old_batches = {name: digest for name, digest in before.items() if name.startswith("batch_")}

    grown = launch(out, *base, "n=2")
    assert grown.returncode == 0, grown.stderr[-3000:]
    assert ("pipegen: n=2 on a run made with n=1: generating only the new samples (sample 1 of each of its 6 "
            "prompts: 6 units); the units it committed, their seeds and their prompts' uids stay as they are"
            in grown.stdout.splitlines()), grown.stdout[-3000:]
    assert "pipegen: done: 12 samples" in grown.stdout and "this launch: 6 samples" in grown.stdout, grown.stdout
    after = directory_bytes(out)
    assert old_batches and all(after.get(name) == digest for name, digest in old_batches.items())
    new = load_trajectories(out / "trajectories.pkl")
    nt = new.non_tensor_batch
    units = sorted(zip(nt["index"].tolist(), nt["sample"].tolist()))
    assert units == sorted((int(i), s) for i in old.non_tensor_batch["index"] for s in (0, 1))
    first_rows = [r for r in range(len(new)) if nt["sample"][r] == 0]
    assert [int(nt["index"][r]) for r in first_rows] == old.non_tensor_batch["index"].tolist()
    assert new.batch["responses"][first_rows].equal(old.batch["responses"])
    assert [nt["uid"][r] for r in first_rows] == old.non_tensor_batch["uid"].tolist()
    uids = {}
    for index, uid in zip(nt["index"].tolist(), nt["uid"].tolist()):
        uids.setdefault(index, set()).add(uid)
    assert all(len(u) == 1 for u in uids.values()), uids

    # the run holds two samples per prompt now: fewer is refused, even with resume_with_changes=true
    settled = directory_bytes(out)
    for override in ([], [f"{OVERRIDE_KEY}=true"]):
        fewer = launch(out, *base, "n=1", *override)
        assert fewer.returncode == 2, fewer.stdout[-2000:]
        assert fewer.stderr.strip().splitlines()[-1] == (
            "pipegen: error: n=1 on a run made with n=2: a run keeps every sample it committed, so n cannot shrink; "
            "keep n=2 here, or generate n=1 into a new output_dir"), fewer.stderr[-2000:]
    assert directory_bytes(out) == settled

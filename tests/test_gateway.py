"""The gateway for agents written outside verl, through the real pipeline: harnesses written with the official
`openai` and `anthropic` SDKs (tests/gateway_harnesses.py) run as the `external` agent loop.

A fake SGLang-protocol server in script mode answers assistant turn k with SCRIPT[k] (two hermes calculator
tool calls, then "#### 5"), encoded with the tiny Qwen model's tokenizer; a recording proxy in front of it logs
what it was asked and what it answered, so every trajectory is checked against the engine's own ids and
log-probs. One run (`scenarios`) serves most tests: one row per scenario, the scenario named by the prompt's
last word. verl's log-prob recomputation is checked on the real tiny model (pipegen's CPU server) at T=0.7.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO, assert_verl_agrees, launch, load_trajectories, wait_for_lines
from fake_servers import FakeServer, RecordingProxy, read_records, write_dataset
# the scripted server (hermes calculator calls, then "#### 5") and the tokenizer, as the agent-loop tests use them
from test_agent_loops import SCRIPT, TOOL_BLOCK, scripted, tokenizer  # noqa: F401  (fixtures)

TOOL_ROUNDS = ["chat", "chat_stream", "responses", "responses_stream", "anthropic", "anthropic_stream"]
OTHERS = ["n2", "retry", "edit", "remember", "probe"]
ENV = {"PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}"}


def overrides(model: str, data: str, url: str, *extra: str) -> list[str]:
    return ["llm=external", f"llm.urls=[{url}]", f"model_path={model}", f"train_files={data}",
            "max_prompt_length=512", "max_response_length=160", "n=1", "max_samples=-1",
            "actor_rollout_ref.rollout.agent.default_agent_loop=external", *extra]


@pytest.fixture(scope="module")
def scenarios(tiny_model, scripted, tmp_path_factory):
    """One run: a row per scenario, the callable harness, the proxy's log of every engine request."""
    tmp = tmp_path_factory.mktemp("gateway_run")
    proxy = RecordingProxy("proxy", tmp, scripted.url).wait_ready()
    names = TOOL_ROUNDS + OTHERS
    data = write_dataset(tmp / "rows.parquet", [{"content": f"What is 2 + 3? {n}"} for n in names])
    out = tmp / "run"
    try:
        # the harness by its file, relative to the launcher's folder (REPO), as custom_reward_function.path takes one
        result = launch(out, *overrides(tiny_model, data, proxy.url,
                                        "external.harness=tests/gateway_harnesses.py:harness"),
                        env={"GATEWAY_TEST_DIR": str(tmp)})
        entries = proxy.entries()
    finally:
        proxy.stop()
    assert result.returncode == 0, result.stderr[-3000:]
    records = {names[r["index"]]: r for r in read_records(out)}
    assert sorted(records) == sorted(names) and not read_records(out, "failures")
    return records, entries, out


def calls_of(traj: dict, entries: list[dict]) -> list[dict]:
    """The engine requests that built this trajectory, in order: each one's input is the trajectory so far."""
    full = traj["prompt_ids"] + traj["response_ids"]
    mine = [e for e in entries if full[:len(e["input_ids"])] == e["input_ids"]
            and full[len(e["input_ids"]):len(e["input_ids"]) + len(e["output_ids"])] == e["output_ids"]]
    return sorted(mine, key=lambda e: len(e["input_ids"]))


def test_every_dialect_streaming_or_not_records_the_engines_ids_token_exact(scenarios, tokenizer):
    records, entries, out = scenarios
    for name in TOOL_ROUNDS:
        (traj,) = records[name]["trajectories"]  # one unbroken conversation: one sequence
        assert traj["extra_fields"]["gateway"]["branch"] == "first call"
        assert records[name]["trajectories"][0]["extra_fields"]["harness_result"]["turns"] == 3
        calls = calls_of(traj, entries)
        assert len(calls) == 3, name  # one engine request per assistant turn, two tool rounds
        prompt, resp, mask, lps = (traj["prompt_ids"], traj["response_ids"], traj["response_mask"],
                                   traj["response_logprobs"])
        assert tokenizer.decode(prompt).count("calculator") >= 1  # the tools are rendered by the model's template
        pos = 0
        for k, call in enumerate(calls):
            assert call["input_ids"] == prompt + resp[:pos]
            out_ids = call["output_ids"]
            assert resp[pos:pos + len(out_ids)] == out_ids and mask[pos:pos + len(out_ids)] == [1] * len(out_ids)
            assert np.array_equal(np.float32(lps[pos:pos + len(out_ids)]), np.float32(call["logprobs"]))
            assert tokenizer.decode(out_ids, skip_special_tokens=True) == SCRIPT[k]
            pos += len(out_ids)
            if k + 1 < len(calls):
                between = calls[k + 1]["input_ids"][len(call["input_ids"]) + len(out_ids):]
                assert resp[pos:pos + len(between)] == between and mask[pos:pos + len(between)] == [0] * len(between)
                assert lps[pos:pos + len(between)] == [0.0] * len(between)
                assert tokenizer.decode(between) == TOOL_BLOCK  # the SDK's tool result, rendered once, mask 0
                pos += len(between)
        assert pos == len(resp)

    data = load_trajectories(out / "trajectories.pkl")
    index = list(data.non_tensor_batch["index"])
    for name in TOOL_ROUNDS:
        (row,) = [i for i, x in enumerate(index) if x == (TOOL_ROUNDS + OTHERS).index(name)]
        n = int(data.batch["response_mask"][row].sum())
        assert n == sum(records[name]["trajectories"][0]["response_mask"])
        assert data.batch["rm_scores"][row].sum().item() == 1.0  # "#### 5": the task's reward, scored as usual


def test_the_closing_summary_names_the_harness_as_the_reward(scenarios):
    """A harness's own reward is the one used (the run's scores only what it leaves unscored): the summary says so,
    and the server line names the engine that answered, not its protocol alone."""
    from pipegen.observe.console import reward_name
    from pipegen.run.config import load_run_config
    from pipegen.run.layout import RunDir

    _, _, out = scenarios
    assert reward_name(load_run_config(RunDir(out))) == ("what external.harness=" + str(REPO / "tests" / "gateway_harnesses.py")
                                        + ":harness returns; for a unit it returns no reward for, verl's "
                                        "default_compute_score by data_source (rows without one, or a code "
                                        "data_source, stay unscored)")
    assert "external server ready at" in (out / "logs" / "launch.log").read_text()


def test_sdk_retry_gives_one_sample(scenarios):
    records, entries, _ = scenarios
    (traj,) = records["retry"]["trajectories"]
    assert traj["extra_fields"]["gateway"]["retries_answered"] == 1
    assert len(calls_of(traj, entries)) == 1
    assert len([e for e in entries if e["input_ids"] == traj["prompt_ids"]]) == 1  # the engine was asked once


def test_n_choices_are_trajectories_of_the_unit(scenarios):
    records, entries, _ = scenarios
    first, second = records["n2"]["trajectories"]
    assert first["prompt_ids"] == second["prompt_ids"]
    assert second["extra_fields"]["gateway"]["branch"] == "choice 1 of a call with n=2"
    assert len([e for e in entries if e["input_ids"] == first["prompt_ids"]]) == 2


def test_edited_history_is_a_branch_not_a_splice(scenarios, tokenizer):
    records, entries, _ = scenarios
    first, second = records["edit"]["trajectories"]
    assert first["extra_fields"]["gateway"]["calls"] == 1 and second["extra_fields"]["gateway"]["calls"] == 1
    assert second["extra_fields"]["gateway"]["branch"].startswith("history edited: message 1 (assistant)")
    # the branch is the edited conversation rendered afresh: its prompt holds the harness's edit, and neither
    # trajectory holds the other's sampled tokens
    branch_prompt = tokenizer.decode(second["prompt_ids"])
    assert '"expression": "1 + 4"' in branch_prompt and '"expression": "2 + 3"' not in branch_prompt
    assert len(first["response_ids"]) == sum(first["response_mask"])  # one reply, nothing appended to it
    assert len(calls_of(first, entries)) == 1 and len(calls_of(second, entries)) == 1


def test_other_sessions_wrong_keys_and_finished_units_are_refused(scenarios):
    records, entries, _ = scenarios
    (probe,) = records["probe"]["trajectories"]
    assert probe["extra_fields"]["harness_result"] == {"finished": 404, "wrong_key": 401, "unknown": 404}
    (remembered,) = records["remember"]["trajectories"]
    assert remembered["extra_fields"]["gateway"]["calls"] == 1  # the refused call changed nothing
    # nothing refused reached the engine: every request it got continues a recorded trajectory's prompt
    prompts = [t["prompt_ids"] for r in records.values() for t in r["trajectories"]]
    assert all(any(e["input_ids"][:len(p)] == p for p in prompts) for e in entries)


def test_atif_export_holds_each_rows_steps_token_ids_and_log_probs(scenarios):
    """`python -m pipegen.export DIR --format atif` on the scenarios' run: every document passes the `atif`
    package's models, its agent steps' completion ids and log-probs are the row's model tokens in
    trajectories.pkl, the openai SDK's tool rounds are three agent steps with their calls and results, and an
    edited history's earlier reply is copied context."""
    from atif import Trajectory

    from pipegen.export.__main__ import main as export_main

    records, _, out = scenarios
    assert export_main([str(out), "--format", "atif"]) == 0
    data = load_trajectories(out / "trajectories.pkl")
    b, nt = data.batch, data.non_tensor_batch
    width = b["prompts"].shape[1]
    docs = {}
    for i in range(len(data)):
        key = "-".join(str(int(nt[k][i])) for k in ("index", "sample", "trajectory"))
        doc = json.loads((out / "trajectories.atif" / f"{key}.json").read_text())
        Trajectory.model_validate(doc)
        attn = b["attention_mask"][i].bool()
        response, mask = b["responses"][i][attn[width:]], b["response_mask"][i][attn[width:]].bool()
        sampled = [st["metrics"] for st in doc["steps"] if "metrics" in st]
        assert all(st["source"] == "agent" for st in doc["steps"] if "metrics" in st)
        assert sum((m["completion_token_ids"] for m in sampled), []) == response[mask].tolist(), key
        logprobs = np.float32(sum((m["logprobs"] for m in sampled), []))
        assert np.array_equal(logprobs, b["rollout_log_probs"][i][attn[width:]][mask].numpy()), key
        assert sampled[0]["prompt_token_ids"] == b["prompts"][i][attn[:width]].tolist()
        docs[((TOOL_ROUNDS + OTHERS)[int(nt["index"][i])], int(nt["trajectory"][i]))] = doc
    assert len(list((out / "trajectories.atif").glob("*.json"))) == len(data)

    chat = docs[("chat", 0)]["steps"]  # the openai SDK with a tool: 3 turns
    agent = [st for st in chat if st["source"] == "agent"]
    assert [st["source"] for st in chat[:1]] == ["user"] and len(agent) == 3
    assert all(not st.get("is_copied_context") for st in agent)
    for st in agent[:2]:
        (call,) = st["tool_calls"]
        assert call["function_name"] == "calculator" and "expression" in call["arguments"]
        (result,) = st["observation"]["results"]
        assert result == {"source_call_id": call["tool_call_id"], "content": "5"}
    assert "#### 5" in agent[2]["message"] and "tool_calls" not in agent[2]
    edited = docs[("edit", 1)]  # the branch rendered afresh: the reply the harness edited was not sampled in it
    copied = [st for st in edited["steps"] if st.get("is_copied_context")]
    assert copied and all("metrics" not in st and st["source"] == "agent" for st in copied)
    assert edited["extra"]["branch"].startswith("history edited")
    assert not any(st.get("is_copied_context") for st in docs[("n2", 1)]["steps"])


def test_command_harness_results_and_failures(tiny_model, scripted, tmp_path):
    """external.command: rewards from the last stdout line; a crash, a hang past external.timeout_s and a
    harness that never calls each send their unit to the failures stream with the reason."""
    names = ["openai_env", "anthropic_env", "crash", "hang", "silent", "required"]
    data = write_dataset(tmp_path / "rows.parquet", [{"content": f"What is 2 + 3? {n}"} for n in names])
    out = tmp_path / "run"
    result = launch(out, *overrides(tiny_model, data, scripted.url,
                                    f"external.command='{sys.executable} tests/gateway_harnesses.py'",
                                    "external.timeout_s=20"), env=ENV)
    assert result.returncode == 1 and "partial output: 2 of 6 samples" in result.stderr, result.stderr[-3000:]
    assert "4 unit(s) failed" in result.stderr
    good = {names[r["index"]]: r for r in read_records(out)}
    assert sorted(good) == ["anthropic_env", "openai_env"]
    assert good["openai_env"]["trajectories"][0]["reward_score"] == 0.5
    assert good["openai_env"]["trajectories"][0]["extra_fields"]["harness_result"] == {"via": "openai"}
    assert good["anthropic_env"]["trajectories"][0]["reward_score"] == 0.25
    # the report (and the dataset card from it) names the harness as what scored those rows, not verl's scorer
    from pipegen.report.numbers import report_numbers
    from pipegen.run.layout import RunDir

    assert report_numbers(RunDir(out))[0]["scored_by"] == {"what external.command returned (at generation)": 2}
    reasons = {names[f["index"]]: f["reason"] for f in read_records(out, "failures")}
    assert set(reasons) == {"crash", "hang", "silent", "required"}
    assert "exited with status 3" in reasons["crash"] and "about to fail" in reasons["crash"]
    assert "ran past external.timeout_s=20" in reasons["hang"]
    # the true reasons: a command's stderr tail whatever its exit code, and the gateway's last refusal
    assert "without calling the gateway" in reasons["silent"] and "no model configured" in reasons["silent"]
    assert "gateway's last refusal: HTTP 400" in reasons["required"] and "tool_choice" in reasons["required"]
    assert "tool_choice='auto'" in reasons["required"]  # the workaround named (smolagents' is one argument)


def test_multi_turn_log_probs_agree_with_verls_recomputation(tiny_model, tmp_path):
    """The real tiny model on pipegen's CPU server at T=0.7: answer, feedback, answer again is one sequence
    (model tokens mask 1, the feedback turn mask 0) whose log-probs verl's actor recomputes."""
    data = write_dataset(tmp_path / "rows.parquet", [{"content": f"What is {k} + 3? feedback"} for k in range(2)])
    out = tmp_path / "run"
    result = launch(out, f"model_path={tiny_model}", f"train_files={data}", "max_prompt_length=128",
                    "max_response_length=64", "n=2", "max_samples=-1", "temperature=0.7", "llm.dtype=float32",
                    "actor_rollout_ref.rollout.agent.default_agent_loop=external",
                    "external.harness=gateway_harnesses:harness", env=ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    for rec in read_records(out):
        (traj,) = rec["trajectories"]
        mask = traj["response_mask"]
        runs = [v for i, v in enumerate(mask) if i == 0 or mask[i - 1] != v]
        assert runs == [1, 0, 1]
    data = load_trajectories(out / "trajectories.pkl")
    assert data.meta_info["temperature"] == 0.7
    assert_verl_agrees(data, tiny_model, 0.7)


def test_actor_sigkill_mid_session_then_the_same_command_gives_every_unit_once(tiny_model, tmp_path):
    from conftest import assert_verified
    from test_actor_faults import find_actor_pid

    (tmp_path / "script.json").write_text(json.dumps(SCRIPT))
    server = FakeServer("slow", tmp_path, tiny_model, "--script", str(tmp_path / "script.json"),
                        "--token-latency", "0.02").wait_ready()
    names = ["chat", "anthropic", "responses"] * 4
    data = write_dataset(tmp_path / "rows.parquet", [{"content": f"What is 2 + 3? {n}"} for n in names])
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "pipegen.launch", f"output_dir={out}",
           *overrides(tiny_model, data, server.url, "external.harness=gateway_harnesses:harness",
                      "generation.save_batch_size=1000")]
    launcher = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, **ENV})
    try:
        wait_for_lines(launcher, out / "streams" / "rollouts" / "actor_0" / "000000.jsonl", 2, 180)
        os.kill(find_actor_pid(out), signal.SIGKILL)  # sessions are in flight: units are mid-conversation
        launcher.kill()  # ... and the whole launch goes with it
        launcher.wait()
        again = launch(out, *cmd[4:], env=ENV)  # the same command again
    finally:
        if launcher.poll() is None:
            launcher.kill()
        server.stop()
    assert again.returncode == 0, again.stderr[-3000:]
    assert_verified(out)
    data = load_trajectories(out / "trajectories.pkl")
    units = sorted(int(i) for i in data.non_tensor_batch["index"])
    assert units == list(range(len(names)))  # every unit exactly once
    assert all(g["calls"] == 3 and g["branch"] == "first call" for g in data.non_tensor_batch["gateway"])
    # the killed sessions' recorded calls were answered from their units' records (pipegen/actor/continuation.py),
    # and their rows are the rows of uninterrupted sessions of the same dialect (the script answers alike)
    nt = data.non_tensor_batch
    replayed = [int(r) for r in nt.get("replayed_calls", [None] * len(units)) if r]
    assert replayed and all(1 <= r <= 2 for r in replayed)
    responses: dict[str, set] = {}
    for i, index in enumerate(nt["index"]):
        n = int(data.batch["attention_mask"][i, data.batch["prompts"].shape[1]:].sum())
        responses.setdefault(names[int(index)], set()).add(tuple(data.batch["responses"][i, :n].tolist()))
    assert all(len(r) == 1 for r in responses.values())


def test_framework_example_calls_its_tool_through_the_gateway(tiny_model, scripted, tmp_path, tokenizer):
    """pipegen/examples/agents_calculator.py (the OpenAI Agents SDK, unchanged) on the tiny Qwen-style model
    whose scripted replies are hermes tool calls: the agent runs its calculator tool twice, then answers."""
    data = write_dataset(tmp_path / "rows.parquet", [{"content": "What is 2 + 3?"}])
    out = tmp_path / "run"
    result = launch(out, *overrides(tiny_model, data, scripted.url,
                                    "external.harness=pipegen.examples.agents_calculator:harness"))
    assert result.returncode == 0, result.stderr[-3000:]
    (rec,) = read_records(out)
    (traj,) = rec["trajectories"]
    assert traj["extra_fields"]["gateway"]["calls"] == 3 and traj["reward_score"] == 1.0
    response = tokenizer.decode(traj["response_ids"])
    assert response.count("<tool_response>\n5\n</tool_response>") == 2  # the framework ran the tool: 2 + 3, 20 // 4
    assert "calculator" in tokenizer.decode(traj["prompt_ids"])  # the tool's schema, rendered by the template


def test_a_harness_whose_sdk_is_missing_fails_in_one_line_naming_the_extra(monkeypatch):
    """The SDKs are the `examples` extra, not pipegen's dependencies: without one, the example harness that imports
    it fails its unit in one line saying how to install it (a module missing for another reason stays itself)."""
    from pipegen.gateway.harness import Harness, HarnessFailed

    monkeypatch.setitem(sys.modules, "openai", None)  # as if the openai SDK were not installed
    monkeypatch.delitem(sys.modules, "pipegen.examples.answer_check_retry", raising=False)
    with pytest.raises(HarnessFailed) as failed:
        Harness("pipegen.examples.answer_check_retry:harness", None, 10.0).callable()
    assert str(failed.value) == ("external.harness=pipegen.examples.answer_check_retry:harness: needs the openai SDK, "
                                 "which is not installed: pip install '.[examples]' in pipegen's checkout")
    with pytest.raises(ModuleNotFoundError):
        Harness("pipegen_no_such_module:harness", None, 10.0).callable()


def test_a_harness_module_in_the_current_folder_is_found_as_python_c_finds_it(tmp_path, monkeypatch):
    """`external.harness=my_agent:harness` with my_agent.py in the current folder: the installed `pipegen` command
    has its own folder, not the current one, on sys.path; the harness is found as `python -c 'import my_agent'`
    finds it, loaded once (its top-level code runs once), and a file path works from any folder."""
    from pipegen.gateway.harness import Harness, absolute_target

    agent = tmp_path / "pipegen_cwd_agent.py"
    agent.write_text("import os\nLOADS = int(os.environ.get('LOADS', '0')) + 1\nos.environ['LOADS'] = str(LOADS)\n"
                     "def harness(row, base_url, api_key):\n    return 0.5\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delenv("LOADS", raising=False)
    fn = Harness("pipegen_cwd_agent:harness", None, 10.0).callable()
    assert fn({}, "", "") == 0.5 and Harness("pipegen_cwd_agent:harness", None, 10.0).callable() is fn
    assert os.environ["LOADS"] == "1"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    target = absolute_target("pipegen_cwd_agent.py:harness")  # made absolute from the launcher's folder
    assert target == f"{agent}:harness"
    monkeypatch.chdir(elsewhere)
    assert Harness(target, None, 10.0).callable()({}, "", "") == 0.5
    with pytest.raises(ValueError, match=r"no such file; give the \.py file holding harness"):
        absolute_target("missing_agent.py:harness")

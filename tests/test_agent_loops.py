"""Agent loops through the real pipeline: verl's tool loop with pipegen's calculator, token exactness,
scoring, and a user-registered multi-trajectory loop.

A fake SGLang-protocol server in script mode answers assistant turn k with SCRIPT[k] (two calculator
tool calls, then a final "#### 5"), encoded with the tiny Qwen model's tokenizer, so verl's hermes parser,
ToolAgentLoop and the Qwen continuous-token builder run for real. The launcher attaches to it with
`llm=external`; a recording proxy in front of it logs what the server was asked and what it answered.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from pathlib import Path

import numpy as np
import orjson
import pytest
import torch

from conftest import load_trajectories
from fake_servers import REPO, FakeServer, RecordingProxy, launch_external, read_records, write_dataset

SCRIPT = [
    'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n</tool_call>',
    'Check it.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "20 // 4"}}\n</tool_call>',
    "The answer is #### 5",
]
# what the Qwen template puts between two assistant turns for a tool result "5" (none of it is the model's)
TOOL_BLOCK = "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
TOOLS_YAML = str(REPO / "conf" / "tools" / "calculator.yaml")
QUESTIONS = ["What is 2 + 3?", "Tom has 20 apples and 4 friends. How many each?", "Compute five."]

BASE = [
    "max_prompt_length=512",  # the calculator's schema sits in the system prompt (~370 tokens)
    "max_response_length=160",
    "actors.concurrency=8",
    "actors.stats_interval_s=0.5",
    "generation.save_batch_size=4",
    "generation.partial_batch_quiet_s=0.3",
    "max_samples=-1",
    "llm.request_timeout_s=30",
]


def tool_overrides(tiny_model: str, data: str, *extra: str) -> list[str]:
    return [f"model_path={tiny_model}", f"train_files={data}", *BASE,
            "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent",
            f"actor_rollout_ref.rollout.multi_turn.tool_config_path={TOOLS_YAML}", *extra]


@pytest.fixture(scope="module")
def scripted(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("scripted")
    script = tmp / "script.json"
    script.write_text(json.dumps(SCRIPT))
    server = FakeServer("scripted", tmp, tiny_model, "--script", str(script), "--slots", "16")
    try:
        yield server.wait_ready()
    finally:
        server.stop()


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def runs(mask) -> list[tuple[int, int]]:
    """(value, length) of each maximal run."""
    return [(int(k), len(list(g))) for k, g in itertools.groupby(mask)]


def valid_response(data, i: int):
    P = data.batch["prompts"].shape[1]
    n = int(data.batch["attention_mask"][i, P:].sum())
    return (data.batch["responses"][i, :n], data.batch["response_mask"][i, :n],
            data.batch["rollout_log_probs"][i, :n], n)


# ---------------------------------------------------------------------------------------------- calculator


def test_calculator_evaluates_arithmetic_safely():
    from pipegen.tools.calculator import CalculatorError, evaluate, format_number

    assert evaluate("2 + 3") == 5
    assert evaluate("12 * (3 + 4)") == 84
    assert evaluate("7 / 2") == 3.5
    assert evaluate("-3 // 2") == -2 and evaluate("7 % 4") == 3
    assert evaluate("2 ** 10") == 1024 and evaluate("2^3") == 8
    assert evaluate("max(1, 2, 3) + min(4, 5) + abs(-2) + round(2.567, 2)") == pytest.approx(11.57)
    assert evaluate("sqrt(16)") == 4.0
    assert format_number(evaluate("10 / 2")) == "5" and format_number(evaluate("1 / 3")) == "0.333333333333"
    for bad in ["__import__('os').system('true')", "open('x')", "a", "(1).real", "[1, 2]", "'x' * 3", "True + 1",
                "lambda: 1", "9 ** 9 ** 9", "10 ** 30", "1 / 0", "sqrt(-1)", "1e308 * 10", "", "x = 1", "f(1)",
                "1" * 300, "max()", "round(1.5, 99)"]:
        with pytest.raises(CalculatorError):
            evaluate(bad)


def test_calculator_is_a_verl_tool_loaded_from_the_shipped_config():
    from verl.tools.base_tool import BaseTool
    from verl.tools.tool_registry import load_all_tools

    from pipegen.actor.rollout import resolve_user_path

    # the shipped config resolves from any working directory
    assert Path(resolve_user_path("conf/tools/calculator.yaml")) == Path(TOOLS_YAML)
    (tool,) = load_all_tools(TOOLS_YAML, None)
    assert isinstance(tool, BaseTool) and tool.name == "calculator"
    assert tool.tool_schema.function.parameters.required == ["expression"]

    async def use():
        iid, _ = await tool.create(create_kwargs={})
        ok = await tool.execute(iid, {"expression": "6 * 7"})
        bad = await tool.execute(iid, {"expression": "__import__('os')"})
        missing = await tool.execute(iid, {})
        await tool.release(iid)
        return ok, bad, missing

    ok, bad, missing = asyncio.run(use())
    assert ok[0].text == "42" and ok[1] == 0.0
    assert bad[0].text.startswith("Error: only these functions") and missing[0].text.startswith("Error: missing")


# ---------------------------------------------------------------------------------- actor-side unit checks


def test_a_trajectory_is_recorded_as_pydantic_would_dump_it():
    """The record's trajectory JSON (which skips pydantic's per-element copy of plain token lists) is
    byte for byte what `model_dump(mode="json")` gives, with and without log-probs, empty, and with
    nested extra fields; a loop that left an array where a list belongs fails as it did before."""
    import orjson
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput

    from pipegen.actor.rollout import trajectory_json

    metrics = AgentLoopMetrics(generate_sequences=0.5, tool_calls=0.0)
    outputs = [
        AgentLoopOutput(prompt_ids=[1, 2], response_ids=[3, 4], response_mask=[1, 0], response_logprobs=[-0.1, -2.5],
                        num_turns=2, reward_score=1.0, metrics=metrics, extra_fields={"a": [1, 2], "t": {"x": 1.5}}),
        AgentLoopOutput(prompt_ids=[1, 2], response_ids=[3, 4], response_mask=[1, 1], num_turns=1, metrics=metrics),
        AgentLoopOutput(prompt_ids=[1], response_ids=[], response_mask=[], response_logprobs=[], num_turns=1,
                        metrics=metrics),
    ]
    for out in outputs:
        expected = out.model_dump(mode="json")
        if expected["response_logprobs"] is not None:
            expected["response_logprobs"] = np.asarray(expected["response_logprobs"], dtype=np.float32)
        option = orjson.OPT_SERIALIZE_NUMPY
        assert orjson.dumps(trajectory_json(out), option=option) == orjson.dumps(expected, option=option)
    odd = outputs[0].model_copy()
    odd.response_ids = np.array([3, 4])
    with pytest.raises(Exception, match="numpy"):
        trajectory_json(odd)


def test_yaml_registration_and_output_checks(tmp_path):
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput

    from pipegen.verl_private import agent_loop_registry

    from pipegen.actor.rollout import InvalidTrajectory, check_trajectories, register_agent_loops

    cfg = tmp_path / "loops.yaml"
    cfg.write_text("- name: my_snapshots\n  _target_: pipegen.agent_loops.snapshot.ContextSnapshotAgentLoop\n"
                   "  snapshot_every: 2\n")
    register_agent_loops(str(cfg))
    assert agent_loop_registry()["my_snapshots"]["snapshot_every"] == 2
    register_agent_loops("conf/agent_loops/examples.yaml")  # shipped example, relative to pipegen's folder
    assert "context_snapshot_agent" in agent_loop_registry()
    (tmp_path / "bad.yaml").write_text("- name: nothing_to_build\n")
    with pytest.raises(ValueError, match="_target_"):
        register_agent_loops(str(tmp_path / "bad.yaml"))

    def out(**kw):
        base = dict(prompt_ids=[1, 2], response_ids=[3, 4], response_mask=[1, 0], response_logprobs=[-0.5, 0.0],
                    metrics=AgentLoopMetrics())
        return AgentLoopOutput(**{**base, **kw})

    assert len(check_trajectories(out(), 8, 8)) == 1
    assert len(check_trajectories([out(), out()], 8, 8)) == 2
    for bad in ([], [out(response_mask=[1])], out(response_logprobs=[0.0]), out(prompt_ids=list(range(9))),
                out(response_ids=list(range(9)), response_mask=[1] * 9, response_logprobs=None),
                out(response_mask=[1, 2]), out(prompt_ids=[]), ["not a trajectory"]):
        with pytest.raises(InvalidTrajectory):
            check_trajectories(bad, 8, 8)


# ------------------------------------------------------------------------------------ pipeline scenarios


def test_tool_trajectory_equals_verl_tool_agent_loop(tmp_path, tiny_model, scripted, tokenizer):
    """3 assistant turns, 2 calculator calls: prompt/response split, masks, logprobs, and verl parity."""
    from test_verl_parity import _plain, _verl_reference

    from pipegen.run.layout import RunDir
    from pipegen.run.config import load_run_config

    data = write_dataset(tmp_path / "tool.parquet", [{"content": q} for q in QUESTIONS])
    out = tmp_path / "run"
    result = launch_external(out, [scripted.url], *tool_overrides(tiny_model, data, "n=2", "actors.per_unit_seed=false",
                                                                   "actors.scoring=false"))
    assert result.returncode == 0, result.stderr[-3000:]
    ours = load_trajectories(out / "trajectories.pkl")
    assert len(ours) == len(QUESTIONS) * 2

    from verl.utils.tokenizer import normalize_token_ids

    from pipegen.tools.calculator import DEFAULT_SCHEMA

    P = ours.batch["prompts"].shape[1]
    for i in range(len(ours)):
        # prompt: exactly the chat template of the row's messages with the calculator schema
        raw = list(ours.non_tensor_batch["raw_prompt"][i])
        want_prompt = normalize_token_ids(tokenizer.apply_chat_template(raw, tools=[DEFAULT_SCHEMA],
                                                                        add_generation_prompt=True, tokenize=True))
        prompt = ours.batch["prompts"][i][ours.batch["attention_mask"][i, :P] == 1].tolist()
        assert prompt == want_prompt
        resp, mask, lp, n = valid_response(ours, i)
        # model, tool, model, tool, model
        assert [v for v, _ in runs(mask.tolist())] == [1, 0, 1, 0, 1]
        pieces, start = [], 0
        for value, length in runs(mask.tolist()):
            pieces.append((value, tokenizer.decode(resp[start:start + length].tolist(), skip_special_tokens=False)))
            start += length
        model_text = [t for v, t in pieces if v == 1]
        assert model_text == [s + "<|im_end|>" for s in SCRIPT]  # every model token, and only those, has mask 1
        assert [t for v, t in pieces if v == 0] == [TOOL_BLOCK, TOOL_BLOCK]
        # logprobs only on model tokens (the fake engine's logprobs are never 0.0)
        assert (lp[mask == 1] != 0).all() and (lp[mask == 0] == 0).all()
        assert (ours.batch["rollout_log_probs"][i, n:] == 0).all() and (ours.batch["response_mask"][i, n:] == 0).all()
        assert ours.non_tensor_batch["__num_turns__"][i] == 6  # verl counts user (2: tool results) + assistant (3) turns + 1
        assert list(ours.non_tensor_batch["tool_rewards"][i]) == [0.0, 0.0]

    # verl's own AgentLoopWorker + ToolAgentLoop against the same scripted server
    cfg = load_run_config(RunDir(out))
    uids = {int(i): u for i, u in zip(ours.non_tensor_batch["index"], ours.non_tensor_batch["uid"])}
    theirs = _verl_reference(cfg, scripted.url, uids)
    assert len(theirs) == len(ours)
    assert set(ours.batch.keys()) == set(theirs.batch.keys())
    for key in theirs.batch.keys():
        a, b = ours.batch[key], theirs.batch[key]
        assert a.dtype == b.dtype and a.shape == b.shape, key
        assert torch.equal(a, b), key
    assert set(ours.non_tensor_batch) - set(theirs.non_tensor_batch) == {"sample", "trajectory", "seed"}
    for key, values in theirs.non_tensor_batch.items():
        assert [_plain(x) for x in ours.non_tensor_batch[key]] == [_plain(x) for x in values], key


def test_multi_turn_records_are_token_exact_and_scored(tmp_path, tiny_model, scripted, tokenizer):
    """Every record's response = the server's outputs interleaved with tool tokens; rm_scores = verl's score."""
    from verl.utils.reward_score import default_compute_score

    from pipegen.run.stream import unit_seed

    proxy = RecordingProxy("proxy", tmp_path, scripted.url)
    try:
        proxy.wait_ready()
        data = write_dataset(tmp_path / "scored.parquet", [{"content": "What is 2 + 3?", "ground_truth": "5"},
                                                           {"content": "What is 3 + 4?", "ground_truth": "7"}])
        out = tmp_path / "run"
        result = launch_external(out, [proxy.url], *tool_overrides(tiny_model, data, "n=2", "seed=11"))
        assert result.returncode == 0, result.stderr[-3000:]
        entries = proxy.entries()
    finally:
        proxy.stop()

    records = read_records(out)
    assert sorted((r["index"], r["sample"]) for r in records) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    by_seed: dict[int, list[dict]] = {}
    for e in entries:
        by_seed.setdefault(e["seed"], []).append(e)
    assert all(e["status"] == 200 for e in entries)
    seeds = set()
    for rec in records:
        assert rec["seed"] == unit_seed(11, rec["index"], rec["sample"])
        seeds.add(rec["seed"])
        (traj,) = rec["trajectories"]
        calls = sorted(by_seed[rec["seed"]], key=lambda e: e["t"])
        assert len(calls) == 3  # one request per assistant turn, nothing re-sent
        prompt, resp, mask, lps = traj["prompt_ids"], traj["response_ids"], traj["response_mask"], traj["response_logprobs"]
        pos = 0
        for k, call in enumerate(calls):
            # the context sent for turn k is exactly the record's prompt + response so far ...
            assert call["input_ids"] == prompt + resp[:pos]
            out_ids = call["output_ids"]
            # ... and the server's output ids follow verbatim, with its logprobs, as model tokens
            assert resp[pos:pos + len(out_ids)] == out_ids
            assert mask[pos:pos + len(out_ids)] == [1] * len(out_ids)
            assert np.array_equal(np.float32(lps[pos:pos + len(out_ids)]), np.float32(call["logprobs"]))
            pos += len(out_ids)
            if k + 1 < len(calls):
                # between two outputs: exactly the tokens the next request adds (tool response), mask 0, logprob 0
                nxt = calls[k + 1]["input_ids"][len(call["input_ids"]) + len(out_ids):]
                assert resp[pos:pos + len(nxt)] == nxt and mask[pos:pos + len(nxt)] == [0] * len(nxt)
                assert lps[pos:pos + len(nxt)] == [0.0] * len(nxt)
                assert tokenizer.decode(nxt) == TOOL_BLOCK
                pos += len(nxt)
        assert pos == len(resp)
    assert len(seeds) == 4  # distinct per (index, sample)
    assert {e["seed"] for e in entries} == seeds

    # scoring: verl's default_compute_score on the decoded valid response, at the last valid token
    data_proto = load_trajectories(out / "trajectories.pkl")
    assert "rm_scores" in data_proto.batch.keys()
    got = {}
    for i in range(len(data_proto)):
        resp, _, _, n = valid_response(data_proto, i)
        gt = data_proto.non_tensor_batch["reward_model"][i]["ground_truth"]
        want = default_compute_score("openai/gsm8k", tokenizer.decode(resp.tolist(), skip_special_tokens=True), gt)
        row_scores = data_proto.batch["rm_scores"][i]
        assert row_scores[n - 1].item() == want and row_scores.abs().sum().item() == abs(want)
        got[(int(data_proto.non_tensor_batch["index"][i]), int(data_proto.non_tensor_batch["sample"][i]))] = want
    assert got == {(0, 0): 1.0, (0, 1): 1.0, (1, 0): 0.0, (1, 1): 0.0}  # "#### 5" is right for 5, wrong for 7

    # ATIF: verl's tool loop keeps no messages, so each run of model tokens is an agent step and the tool tokens
    # between two runs are the observation of the step before them, decoded
    from atif import Trajectory

    from pipegen.export.__main__ import main as export_main

    assert export_main([str(out), "--format", "atif"]) == 0
    for rec in records:
        doc = orjson.loads((out / "trajectories.atif" / f"{rec['index']}-{rec['sample']}-0.json").read_bytes())
        Trajectory.model_validate(doc)
        (traj,) = rec["trajectories"]
        agent = [st for st in doc["steps"] if st["source"] == "agent"]
        assert len(agent) == 3 and doc["extra"]["reward"] == got[(rec["index"], rec["sample"])]
        ids = [i for i, m in zip(traj["response_ids"], traj["response_mask"]) if m]
        assert sum((st["metrics"]["completion_token_ids"] for st in agent), []) == ids
        assert [st["observation"]["results"][0]["content"] for st in agent[:2]] == [TOOL_BLOCK] * 2
        assert "observation" not in agent[2]


def test_multi_trajectory_loop_registered_through_agent_loop_config_path(tmp_path, tiny_model, scripted):
    """A user loop from conf/agent_loops/examples.yaml returns one trajectory per context snapshot: one
    record per unit, one row per trajectory numbered by `trajectory`, beside tool and single-turn rows."""
    data = write_dataset(tmp_path / "mixed.parquet", [
        {"content": "What is 2 + 3?", "agent_name": "context_snapshot_agent"},
        {"content": "What is 2 + 3?", "agent_name": "tool_agent"},  # same prompt: same server outputs
        {"content": "Say hi.", "agent_name": "single_turn_agent"},
    ])
    out = tmp_path / "run"
    result = launch_external(out, [scripted.url], *tool_overrides(
        tiny_model, data, "n=2", "actors.per_unit_seed=false",
        "actor_rollout_ref.rollout.agent.agent_loop_config_path=conf/agent_loops/examples.yaml",
        "actor_rollout_ref.rollout.multi_turn.tool_config_path=conf/tools/calculator.yaml"))
    assert result.returncode == 0, result.stderr[-3000:]

    records = {(r["index"], r["sample"]): r for r in read_records(out)}
    assert len(records) == 6  # one record per unit, all of a unit's trajectories in it
    assert [len(records[(i, 0)]["trajectories"]) for i in range(3)] == [3, 1, 1]

    d = load_trajectories(out / "trajectories.pkl")
    nt = d.non_tensor_batch
    keys = [(int(i), int(s), int(t)) for i, s, t in zip(nt["index"], nt["sample"], nt["trajectory"])]
    assert keys == [(0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 1, 0), (0, 1, 1), (0, 1, 2),
                    (1, 0, 0), (1, 1, 0), (2, 0, 0), (2, 1, 0)]
    row = {k: i for i, k in enumerate(keys)}
    B = d.batch
    for s in (0, 1):
        final, tool_row = row[(0, s, 2)], row[(1, s, 0)]
        # the last snapshot is exactly verl's ToolAgentLoop result for the same prompt
        for key in ("prompts", "responses", "response_mask", "rollout_log_probs", "attention_mask"):
            assert torch.equal(B[key][final], B[key][tool_row]), key
        # earlier snapshots are the same conversation cut after assistant turn 1 and 2
        lengths = []
        for t in range(3):
            resp, mask, _, n = valid_response(d, row[(0, s, t)])
            full, _, _, _ = valid_response(d, final)
            assert torch.equal(resp, full[:n]) and mask[-1] == 1
            lengths.append(n)
            assert nt["snapshot_turn"][row[(0, s, t)]] == t + 1
            assert nt["__num_turns__"][row[(0, s, t)]] == 2 * t + 2
        assert [v for v, _ in runs(valid_response(d, row[(0, s, 0)])[1].tolist())] == [1]
        assert lengths[0] < lengths[1] < lengths[2]
        # a multi-trajectory unit shares its final reward
        scores = [B["rm_scores"][row[(0, s, t)]].sum().item() for t in range(3)]
        assert scores == [1.0, 1.0, 1.0]
        # single-turn rows: one model turn, all mask 1
        resp, mask, _, n = valid_response(d, row[(2, s, 0)])
        assert bool((mask == 1).all()) and nt["__num_turns__"][row[(2, s, 0)]] == 2
    assert set(nt["agent_name"]) == {"context_snapshot_agent", "tool_agent", "single_turn_agent"}

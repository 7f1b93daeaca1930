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
    # the fork's wrapper (any object, or dict, with a `trajectories` list): its pieces, in order
    import sys

    sys.path.insert(0, str(REPO / "tests" / "support"))
    from statelm_loop import MultiTrajectoryAgentLoopOutput

    pieces = [out(), out(response_ids=[5, 6])]
    assert check_trajectories(MultiTrajectoryAgentLoopOutput(trajectories=pieces), 8, 8) == pieces
    assert check_trajectories({"trajectories": pieces}, 8, 8) == pieces
    for bad in ([], [out(response_mask=[1])], out(response_logprobs=[0.0]), out(prompt_ids=list(range(9))),
                out(response_ids=list(range(9)), response_mask=[1] * 9, response_logprobs=None),
                out(response_mask=[1, 2]), out(prompt_ids=[]), ["not a trajectory"]):
        with pytest.raises(InvalidTrajectory):
            check_trajectories(bad, 8, 8)


@pytest.mark.parametrize("rule", ["own", "final"])
def test_a_units_pieces_are_scored_by_the_runs_rule(tmp_path, tiny_model, tokenizer, rule):
    """rows.reward=own scores every piece on its own (a piece whose loop set reward_score keeps it); final copies
    the final piece's reward to every piece (verl V1). Each piece records the rule that gave its reward, and a
    kept record (a unit scored again by a later launch) is scored the same way."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput

    from pipegen.actor.scoring import KeptPiece, Scorer
    from pipegen.launch.job import compose_job

    reward = tmp_path / "reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return float(len(solution_str))\n")
    cfg = compose_job([f"output_dir={tmp_path / 'run'}", f"custom_reward_function.path={reward}",
                       f"rows.reward={rule}"])
    scorer = Scorer(cfg, tokenizer)
    row = {"data_source": "mine", "reward_model": {"ground_truth": "x"}}

    def pieces():
        texts = ["a", "bb", "cccc"]
        return [AgentLoopOutput(prompt_ids=[1], response_ids=tokenizer.encode(t), response_mask=[1] * len(t),
                                metrics=AgentLoopMetrics(), reward_score=7.0 if t == "bb" else None) for t in texts]

    async def score(units):
        try:
            return [await scorer.score_pieces(u, row, scorer.reward_for(row)) for u in units]
        finally:
            await scorer.close()

    outputs = pieces()
    kept = [{"response_ids": p.response_ids, "num_turns": 1, "reward_score": p.reward_score, "extra_fields": None}
            for p in pieces()]
    asyncio.run(score([outputs, [KeptPiece(t) for t in kept]]))
    want = ([1.0, 7.0, 4.0], ["own", "loop", "own"]) if rule == "own" else ([4.0] * 3, ["final", "final", "own"])
    assert ([p.reward_score for p in outputs], [p.extra_fields["reward_rule"] for p in outputs]) == want
    assert ([t["reward_score"] for t in kept], [t["extra_fields"]["reward_rule"] for t in kept]) == want


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
    pipegen_only = {"sample", "trajectory", "seed", "session_id", "loss_weight"}
    assert set(ours.non_tensor_batch) - set(theirs.non_tensor_batch) == pipegen_only
    for key, values in theirs.non_tensor_batch.items():
        assert [_plain(x) for x in ours.non_tensor_batch[key]] == [_plain(x) for x in values], key


def test_multi_turn_records_are_token_exact_and_scored(tmp_path, tiny_model, scripted, tokenizer):
    """Every record's response = the server's outputs interleaved with tool tokens; rm_scores = verl's score."""
    from verl.utils.reward_score import default_compute_score

    from pipegen.engines.request import turn_seed
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
    # each turn carries its own seed, derived from the unit's (this engine's draws are not keyed on position)
    unit_of = {turn_seed(unit_seed(11, i, s), t): unit_seed(11, i, s) for i in range(2) for s in range(2)
               for t in range(3)}
    by_seed: dict[int, list[dict]] = {}
    for e in entries:
        by_seed.setdefault(unit_of[e["seed"]], []).append(e)
    assert all(e["status"] == 200 for e in entries)
    seeds = set()
    for rec in records:
        assert rec["seed"] == unit_seed(11, rec["index"], rec["sample"])
        seeds.add(rec["seed"])
        (traj,) = rec["trajectories"]
        calls = sorted(by_seed[rec["seed"]], key=lambda e: e["t"])
        assert len(calls) == 3  # one request per assistant turn, nothing re-sent
        assert [c["seed"] for c in calls] == [turn_seed(rec["seed"], t) for t in range(3)]
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
    assert {unit_of[e["seed"]] for e in entries} == seeds and len({e["seed"] for e in entries}) == 12

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
        # each piece scored on its own by default (rows.reward=own): only the final one holds "#### 5"
        scores = [B["rm_scores"][row[(0, s, t)]].sum().item() for t in range(3)]
        assert scores == [0.0, 0.0, 1.0]
        assert [nt["reward_rule"][row[(0, s, t)]] for t in range(3)] == ["own"] * 3
        assert [nt["is_snapshot"][row[(0, s, t)]] for t in range(3)] == [True, True, False]
        assert [nt["snapshot_index"][row[(0, s, t)]] for t in range(3)] == [0, 1, None]
        # single-turn rows: one model turn, all mask 1
        resp, mask, _, n = valid_response(d, row[(2, s, 0)])
        assert bool((mask == 1).all()) and nt["__num_turns__"][row[(2, s, 0)]] == 2
    assert set(nt["agent_name"]) == {"context_snapshot_agent", "tool_agent", "single_turn_agent"}


# ------------------------------------------------------------------- a fork-style multi-trajectory loop (StateLM)

SUPPORT = REPO / "tests" / "support"  # statelm_loop.py: the user's module, on PYTHONPATH as a user would put it
STATELM_SCRIPT = [
    'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n</tool_call>',
    'I no longer need that.\n<tool_call>\n{"name": "deleteContext", "arguments": {"msg_id": 1}}\n</tool_call>',
    'Check it.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "20 // 4"}}\n</tool_call>',
    'Drop it too.\n<tool_call>\n{"name": "deleteContext", "arguments": {"msg_id": 3}}\n</tool_call>',
    "The answer is #### 5",
]
RESUME_FIELDS = {"resumed", "resumed_at_token", "replayed_calls"}  # a resumed unit's rows say so (docs/outputs.md)


def statelm_overrides(tiny_model: str, tmp: Path, url: str, *extra: str, loops: Path | None = None,
                      agent: str = "statelm_agent") -> list[str]:
    """The fork-style loop registered through agent_loop_config_path, with calculator and deleteContext tools."""
    import sys

    sys.path.insert(0, str(SUPPORT))
    from statelm_loop import TOOL_CONFIG

    data = tmp / "statelm.parquet"
    if not data.exists():  # written once: a second run over the same files has the same run key (and uids)
        (tmp / "loops.yaml").write_text("- name: statelm_agent\n  _target_: statelm_loop.StateLMAgentLoop\n")
        (tmp / "tools.yaml").write_text(Path(TOOLS_YAML).read_text() + TOOL_CONFIG.split("tools:\n", 1)[1])
        write_dataset(data, [{"content": q} for q in QUESTIONS])
    base = [o for o in BASE if not o.startswith(("max_prompt_length=", "max_response_length="))]
    return ["llm=external", f"llm.urls=[{url}]", f"model_path={tiny_model}", f"train_files={data}", *base,
            "max_prompt_length=768", "max_response_length=320", "n=2", "actors.per_unit_seed=false",
            f"actor_rollout_ref.rollout.agent.agent_loop_config_path={loops or tmp / 'loops.yaml'}",
            f"actor_rollout_ref.rollout.agent.default_agent_loop={agent}",
            f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tmp / 'tools.yaml'}", *extra]


@pytest.fixture(scope="module")
def statelm(tiny_model, tmp_path_factory):
    """One uninterrupted run of the fork-style loop on the CPU server (the fake engine's script), shared by the
    tests below: (run directory, its rows, the server's URL)."""
    from conftest import launch

    tmp = tmp_path_factory.mktemp("statelm")
    script = tmp / "script.json"
    script.write_text(json.dumps(STATELM_SCRIPT))
    server = FakeServer("statelm", tmp, tiny_model, "--script", str(script), "--slots", "16").wait_ready()
    try:
        out = tmp / "run"
        result = launch(out, *statelm_overrides(tiny_model, tmp, server.url), env={"PYTHONPATH": str(SUPPORT)})
        assert result.returncode == 0, result.stderr[-3000:]  # launch() also ran `status --verify` on it
        yield out, load_trajectories(out / "trajectories.pkl"), server.url
    finally:
        server.stop()


def fork_worker():
    """verl's AgentLoopWorker with the fork's generate_sequences flattening: each piece of a loop's `trajectories`
    through verl's own per-trajectory postprocessing, scored on its own (verl's default_compute_score on its
    decoded response, as verl's reward loop calls it), the input rows repeated per piece, then verl's own
    `_postprocess`."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
    from verl.utils.reward_score import default_compute_score

    class Worker(AgentLoopWorker):
        async def _agent_loop_postprocess(self, output, validate, **kwargs):
            pieces = getattr(output, "trajectories", None) or [output]
            padded = []
            for piece in pieces:
                if piece.reward_score is None:
                    text = self.tokenizer.decode(piece.response_ids, skip_special_tokens=True)
                    score = default_compute_score(kwargs["data_source"], text,
                                                  kwargs["reward_model"]["ground_truth"])
                    piece.reward_score, piece.extra_fields["reward_extra_info"] = score, {"acc": score}
                padded.append(await super()._agent_loop_postprocess(piece, validate, **kwargs))
            return padded

        def _postprocess(self, inputs, input_non_tensor_batch=None, validate=False):
            counts = [len(pieces) for pieces in inputs]
            rows = {k: np.repeat(v, counts, axis=0) for k, v in (input_non_tensor_batch or {}).items()}
            return super()._postprocess([p for pieces in inputs for p in pieces], rows, validate)

    return Worker


def test_a_fork_style_multi_trajectory_loop_runs_unchanged_and_equals_verls_flattening(statelm, tiny_model):
    """The fork's MultiTrajectoryAgentLoopOutput (a snapshot before each deleteContext call, then the final
    conversation) runs through pipegen unchanged: one row per piece, tensor for tensor what verl's worker gives
    with the fork's flattening, each piece with its own reward; loss_weight sums to 1 per sample and each GRPO
    group (uid) holds every piece of its samples."""
    from test_verl_parity import _plain, _verl_reference

    from pipegen.run.config import load_run_config
    from pipegen.run.layout import RunDir

    out, ours, url = statelm
    nt = ours.non_tensor_batch
    keys = [(int(i), int(s), int(t)) for i, s, t in zip(nt["index"], nt["sample"], nt["trajectory"])]
    assert keys == [(i, s, t) for i in range(len(QUESTIONS)) for s in range(2) for t in range(3)]
    assert list(nt["is_snapshot"]) == [True, True, False] * 6 and list(nt["snapshot_index"]) == [0, 1, None] * 6
    # status counts the model's turns as the loop had them, 2, 4 and 5 per piece (verl's num_turns counts messages)
    from pipegen.observe.run_status import gather, render

    assert "mean assistant turns 3.67" in render(gather(RunDir(out)))
    scores = ours.batch["rm_scores"].sum(-1).tolist()
    assert scores == [0.0, 0.0, 1.0] * 6 and list(nt["reward_rule"]) == ["own"] * 18  # the final piece answers
    # weights and groups: 1/3 per piece; a uid's rows are every piece of its prompt's two samples
    sessions: dict[str, float] = {}
    for session, weight in zip(nt["session_id"], nt["loss_weight"]):
        sessions[session] = sessions.get(session, 0.0) + weight
    assert len(sessions) == 6 and all(w == pytest.approx(1.0) for w in sessions.values())
    for uid in set(nt["uid"]):
        group = [k for k, u in zip(keys, nt["uid"]) if u == uid]
        assert len(group) == 6 and len({k[0] for k in group}) == 1
    # verl's own GRPO advantage over these groups: each final piece above its group's mean, each snapshot below
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    advantages, _ = compute_grpo_outcome_advantage(ours.batch["rm_scores"], ours.batch["response_mask"], nt["uid"])
    first = [float(a[m.bool()][0]) for a, m in zip(advantages, ours.batch["response_mask"])]
    assert all((a > 0) == (t == 2) for a, (_, _, t) in zip(first, keys))

    theirs = _verl_reference(load_run_config(RunDir(out)), url, {
        int(i): u for i, u in zip(nt["index"], nt["uid"])}, fork_worker())
    assert len(theirs) == len(ours) == 18
    assert set(ours.batch.keys()) == set(theirs.batch.keys())
    for key in theirs.batch.keys():
        a, b = ours.batch[key], theirs.batch[key]
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), key
    pipegen_only = {"sample", "trajectory", "seed", "session_id", "loss_weight", "reward_rule"}
    assert set(nt) - set(theirs.non_tensor_batch) == pipegen_only
    for key, values in theirs.non_tensor_batch.items():
        assert [_plain(x) for x in nt[key]] == [_plain(x) for x in values], key


def test_exports_of_a_multi_trajectory_run_validate_and_match_its_rows(statelm, tmp_path):
    """Parquet (one row per piece, with its messages, session, weight and reward rule; verl's internal columns
    left out unless rows.export_verl_columns) and ATIF (one document per piece, the prefix a piece shares with an
    earlier piece of its sample marked is_copied_context) hold what the DataProto rows hold."""
    import pyarrow.parquet as pq
    from atif import Trajectory
    from omegaconf import open_dict

    from pipegen.export.__main__ import main as export_main
    from pipegen.export.writers import VERL_INTERNAL, export_plan
    from pipegen.run.checkpoint import load_checkpoint
    from pipegen.run.config import load_run_config
    from pipegen.run.layout import RunDir
    from pipegen.run.rows import SortedRows

    out, rows, _ = statelm
    nt = rows.non_tensor_batch
    parquet = tmp_path / "rows.parquet"
    assert export_main([str(out), "--format", "parquet", "--output", str(parquet)]) == 0
    table = pq.read_table(parquet).to_pylist()
    assert len(table) == len(rows) == 18
    assert {"tool_rewards", "turn_scores"} <= set(nt) and not set(VERL_INTERNAL) & set(table[0])
    for i, row in enumerate(table):
        for key in ("index", "sample", "trajectory", "uid", "session_id", "loss_weight", "reward_rule", "is_snapshot",
                    "snapshot_index"):
            assert row[key] == nt[key][i], key
        assert row["reward"] == rows.batch["rm_scores"][i].sum().item()
        resp, mask, _, _ = valid_response(rows, i)
        assert row["response_ids"] == resp.tolist() and row["response_mask"] == mask.tolist()
        # the prompt's messages, then each model turn and each tool reply between two turns
        prompt = [{"role": m["role"], "content": m["content"]} for m in nt["raw_prompt"][i]]
        turns = [2, 4, 5][row["trajectory"]]  # a snapshot before each deleteContext call, then the final
        assert row["messages"][:len(prompt)] == prompt
        answer = row["messages"][len(prompt):]
        assert [m["role"] for m in answer] == ["assistant", "tool"] * (turns - 1) + ["assistant"]
        assert [m["content"] for m in answer[::2]] == STATELM_SCRIPT[:turns]
    cfg = load_run_config(RunDir(out))
    with open_dict(cfg):
        cfg.rows.export_verl_columns = True
    plan = SortedRows.committed(RunDir(out), load_checkpoint(RunDir(out).checkpoint))
    export_plan(cfg, plan, tmp_path / "all.parquet", "parquet")
    assert {"tool_rewards", "turn_scores"} <= set(pq.read_schema(tmp_path / "all.parquet").names)

    from pipegen.report.numbers import report_numbers

    from pipegen.report.page import render

    numbers = report_numbers(RunDir(out))[0]
    pieces = numbers["pieces"]  # the report's statistics per piece kind, on its page too
    assert "<h2>Per piece kind</h2>" in render(numbers, {}) and "own 12" in render(numbers, {})
    assert pieces["snapshot"]["rows"] == 12 and pieces["snapshot"]["mean_reward"] == 0.0
    assert pieces["final"]["rows"] == pieces["final"]["samples"] == 6 and pieces["final"]["mean_reward"] == 1.0
    assert pieces["snapshot"]["reward_rules"] == {"own": 12} and pieces["final"]["reward_rules"] == {"own": 6}

    folder = tmp_path / "atif"
    assert export_main([str(out), "--format", "atif", "--output", str(folder)]) == 0
    by_session: dict[str, list[dict]] = {}
    for i in range(len(rows)):
        index, sample, trajectory = (int(nt[k][i]) for k in ("index", "sample", "trajectory"))
        doc = orjson.loads((folder / f"{index}-{sample}-{trajectory}.json").read_bytes())
        Trajectory.model_validate(doc)
        assert doc["session_id"] == nt["session_id"][i]
        for key in ("trajectory", "uid", "loss_weight", "reward_rule", "is_snapshot", "snapshot_index"):
            assert doc["extra"][key] == nt[key][i], key
        assert doc["extra"]["reward"] == rows.batch["rm_scores"][i].sum().item()
        by_session.setdefault(doc["session_id"], []).append(doc)
    assert len(by_session) == 6
    for i, docs in enumerate(by_session.values()):
        agent = [[s for s in d["steps"] if s["source"] == "agent"] for d in docs]
        assert [len(a) for a in agent] == [2, 4, 5]
        assert [[bool(s.get("is_copied_context")) for s in a] for a in agent] == [
            [False] * 2, [True] * 2 + [False] * 2, [True] * 4 + [False]]
        # each sampled token is outside copied context exactly once across the sample's documents
        own = [t for a in agent for s in a if not s.get("is_copied_context")
               for t in s["metrics"]["completion_token_ids"]]
        final = 3 * i + 2
        assert own == rows.batch["responses"][final][rows.batch["response_mask"][final].bool()].tolist()


@pytest.mark.slow
def test_an_actor_killed_inside_a_multi_trajectory_loop_gives_the_uninterrupted_rows(statelm, tiny_model, tmp_path):
    """The fork-style loop's run again, its actor SIGKILLed while every unit is inside its session (a recording
    proxy has answered two model calls per unit on average): the restarted actor finishes the units, each sample
    committed whole, and the rows equal the uninterrupted run's, tensor for tensor (resumed rows only say so)."""
    from conftest import assert_verified, launch_killing_the_actor

    first, uninterrupted, _ = statelm
    script = tmp_path / "script.json"
    script.write_text(json.dumps(STATELM_SCRIPT))
    server = FakeServer("slow", tmp_path, tiny_model, "--script", str(script), "--slots", "16",
                        "--token-latency", "0.05").wait_ready()
    proxy = RecordingProxy("proxy", tmp_path, server.url).wait_ready()
    out = tmp_path / "run"
    # the same data and loop files as the uninterrupted run (they are part of its run key, so of its uids)
    overrides = statelm_overrides(tiny_model, first.parent, proxy.url)
    try:
        returncode, stderr = launch_killing_the_actor(
            out, overrides, lambda: sum(e["status"] == 200 for e in proxy.entries()) >= 2 * 6,
            env={"PYTHONPATH": str(SUPPORT)})
    finally:
        for process in (proxy, server):
            process.stop()
    assert returncode == 0, stderr[-3000:]
    assert (out / "logs" / "actor_0.log").read_text().count("starting actor_0") == 2
    assert_verified(out)
    rows = load_trajectories(out / "trajectories.pkl")
    assert any(rows.non_tensor_batch["resumed"])
    assert set(rows.batch.keys()) == set(uninterrupted.batch.keys())
    for key in rows.batch.keys():
        assert torch.equal(rows.batch[key], uninterrupted.batch[key]), key
    assert set(rows.non_tensor_batch) - RESUME_FIELDS == set(uninterrupted.non_tensor_batch)
    for key, values in uninterrupted.non_tensor_batch.items():
        option = orjson.OPT_SERIALIZE_NUMPY
        assert orjson.dumps(rows.non_tensor_batch[key].tolist(), option=option) == \
               orjson.dumps(values.tolist(), option=option), key


def test_the_snapshot_loop_snapshots_when_a_named_tool_runs(statelm, tiny_model, tmp_path):
    """pipegen's ContextSnapshotAgentLoop with `snapshot_on_tool: deleteContext` (and no snapshot by count) takes
    the fork's snapshots: before each deleteContext call runs. Its rows equal the fork-style loop's, piece for
    piece."""
    from conftest import launch

    first, fork_rows, url = statelm
    loops = tmp_path / "loops.yaml"
    loops.write_text("- name: on_tool\n  _target_: pipegen.agent_loops.snapshot.ContextSnapshotAgentLoop\n"
                     "  snapshot_every: 0\n  snapshot_on_tool: deleteContext\n")
    out = tmp_path / "run"
    result = launch(out, *statelm_overrides(tiny_model, first.parent, url, loops=loops, agent="on_tool"),
                    env={"PYTHONPATH": str(SUPPORT)})
    assert result.returncode == 0, result.stderr[-3000:]
    rows = load_trajectories(out / "trajectories.pkl")
    for key in ("index", "sample", "trajectory", "is_snapshot", "snapshot_index", "reward_rule", "loss_weight"):
        assert list(rows.non_tensor_batch[key]) == list(fork_rows.non_tensor_batch[key]), key
    for key in fork_rows.batch.keys():
        assert torch.equal(rows.batch[key], fork_rows.batch[key]), key

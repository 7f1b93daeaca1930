"""What the benchmarks run against instead of a GPU, a real model and a cluster, each speaking the real
protocol: `fake_backend` (the CPU server's deterministic model backend, chosen by import path:
`llm.engine=pipegen.bench.doubles.fake_backend:FakeBackend`; `fake_model`, its pure token function),
`tiny_models` (a tiny random-weight Qwen2 around a real tokenizer, built once), `loopback_cluster` (a Ray
cluster on one machine). The test suite uses them too; product code never imports them.
"""

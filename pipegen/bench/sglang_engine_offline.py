"""The GPU bench's offline arm: SGLang's own engine in-process (`sglang.Engine`), the whole prompt list in one
`generate` call, log-probs on, as fast as SGLang runs without HTTP.

    PYTHON_WITH_SGLANG pipegen/bench/sglang_engine_offline.py --prompts P.json --out R.json -- SERVER FLAGS...

Why not `python -m sglang.bench_offline_throughput`: it has no way to ask for log-probs, and pipegen always
asks for them (verl needs them), so its figure would be of a lighter workload. This arm sends what pipegen and
the raw loop send: token ids, the same sampling params per prompt (P.json: `{"input_ids": [[...]],
"sampling_params": [{...}]}`, the bodies pipegen sent, `ignore_eos` set), `return_logprob`. The engine is
built from the very server flags the other arms' server ran with (`ServerArgs` parses them), after a short
warm-up generate. Writes R.json: requests, output tokens, seconds, requests/s, output tok/s, finish reasons.

Runs under SGLang's interpreter (launch.sh's .venv-sglang, or the GPU kit's python), by path: it imports
nothing of pipegen. Owns: that arm. Must never: run without a GPU (SGLang needs one).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time


def main(argv: list[str]) -> int:
    if "--" in argv:
        ours, flags = argv[: argv.index("--")], argv[argv.index("--") + 1:]
    else:
        ours, flags = argv, []
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--warmup", type=int, default=64, help="prompts generated once before the timed call")
    a = ap.parse_args(ours)

    import sglang
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    server_args = ServerArgs.from_cli_args(parser.parse_args(flags))
    work = json.loads(open(a.prompts).read())
    ids, params = work["input_ids"], work["sampling_params"]
    engine = sglang.Engine(server_args=server_args)
    try:
        engine.generate(input_ids=ids[: a.warmup], sampling_params=params[: a.warmup], return_logprob=True)
        t0 = time.perf_counter()
        outs = engine.generate(input_ids=ids, sampling_params=params, return_logprob=True)
        seconds = time.perf_counter() - t0
    finally:
        engine.shutdown()
    tokens = sum(int(o["meta_info"]["completion_tokens"]) for o in outs)
    finish = collections.Counter(str((o["meta_info"].get("finish_reason") or {}).get("type")) for o in outs)
    missing_lp = sum(1 for o in outs if len(o["meta_info"].get("output_token_logprobs") or []) != len(o["output_ids"]))
    result = {"requests": len(outs), "output_tokens": tokens, "seconds": seconds,
              "requests_per_s": len(outs) / seconds, "output_tok_per_s": tokens / seconds,
              "finish": dict(finish), "answers_without_logprobs": missing_lp}
    with open(a.out, "w") as f:
        json.dump(result, f)
    print("OFFLINE_RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""vLLM's own offline throughput on given prompts: `LLM.generate` in one process, no HTTP.

    VLLM_PYTHON pipegen/bench/vllm_offline_throughput.py --model DIR --requests FILE.json --result OUT.json
        [--dtype D] [--max-num-seqs N] [--reps R] [--cpu]

FILE.json: a list of vLLM /v1/completions bodies (what pipegen sent: `prompt` ids, `max_tokens`, `seed`,
sampling knobs, `logprobs`). Each becomes a TokensPrompt with the same SamplingParams, so vLLM generates the
same tokens it generated for pipegen, without a tokenizer as pipegen's servers run; with --cpu, the
settings pipegen gives a CPU server (launch/servers.py's vllm_server_command). One warm-up request first (the sampler is compiled on the first use),
then, R times, every request in one `generate` call from a cold prefix cache, timed. Writes
{"output_tokens", "seconds": [one per repetition]} to OUT.json (vLLM logs to stdout).

Runs under the vLLM server's python (its own environment): imports vllm and the standard library only,
never pipegen (which that environment does not have).
"""

import argparse
import json
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--requests", required=True)
    p.add_argument("--result", required=True)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--cpu", action="store_true", help="the CPU server's settings: eager, no chunked prefill")
    args = p.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    bodies = json.load(open(args.requests))
    cpu = {"enforce_eager": True, "enable_chunked_prefill": False} if args.cpu else {}
    llm = LLM(model=args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs, seed=0,
              logprobs_mode="processed_logprobs", skip_tokenizer_init=True, **cpu)
    keys = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "stop_token_ids", "logprobs")
    params = [SamplingParams(max_tokens=b["max_tokens"], **{k: b[k] for k in keys if b.get(k) is not None})
              for b in bodies]
    prompts = [TokensPrompt(prompt_token_ids=b["prompt"]) for b in bodies]
    llm.generate(prompts[:1], params[:1], use_tqdm=False)
    seconds = []
    for _ in range(args.reps):
        llm.reset_prefix_cache()
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds.append(time.perf_counter() - started)
    with open(args.result, "w") as f:
        json.dump({"output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs), "seconds": seconds}, f)


if __name__ == "__main__":
    main()

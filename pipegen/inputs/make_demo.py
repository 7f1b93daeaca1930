"""Generate the packaged demo data set: one-step arithmetic questions in verl's gsm8k parquet layout.

Usage: ``python -m pipegen.inputs.make_demo [--out PATH] [--count 96] [--seed 0]``
(default output: ``pipegen/inputs/demo_arith.parquet``, which ships with the package).

Owns: the demo problems and their row layout, which mirrors verl's ``examples/data_preprocess/gsm8k.py`` so that
verl's ``RLHFDataset`` loads the file and ``default_compute_score("openai/gsm8k", ...)`` scores it:
``data_source``, ``prompt`` (two worked examples as earlier chat turns, then the question ending in the
"####" instruction), ``ability``, ``reward_model {style, ground_truth}``, ``extra_info {split, index, answer,
question}``. The embedded SmolLM2-135M answers about half of them right (see README, "Two commands").
Must never: be random across runs (same arguments -> same rows, same bytes), write empty dicts (pyarrow refuses
empty structs), or make prompts long - the CPU demo prefills every prompt, so they stay under ~130 tokens with
the SmolLM2 chat template.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from pathlib import Path
from typing import Callable

DEFAULT_OUT = Path(__file__).resolve().parent / "demo_arith.parquet"
DATA_SOURCE = "openai/gsm8k"  # routes verl's default_compute_score to its gsm8k ("#### answer") scorer
# The answer format verl's gsm8k scorer accepts ("#### <number>"), asked for in every question and
# shown in two worked examples (earlier chat turns): a 135M model then answers in that format most of
# the time and gets the sum right often enough for the demo's rewards to mean something.
INSTRUCTION = "Answer with #### and the number."
FEW_SHOT = [
    {"role": "user", "content": f"What is 2 + 3? {INSTRUCTION}"},
    {"role": "assistant", "content": "2 + 3 = 5\n#### 5"},
    {"role": "user", "content": f"What is 4 * 6? {INSTRUCTION}"},
    {"role": "assistant", "content": "4 * 6 = 24\n#### 24"},
]

# (question, worked solution, answer) from a seeded RNG
Problem = tuple[str, str, int]


def _ask(a: int, op: str, b: int, answer: int) -> Problem:
    return f"What is {a} {op} {b}?", f"{a} {op} {b} = {answer}", answer


def _add(r: random.Random) -> Problem:
    a, b = r.randint(2, 30), r.randint(2, 30)
    return _ask(a, "+", b, a + b)


def _sub(r: random.Random) -> Problem:
    b = r.randint(2, 20)
    a = b + r.randint(1, 20)
    return _ask(a, "-", b, a - b)


def _mul(r: random.Random) -> Problem:
    a, b = r.randint(2, 9), r.randint(2, 9)
    return _ask(a, "*", b, a * b)


def _div(r: random.Random) -> Problem:
    each, k = r.randint(2, 9), r.randint(2, 9)
    return _ask(each * k, "/", k, each)


_KINDS: list[Callable[[random.Random], Problem]] = [_add, _sub, _mul, _div]


def make_rows(count: int = 96, seed: int = 0, split: str = "train") -> list[dict[str, object]]:
    """``count`` distinct problems as verl gsm8k-style rows; ``extra_info.index`` runs 0..count-1."""
    if count < 1:
        raise ValueError(f"count={count}: must be at least 1")
    r = random.Random(seed)
    rows: list[dict[str, object]] = []
    seen: set[str] = {m["content"].split("?")[0] + "?" for m in FEW_SHOT if m["role"] == "user"}
    attempts = 0
    while len(rows) < count:
        attempts += 1
        if attempts > count * 100:
            raise RuntimeError(f"could not make {count} distinct problems")
        question, work, answer = _KINDS[len(rows) % len(_KINDS)](r)  # cycle kinds so every kind is present
        if question in seen:
            continue
        seen.add(question)
        i = len(rows)
        rows.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": [*FEW_SHOT, {"role": "user", "content": f"{question} {INSTRUCTION}"}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(answer)},
                "extra_info": {"split": split, "index": i, "answer": f"{work}\n#### {answer}", "question": question},
            }
        )
    return rows


def write_parquet(rows: list[dict[str, object]], out: str | os.PathLike[str]) -> Path:
    """Write rows to ``out`` atomically (temporary sibling + rename) and return the path."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist(rows)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    pq.write_table(table, tmp)
    os.replace(tmp, out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipegen.inputs.make_demo", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="output parquet (default: the packaged demo file)")
    parser.add_argument("--count", type=int, default=96, help="number of problems (default 96)")
    parser.add_argument("--seed", type=int, default=0, help="RNG seed (default 0)")
    args = parser.parse_args(argv)
    path = write_parquet(make_rows(args.count, args.seed), args.out)
    print(f"wrote {args.count} problems to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

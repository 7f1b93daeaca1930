"""Generate the packaged demo data set: short arithmetic word problems in verl's gsm8k parquet layout.

Usage: ``python -m pipegen.data.make_demo [--out PATH] [--count 96] [--seed 0]``
(default output: ``pipegen/data/demo_arith.parquet``, which ships with the package).

Owns: the demo problems and their row layout, which mirrors verl's ``examples/data_preprocess/gsm8k.py`` so that
verl's ``RLHFDataset`` loads the file and ``default_compute_score("openai/gsm8k", ...)`` scores it:
``data_source``, ``prompt`` (one user message ending in the "####" instruction), ``ability``,
``reward_model {style, ground_truth}``, ``extra_info {split, index, answer, question}``.
Must never: be random across runs (same arguments -> same rows, same bytes), write empty dicts (pyarrow refuses
empty structs), or make prompts long - the CPU demo prefills every prompt, so they stay under ~80 tokens with the
SmolLM2 chat template.
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
# verbatim from verl's examples/data_preprocess/gsm8k.py
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'

_NAMES = ["Tom", "Anna", "Maria", "Ben", "Lucy", "Omar", "Priya", "Chen", "Sara", "Diego", "Ivy", "Max"]
_ITEMS = ["apples", "marbles", "stickers", "pencils", "cookies", "books", "coins", "shells"]
_GOODS = ["pen", "notebook", "sandwich", "ticket", "toy car", "plant"]

# (question, worked solution, answer) from a seeded RNG
Problem = tuple[str, str, int]


def _add(r: random.Random) -> Problem:
    n, item, a, b = r.choice(_NAMES), r.choice(_ITEMS), r.randint(3, 40), r.randint(2, 30)
    q = f"{n} has {a} {item} and gets {b} more. How many {item} does {n} have now?"
    return q, f"{a} + {b} = {a + b}", a + b


def _sub(r: random.Random) -> Problem:
    n, item, b = r.choice(_NAMES), r.choice(_ITEMS), r.randint(2, 30)
    a = b + r.randint(1, 40)
    q = f"{n} has {a} {item} and gives {b} away. How many {item} are left?"
    return q, f"{a} - {b} = {a - b}", a - b


def _mul_boxes(r: random.Random) -> Problem:
    item, a, b = r.choice(_ITEMS), r.randint(2, 12), r.randint(2, 9)
    q = f"A box holds {a} {item}. How many {item} are in {b} boxes?"
    return q, f"{a} * {b} = {a * b}", a * b


def _div_share(r: random.Random) -> Problem:
    n, item, each, k = r.choice(_NAMES), r.choice(_ITEMS), r.randint(2, 12), r.randint(2, 8)
    q = f"{n} shares {each * k} {item} equally among {k} friends. How many does each friend get?"
    return q, f"{each * k} / {k} = {each}", each


def _cost(r: random.Random) -> Problem:
    good, price, k = r.choice(_GOODS), r.randint(2, 15), r.randint(2, 9)
    q = f"One {good} costs {price} dollars. How many dollars do {k} of them cost?"
    return q, f"{price} * {k} = {price * k}", price * k


def _pages(r: random.Random) -> Problem:
    n, per_day, days = r.choice(_NAMES), r.randint(3, 25), r.randint(2, 7)
    q = f"{n} reads {per_day} pages a day for {days} days. How many pages is that in total?"
    return q, f"{per_day} * {days} = {per_day * days}", per_day * days


def _money(r: random.Random) -> Problem:
    n, spent, earned = r.choice(_NAMES), r.randint(2, 20), r.randint(2, 20)
    had = spent + r.randint(1, 30)
    left, now = had - spent, had - spent + earned
    q = f"{n} had {had} dollars, spent {spent}, then earned {earned}. How many dollars does {n} have now?"
    return q, f"{had} - {spent} = {left}\n{left} + {earned} = {now}", now


def _birds(r: random.Random) -> Problem:
    leave, arrive = r.randint(2, 15), r.randint(2, 15)
    start = leave + r.randint(1, 20)
    mid, now = start - leave, start - leave + arrive
    q = f"There are {start} birds on a tree. {leave} fly away and {arrive} more arrive. How many birds are there now?"
    return q, f"{start} - {leave} = {mid}\n{mid} + {arrive} = {now}", now


_KINDS: list[Callable[[random.Random], Problem]] = [_add, _sub, _mul_boxes, _div_share, _cost, _pages, _money, _birds]


def make_rows(count: int = 96, seed: int = 0, split: str = "train") -> list[dict[str, object]]:
    """``count`` distinct problems as verl gsm8k-style rows; ``extra_info.index`` runs 0..count-1."""
    if count < 1:
        raise ValueError(f"count={count}: must be at least 1")
    r = random.Random(seed)
    rows: list[dict[str, object]] = []
    seen: set[str] = set()
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
                "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
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
    parser = argparse.ArgumentParser(prog="python -m pipegen.data.make_demo", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="output parquet (default: the packaged demo file)")
    parser.add_argument("--count", type=int, default=96, help="number of problems (default 96)")
    parser.add_argument("--seed", type=int, default=0, help="RNG seed (default 0)")
    args = parser.parse_args(argv)
    path = write_parquet(make_rows(args.count, args.seed), args.out)
    print(f"wrote {args.count} problems to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

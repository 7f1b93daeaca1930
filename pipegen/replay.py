"""`pipegen replay DIR|URL [--units N | --all] [key=value ...]`: generate some of a finished run's units again with the
run's recorded config and compare them with what the run holds, token ids and log-probs apart, bit for bit.

    pipegen replay runs/demo                  8 units picked at random; exit 0 only when every one is identical
    pipegen replay runs/demo --all            every unit
    pipegen replay runs/demo llm.dtype=bfloat16   the same units with one setting changed: what that changes
    pipegen replay s3://bucket/run            a store run, read back from the store alone (transport/store_read.py)

How: the units' dataset rows (by `extra_info.index`, so each unit keeps its seed) go into a parquet file of their
own, and `python -m pipegen.launch` runs the recorded config on it into a scratch folder (the keys the run set, read
from DIR/conf/config.yaml against the defaults, plus any given here). Each unit's rows (every trajectory of it) are
compared by (index, sample, trajectory): the response's ids, then its log-probs as float32 bits. It prints "K of N
identical", the largest log-prob difference where the ids agree, and the first differing unit and position, and
names what differs between the run's record and the replay (model weights, engine, dtype, reproducibility), the
usual reasons for a mismatch.
Owns: picking the units, their rows, the replay launch and the comparison. Must never: write into DIR (the replay
runs in its own folder), or call a run identical on anything but equal bits.
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from omegaconf import DictConfig, OmegaConf

from pipegen.config.invocation import command

DEFAULT_UNITS = 8
# keys the replay sets itself, or that change nothing a unit holds
OWN_KEYS = ("output_dir", "train_files", "max_samples", "data.train_files", "data.train_max_samples",
            "generation.report", "generation.upload_artifact", "generation.show_progress", "trainer.logger",
            "generation.keep_streams", "generation.export_format", "actor_rollout_ref.model.path",
            "actor_rollout_ref.rollout.prometheus.", "storage.")  # a store run replays into a local scratch folder
ALWAYS = ("n", "max_prompt_length", "max_response_length", "temperature", "seed", "model_path")


@dataclass
class Comparison:
    units: int = 0
    same_ids: int = 0
    same: int = 0  # ids and log-probs
    largest_lp_gap: float = 0.0
    first: str = ""  # the first differing unit and position
    missing: list[tuple[int, int]] = field(default_factory=list)

    def line(self) -> str:
        return (f"{self.same} of {self.units} units identical (token ids: {self.same_ids} of {self.units}; largest "
                f"log-prob difference where the ids agree: {self.largest_lp_gap:.3g})")


def replay_overrides(saved: DictConfig) -> list[str]:
    """The overrides that compose `saved` again (config/config_file.py's `overrides_of`, as `run_generation` takes a
    run's own config), less the keys the replay sets itself, with the job's size keys always given: their defaults
    follow train_files (the demo's are small), and the replay's train_files differ."""
    from pipegen.config.config_file import overrides_of
    from pipegen.config.overrides import render

    mine = OmegaConf.to_container(saved, resolve=True)
    key = lambda o: o.split("=", 1)[0].lstrip("+")  # noqa: E731
    out = [o for o in overrides_of(saved) if not key(o).startswith(OWN_KEYS) and key(o) not in ALWAYS]
    return out + [f"{k}={render(mine[k])}" for k in ALWAYS if k in mine]


def _rows_file(saved: DictConfig, indices: set[int], folder: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    files = saved.train_files if isinstance(saved.train_files, (list, tuple)) or OmegaConf.is_list(saved.train_files) \
        else [saved.train_files]
    tables = []
    for f in files:
        table = pq.read_table(str(f))
        keep = [isinstance(info, dict) and info.get("index") in indices for info in table.column("extra_info").to_pylist()]
        tables.append(table.filter(pa.array(keep)))
    path = folder / "replay_rows.parquet"
    pq.write_table(pa.concat_tables(tables), path)
    return path


def units_of(data: Any) -> dict[tuple[int, int], list[int]]:
    """(index, sample) -> the unit's row positions, in trajectory order."""
    out: dict[tuple[int, int], list[int]] = {}
    order = sorted(range(len(data)), key=lambda i: (int(data.non_tensor_batch["index"][i]),
                                                    int(data.non_tensor_batch["sample"][i]),
                                                    int(data.non_tensor_batch["trajectory"][i])))
    for i in order:
        out.setdefault((int(data.non_tensor_batch["index"][i]), int(data.non_tensor_batch["sample"][i])), []).append(i)
    return out


def _response(data: Any, i: int) -> tuple[list[int], Any]:
    width = data.batch["prompts"].shape[1]
    length = int(data.batch["attention_mask"][i, width:].sum())
    return data.batch["responses"][i, :length].tolist(), data.batch["rollout_log_probs"][i, :length]


def compare(recorded: Any, replayed: Any, chosen: list[tuple[int, int]]) -> Comparison:
    import torch

    want, got = units_of(recorded), units_of(replayed)
    result = Comparison(units=len(chosen))
    for unit in chosen:
        if unit not in got or len(got[unit]) != len(want[unit]):
            result.missing.append(unit)
            result.first = result.first or f"unit (index {unit[0]}, sample {unit[1]}): not replayed whole"
            continue
        ids_same = lps_same = True
        for t, (a, b) in enumerate(zip(want[unit], got[unit])):
            ids_a, lp_a = _response(recorded, a)
            ids_b, lp_b = _response(replayed, b)
            agree = next((p for p, (x, y) in enumerate(zip(ids_a, ids_b)) if x != y), min(len(ids_a), len(ids_b)))
            if ids_a != ids_b:
                ids_same = False
                result.first = result.first or (f"unit (index {unit[0]}, sample {unit[1]}) trajectory {t}: token ids "
                                                f"differ from response position {agree}")
            gap = float((lp_a[:agree].float() - lp_b[:agree].float()).abs().max()) if agree else 0.0
            result.largest_lp_gap = max(result.largest_lp_gap, gap)
            bits_equal = torch.equal(lp_a[:agree].float().view(torch.int32), lp_b[:agree].float().view(torch.int32))
            if not bits_equal:
                lps_same = False
                if ids_same and not result.first:
                    pos = int((lp_a[:agree] != lp_b[:agree]).nonzero()[0])
                    result.first = (f"unit (index {unit[0]}, sample {unit[1]}) trajectory {t}: log-probs differ from "
                                    f"response position {pos} (by {gap:.3g})")
        result.same_ids += ids_same
        result.same += ids_same and lps_same
    return result


def _facts(run: Path, cfg: DictConfig) -> dict[str, Any]:
    """What explains a mismatch, as the run directory records it."""
    from pipegen.config.schema import is_reproducible
    from pipegen.run.layout import RunDir
    from pipegen.run.precision import resolve_dtype_name

    try:
        weights = orjson.loads((run / "conf" / "fingerprint.json").read_bytes()).get("weights")
    except (OSError, ValueError):
        weights = None
    reported = RunDir(run).engine_facts()  # what the servers said of themselves (conf/engines.json)
    dtype = str(cfg.llm.get("dtype", "auto"))
    if cfg.llm.kind == "cpu":
        dtype = resolve_dtype_name(dtype)
    return {"model": str(cfg.model_path), "model weights": orjson.dumps(weights).decode() if weights else "unrecorded",
            "engine": f"llm={cfg.llm.kind} ({cfg.llm.get('engine', cfg.llm.kind)})",
            "engine version": reported.get("version", "unrecorded"), "dtype": reported.get("dtype", dtype),
            "deterministic mode": reported.get("enable_deterministic_inference", "unrecorded"),
            "reproducible": is_reproducible(cfg)}


def differences(recorded: dict[str, Any], replay: dict[str, Any]) -> list[str]:
    return [f"{k}: {recorded[k]} in the run, {replay[k]} in the replay" for k in recorded
            if recorded[k] != replay.get(k) and "unrecorded" not in (recorded[k], replay.get(k))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=command("replay"), description=__doc__.split("\n\n")[0])
    parser.add_argument("run", help="a finished run's directory (with trajectories.pkl), or its storage url")
    parser.add_argument("--units", type=int, default=DEFAULT_UNITS, help=f"units picked at random (default "
                                                                          f"{DEFAULT_UNITS})")
    parser.add_argument("--all", action="store_true", help="replay every unit of the run")
    parser.add_argument("--pick-seed", type=int, default=None, help="which units --units picks (default: random)")
    parser.add_argument("--keep", default=None, metavar="DIR", help="run the replay into DIR and keep it")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="replay with these settings changed")
    args = parser.parse_intermixed_args(argv)
    from pipegen.run.store import StoreError
    from pipegen.transport.store_read import StoreRun

    try:
        with StoreRun(args.run, outputs=True) as read:  # a store url: the run read back from the store alone
            return _replay(args, read.root, args.run)
    except StoreError as e:
        print(f"pipegen replay: error: {e}", file=sys.stderr)
        return 2


def _replay(args: argparse.Namespace, run: Path, named: str) -> int:
    merged = run / "trajectories.pkl"
    if not (run / "conf" / "config.yaml").is_file() or not merged.is_file():
        print(f"pipegen replay: error: {named} holds no finished run with a merged trajectories.pkl (run it to the "
              f"end with generation.final_merge=true)", file=sys.stderr)
        return 2
    from verl import DataProto

    saved = OmegaConf.load(run / "conf" / "config.yaml")
    recorded = DataProto.load_from_disk(str(merged))
    units = sorted(units_of(recorded))
    chosen = units if args.all or args.units >= len(units) else sorted(
        random.Random(args.pick_seed).sample(units, args.units))
    with tempfile.TemporaryDirectory(prefix="pipegen-replay-") as scratch:
        out = Path(args.keep).resolve() if args.keep else Path(scratch) / "replay"
        rows = _rows_file(saved, {i for i, _ in chosen}, Path(scratch))
        overrides = [f"output_dir={out}", f"train_files=[{rows}]", "max_samples=-1", "generation.report=false",
                     "generation.upload_artifact=false", "generation.show_progress=false", "trainer.logger=[]",
                     *replay_overrides(saved), *args.overrides]
        print(f"pipegen replay: {len(chosen)} of {len(units)} units of {named}, with its recorded config"
              + (f" and {' '.join(args.overrides)}" if args.overrides else ""), flush=True)
        done = subprocess.run([sys.executable, "-m", "pipegen.launch", *overrides], capture_output=True, text=True,
                              stdin=subprocess.DEVNULL)
        if done.returncode != 0 or not (out / "trajectories.pkl").is_file():
            tail = "\n".join(done.stderr.strip().splitlines()[-5:])
            print(f"pipegen replay: error: the replay run failed (exit {done.returncode}):\n{tail}", file=sys.stderr)
            return 2
        replayed = DataProto.load_from_disk(str(out / "trajectories.pkl"))
        result = compare(recorded, replayed, chosen)
        changed = differences(_facts(run, saved), _facts(out, OmegaConf.load(out / "conf" / "config.yaml")))
    print(f"pipegen replay: {result.line()}")
    if result.first:
        print(f"  first difference: {result.first}")
    for line in changed:
        print(f"  differs from the run: {line}")
    if result.same < result.units and not changed and not _facts(run, saved)["reproducible"]:
        print("  the run was not made with generation.reproducible=true: its engine's numerics follow its batches")
    return 0 if result.same == result.units else 1


if __name__ == "__main__":
    sys.exit(main())

"""The Hugging Face dataset card of a Parquet export: `README.md` beside the data, with the YAML header the Hub
reads (`configs:` naming the data file, so `datasets.load_dataset(FOLDER)` loads it and the Hub's viewer shows
it, and its `license`) and the run's facts in its body: pipegen's version, the model by name (its Hub id where the
path says it, never a local path) and, where known, its revision, the prompts by file name, the sampling
settings, the config fingerprint (the run key), the counts, and the reward and length statistics of the run
report (pipegen/report/numbers.py: the same numbers as report.json), and how to load and upload it (with the
installed huggingface_hub's command, run from the card's folder). The card travels: it names no local path.
The license is `export.license` when set, else the model card's (a `license:` in the model folder's README.md;
the embedded SmolLM2's is known), else the card says it is not known and how to set it.

A README.md already in the folder that pipegen did not write is left alone (the card is then skipped, said in
one line): the export never overwrites a user's file.

Owns: the card's content. Must never: write anything but the one README.md, or compute a statistic itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig

from pipegen.distribution import DISTRIBUTION
from pipegen.config.schema import is_demo
from pipegen.inputs.models import SMOLLM2_FOLDER, SMOLLM2_HUB_ID, SMOLLM2_LICENSE, hub_cli
from pipegen.run.atomic import atomic_write_bytes
from pipegen.run.layout import RunDir

MARKER = "<!-- dataset card written by pipegen's export (python -m pipegen.export); it rewrites this file -->"


NO_LICENSE = "not known (the model folder has no card naming one); set export.license=ID and export again"


def pipegen_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:
        return "unknown"


def model_revision(path: str) -> str | None:
    """The model's revision where the path says it: a Hugging Face cache snapshot (`.../snapshots/<commit>`)."""
    parts = Path(path).parts
    if "snapshots" in parts:
        at = parts.index("snapshots")
        if at + 1 < len(parts) and at >= 1 and parts[at - 1].startswith("models--"):
            return parts[at + 1]
    return None


def model_name(path: str) -> str:
    """The model as a reader elsewhere finds it: its Hub id where the path is a Hugging Face cache snapshot
    (`.../models--ORG--NAME/snapshots/<commit>`) or the embedded SmolLM2's folder, else the folder's own name."""
    hub = next((p for p in Path(path).parts if p.startswith("models--")), None)
    if hub is not None:
        return f"`{hub.removeprefix('models--').replace('--', '/', 1)}`"
    folder = Path(path).name
    return (f"`{SMOLLM2_HUB_ID}` (pipegen's embedded copy)" if folder == SMOLLM2_FOLDER
            else f"`{folder}` (a local folder)")


def model_license(path: str) -> str | None:
    """The `license:` of the model card (README.md's YAML header) in the model folder, if it has one."""
    if Path(path).name == SMOLLM2_FOLDER:
        return SMOLLM2_LICENSE
    readme = Path(path) / "README.md"
    try:
        text = readme.read_text(errors="replace")
    except OSError:
        return None
    if not text.startswith("---"):
        return None
    try:
        header = yaml.safe_load(text[3:].partition("\n---")[0])
    except yaml.YAMLError:
        return None
    value = header.get("license") if isinstance(header, dict) else None
    return str(value) if value else None


def prompts_from(files: list[str]) -> str:
    if is_demo(files):
        return "pipegen's demo set (arithmetic problems shipped with pipegen)"
    return ", ".join(f"`{Path(f).name}`" for f in files)


def card_text(cfg: DictConfig, run: RunDir, export: Path, numbers: dict[str, Any]) -> str:
    """The card of the Parquet file `export`, from the run report's numbers."""
    data_file = Path(export).name
    rollout = cfg.actor_rollout_ref.rollout
    model = str(cfg.actor_rollout_ref.model.path)
    revision = model_revision(model)
    files = cfg.data.train_files
    files = [str(files)] if isinstance(files, str) else [str(f) for f in files]
    name = run.root.name
    license_id = cfg.export.license or model_license(model)
    header = {
        "pretty_name": f"pipegen trajectories: {name}",
        **({"license": str(license_id)} if license_id else {}),
        "tags": ["pipegen", "synthetic", "rollouts", "reinforcement-learning"],
        "configs": [{"config_name": "default", "data_files": [{"split": "train", "path": data_file}]}],
    }
    p = numbers["progress"]
    sampling = numbers["engine"]["sampling"]
    lines = ["---", yaml.safe_dump(header, sort_keys=False).rstrip(), "---", MARKER, "",
             f"# pipegen trajectories: {name}", "",
             f"One row per trajectory generated by pipegen {pipegen_version()} (distribution `{DISTRIBUTION}`, "
             f"installed from a checkout of pipegen with `pip install .`: no package index serves it) "
             f"(`{data_file}`; columns: index, sample, trajectory, uid, raw_prompt, response_text, "
             f"prompt_ids, response_ids, response_mask, rollout_log_probs, reward, finish_reason, then the dataset "
             f"row's fields).", "",
             "## The run", "",
             f"- pipegen version: {pipegen_version()}",
             f"- model: {model_name(model)}; revision: {f'`{revision}`' if revision else 'not known'}",
             f"- license: {f'`{license_id}`' if license_id else NO_LICENSE}",
             f"- engine: {numbers['engine']['llm']}; {numbers['engine'].get('reproducible', 'reproducible: not known')}",
             f"- prompts from: {prompts_from(files)}",
             f"- sampling: temperature {sampling['temperature']}, top_p {sampling['top_p']}, top_k "
             f"{sampling['top_k']}, n {sampling['n']} samples per prompt, responses up to "
             f"{sampling['response_length']} tokens, prompts up to {sampling['prompt_length']}, seed "
             f"{sampling['seed']}; agent loop {numbers['engine']['agent_loop'] or 'single_turn_agent'}",
             f"- config fingerprint (run key): `{run.run_key() or 'none'}` (the digest of conf/fingerprint.json, "
             f"or the run key it keeps once samples were added: model, tokenizer, data, sampling and scoring)",
             f"- counts: {p['rows_read']} rows, {p['committed']} of {p['units']} units committed, {p['failed']} failed",
             # which reward gave the scores (run/provenance.py; a rescored row names its own in reward_by)
             "- scored by: " + ("; ".join(f"{by} ({rows} rows)" for by, rows in numbers.get("scored_by", {}).items())
                                or "no reward"),
             "", "## Rewards and lengths", "",
             "| data source | rows | prompts | mean reward | 95% interval | "
             + " | ".join(f"pass@{k}" for k in range(1, numbers["n"] + 1))
             + " | at the length limit | length p50 | length p90 | length max |",
             "|---" * (9 + numbers["n"]) + "|"]
    for source, s in numbers["sources"].items():
        ci = s["reward_ci95"]
        passes = [str(s["pass_at_k"].get(str(k), {}).get("value", "–")) for k in range(1, numbers["n"] + 1)]
        length = s["response_length"]
        lines.append(f"| {source} | {s['rows']} | {s['prompts']} | {s['mean_reward']} | "
                     f"{f'[{ci[0]}, {ci[1]}]' if ci else '–'} | " + " | ".join(passes)
                     + f" | {s['at_length_limit']} ({s['at_length_limit_share']}) | {length.get('p50', '–')} | "
                     f"{length.get('p90', '–')} | {length.get('max', '–')} |")
    stats = numbers["statistics"]
    lines += ["", f"Interval: {stats['interval']}, resampling unit: {stats['resampling_unit']} "
                  f"({stats['draws']} draws, seed {stats['seed']}). pass@k: {stats['pass_at_k']}. Lengths in response "
                  f"tokens; the limit is {numbers['response_limit']}.", "",
              "## Load", "", "```python", "from datasets import load_dataset",
              "ds = load_dataset(\"path/to/this/folder\", split=\"train\")   # or \"USER/NAME\" once uploaded",
              "```", "", "## Upload", "", "From this folder:", "", "```bash",
              f"{hub_cli()} upload USER/NAME . . --repo-type dataset --include README.md --include {data_file}",
              "```", ""]
    return "\n".join(lines)


def write_card(cfg: DictConfig, run: RunDir, export: Path) -> Path | None:
    """Write the card beside `export` (a Parquet file); None when a README.md that pipegen did not write is there."""
    from pipegen.report.numbers import report_numbers

    path = run.export_card(export)
    if path.exists() and MARKER not in path.read_text(errors="replace"):
        return None
    numbers, _, _ = report_numbers(run)
    atomic_write_bytes(path, card_text(cfg, run, Path(export), numbers).encode())
    return path

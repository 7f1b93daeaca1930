"""Every pipegen key of the schema refuses a bad value before any process starts, in one line that names the
key and what it accepts; --help lists every key from the same schema."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipegen.launch.launcher import main as launch_main
from pipegen.config.schema import LLM_KINDS, KeyInfo, schema_keys

# Keys for which every value of their type is acceptable to the schema, with where they are checked instead.
NO_BAD_VALUE = {
    "llm.python": "any interpreter path; the launcher checks it runs SGLang before starting a server",
    "custom_reward_function.path": "any path; the launcher loads the function from it (tests/test_rewards.py)",
    "custom_reward_function.reward_kwargs": "any mapping of keyword arguments; a non-mapping is refused at launch",
    "reward.verifier_url": "any string; the launcher refuses one that is not an http(s) URL (tests/test_rewards.py)",
    "ray_kwargs.ray_init": "any mapping of ray.init's keyword arguments; Ray refuses one it does not take",
    "ray_kwargs.timeline_json_file": "any path (or null); Ray writes its timeline there",
    "actors.lengths_from": "any path; one that does not exist is refused at launch (below)",
}


def bad_values(info: KeyInfo) -> list[str]:
    """Override values the key must refuse."""
    rule, kind = info.rule, info.type_name
    out = []
    if rule.choices is not None:
        out.append("maybe" if any(isinstance(c, bool) for c in rule.choices) else "bogus")
    elif rule.auto_or_count:
        out += ["0", "many"]
    elif rule.items is not None:
        out.append("[bogus]")
    elif kind.startswith("list"):
        out.append("5")
    elif kind in ("int", "float", "Optional[int]"):
        out.append("abc")
    if rule.at_least is not None:
        out.append(str(int(rule.at_least) - 1))
    if rule.above is not None:
        out.append(str(rule.above))
    if rule.non_empty:
        out.append("[]" if kind.startswith("list") else "")
    return out


# One bad value per key (its rule's when it has one: a wrong type is refused the same way for every key, and
# keys without a rule still exercise that path); the llm.* keys of every kind, the rest once.
CASES = [(kind, info, bad_values(info)[-1]) for kind in LLM_KINDS for info in schema_keys(kind)
         if (kind == "cpu" or info.path.startswith("llm.")) and bad_values(info)]


def test_every_key_has_a_bad_value_or_a_reason() -> None:
    keys = {info.path for kind in LLM_KINDS for info in schema_keys(kind)}
    assert keys >= set(NO_BAD_VALUE)
    unchecked = {info.path for kind in LLM_KINDS for info in schema_keys(kind) if not bad_values(info)}
    assert unchecked == set(NO_BAD_VALUE)


@pytest.mark.parametrize("kind,info,bad", CASES, ids=[f"{k}:{i.path}={b}" for k, i, b in CASES])
def test_a_bad_value_fails_in_one_line_before_anything_starts(kind: str, info: KeyInfo, bad: str,
                                                             tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    args = [f"output_dir={out}", f"llm={kind}"]
    if kind == "external" and info.path != "llm.urls":
        args.append("llm.urls=[http://127.0.0.1:9]")
    if info.path.startswith("cluster.") and info.path != "cluster.kind":
        args.append("cluster=ray")  # keys of that kind only
    if info.path != "output_dir":
        args.append(f"{info.path}={bad}")
    else:
        args[0] = f"output_dir={bad}"
    assert launch_main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pipegen: error: "), err
    assert info.path in err[0] and (info.allowed() in err[0] or "must be set" in err[0]), err[0]
    assert not out.exists()  # nothing written, so no process could have started


def test_an_earlier_runs_lengths_that_are_not_there_are_refused_in_one_line(tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    assert launch_main([f"output_dir={out}", f"actors.lengths_from={tmp_path / 'gone'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "actors.lengths_from=" in err[0] and "no such run directory or file" in err[0], err
    assert not out.exists()


def test_help_lists_every_key_with_its_rule(capsys) -> None:
    assert launch_main(["--help"]) == 0
    text = capsys.readouterr().out
    for info in schema_keys("cpu"):
        assert f"  {info.path}=" in text and info.rule.help in text


# --- every key --help lists changes something ------------------------------------------------------------------
# A key that is accepted but that no code reads is a setting silently ignored. Each key --help lists is walked:
# the value set on the command line is the value the run saves (nothing overwrites it), the product reads it
# where its role runs, and each engine setting changes the servers pipegen starts.

# Keys whose value names something the launch resolves or loads, so a made-up value cannot go through
# composition alone: where each one's effect is tested instead.
RESOLVED_ELSEWHERE = {
    "output_dir": "the run directory every test launches into",
    "model_path": "tests/test_models.py (embedded, local folder, Hub id)",
    "train_files": "tests/test_your_job.py (a user's parquet files)",
    "tasks": "tests/test_tasks.py (a task's rows and rewards)",
    "custom_reward_function.path": "tests/test_rewards.py",
    "custom_reward_function.name": "tests/test_rewards.py",
    "custom_reward_function.reward_kwargs": "its entries are new keys (+custom_reward_function.reward_kwargs.NAME=..., "
                                            "tests/test_rewards.py)",
    "ray_kwargs.ray_init": "its entries are new keys (+ray_kwargs.ray_init.NAME=..., tests/test_seed_config.py)",
    "external.command": "tests/test_gateway.py (set instead of external.harness: the two exclude each other)",
    "actors.lengths_from": "an existing run directory or lengths file: the longtail bench's earlier-lengths case; a "
                           "missing one is refused (test_an_earlier_runs_lengths_that_are_not_there_...)",
}


def good_value(info: KeyInfo, default=None) -> str:
    """A value the key accepts that differs from `default` (the schema's when None), as typed on the command
    line."""
    rule, default = info.rule, info.default if default is None else default
    special = {"llm.urls": "[http://127.0.0.1:9]", "reward.verifier_url": "http://127.0.0.1:9/score",
               "external.harness": "mine:harness", "llm.python": "/usr/bin/python3", "llm.engine": "mine:Backend",
               "trainer.logger": "[console,file]",
               # true refuses the per_unit_seed=false this test sets beside it (a seed on every request)
               "generation.reproducible": "false",
               "llm.extra_args": "[--mine]", "llm.engine_args": "[--mine]", "llm.server_args": "[[--mine]]"}
    if info.path in special:
        return special[info.path]
    if rule.choices is not None:
        value = next((c for c in rule.choices if c != default and c is not None), default)
    elif rule.auto_or_count:
        value = 3 if str(default) == "auto" else "auto"
    elif isinstance(default, bool):
        value = not default
    elif isinstance(default, int) or info.type_name in ("int", "Optional[int]"):
        value = int(default or rule.at_least or 1) + 1
    elif isinstance(default, float) or info.type_name == "float":
        value = float(default or 1.0) * 2
    else:
        value = "mine"
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def _key_cases(kind: str) -> list[KeyInfo]:
    """The keys to walk for llm=kind: all of them once (under llm=cpu), each kind's llm.* keys, less those
    resolved elsewhere and those with one allowed value (nothing else to set: any other is refused above)."""
    return [i for i in schema_keys(kind) if i.path not in RESOLVED_ELSEWHERE
            and not (i.rule.choices is not None and len(i.rule.choices) < 2) and i.path not in ("llm.kind", "cluster.kind")
            and (kind == "cpu" or i.path.startswith("llm."))]


@pytest.mark.parametrize("kind", list(LLM_KINDS))
def test_every_key_a_user_sets_is_the_value_the_run_saves(kind: str) -> None:
    """Nothing between the command line and DIR/conf/config.yaml (task defaults, verl's interpolations, the
    engine choice) drops or overwrites a key the user set."""
    from omegaconf import OmegaConf

    from pipegen.config.compose import check_types, resolved
    from pipegen.launch.job import compose_job

    keys = _key_cases(kind)
    cluster = [i for i in keys if i.path.startswith("cluster.")]
    for group in ([i for i in keys if i not in cluster], cluster):  # cluster=ray's keys under cluster=ray
        if not group:
            continue
        base = compose_job(["output_dir=/tmp/walk", f"llm={kind}", *(["cluster=ray"] if group is cluster else []),
                            *(["llm.urls=[http://127.0.0.1:9]"] if kind == "external" else [])])
        wanted = {i.path: good_value(i, OmegaConf.select(resolved(base), i.path)) for i in group}
        argv = ["output_dir=/tmp/walk", f"llm={kind}", *(["cluster=ray"] if group is cluster else []),
                *(["llm.urls=[http://127.0.0.1:9]"] if kind == "external" else []),
                *(f"{k}={v}" for k, v in wanted.items())]
        cfg = compose_job(argv)
        check_types(cfg)
        saved = resolved(cfg)
        for path, typed in wanted.items():
            got = OmegaConf.select(saved, path)
            got = OmegaConf.to_container(got) if OmegaConf.is_config(got) else got
            assert OmegaConf.create({"v": got}) == OmegaConf.create(OmegaConf.from_dotlist([f"v={typed}"])), \
                (kind, path, typed, got)


PRODUCT = Path(__file__).resolve().parent.parent / "pipegen"


def _readers(path: str) -> list[str]:
    """Product modules outside config/ that read the key: by its full dotted name, its name as an attribute or a
    mapping key, or an interpolation in the shipped YAML."""
    import re

    leaf = path.rsplit(".", 1)[-1]
    pattern = re.compile(rf"\.{leaf}\b|[\"']{re.escape(leaf)}[\"']|{re.escape(path)}\b|\b{leaf}=")
    return [str(p.relative_to(PRODUCT)) for p in [*PRODUCT.rglob("*.py"), *PRODUCT.rglob("*.yaml")]
            if "config" not in p.relative_to(PRODUCT).parts[:1] and pattern.search(p.read_text())]


def test_every_key_is_read_where_its_role_runs() -> None:
    """A key added to the schema that no process reads would be accepted and ignored: this fails until some
    code outside config/ reads it."""
    keys = {i.path for kind in LLM_KINDS for i in schema_keys(kind)}
    unread = sorted(k for k in keys if not _readers(k))
    assert not unread, unread


# llm.* keys that the actors read (where to send, how long to wait, how many to send where the engine does not
# say), not the servers pipegen starts: test_every_key_is_read_where_its_role_runs covers them.
ACTOR_SIDE = {"llm.kind", "llm.urls", "llm.protocol", "llm.ready_timeout_s", "llm.request_timeout_s",
              "llm.stall_floor_s", "llm.stall_margin"}
ACTOR_SIDE_OF = {"cpu": {"llm.max_running_requests"}}  # the CPU server's own limit is llm.max_batch
GPUS = {"cpu": 0, "sglang": 4, "vllm": 4, "vllm-cpu": 0}  # vLLM's CPU-only keys change a machine without GPUs
# llm=vllm runs on GPUs or, without any, on the CPU: the keys of the other setup, which its --help line names
OTHER_SETUP = {"vllm": {"llm.num_servers", "llm.threads", "llm.cpu_kvcache_gib"},
               "vllm-cpu": {"llm.tp", "llm.gpu_memory_utilization"}}


@pytest.mark.parametrize("kind", list(GPUS))
def test_every_engine_key_changes_the_servers_pipegen_starts(kind: str) -> None:
    from omegaconf import OmegaConf

    from pipegen.config.compose import resolved
    from pipegen.launch.job import compose_job
    from pipegen.launch.servers import server_launches
    from pipegen.launch.world import plan_world

    setup, gpus, kind = kind, GPUS[kind], kind.split("-")[0]
    env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, range(gpus)))} if gpus else {"CUDA_VISIBLE_DEVICES": ""}

    def started(*overrides: str) -> str:
        """What the launch would start: the planned servers, each one's command line and environment."""
        llm = OmegaConf.to_container(resolved(compose_job(["output_dir=/tmp/walk", f"llm={kind}", *overrides])).llm,
                                     resolve=True)
        plan = plan_world(llm, "auto", env, count_devices=lambda: gpus, pick_port=lambda host: 1)
        return repr((plan.servers, server_launches(plan.servers, "/model", llm, 0)))

    default = started()
    skip = ACTOR_SIDE | ACTOR_SIDE_OF.get(kind, set()) | OTHER_SETUP.get(setup, set())
    keys = [i for i in schema_keys(kind) if i.path.startswith("llm.") and i.path not in skip]
    assert len(keys) >= 6
    same = [i.path for i in keys if started(f"{i.path}={good_value(i)}") == default]
    assert not same, same


def test_a_config_an_older_pipegen_saved_reads_each_key_it_lacks_as_the_schemas_default(tmp_path: Path) -> None:
    """Readers write `cfg.generation.preflight`, not a second default of their own: a run directory saved before
    a key existed reads it as the schema's default (config/schema.py's fill_defaults)."""
    from pipegen.config.compose import resolved
    from pipegen.launch.job import compose_job
    from pipegen.run.config import load_run_config, save_run_config
    from pipegen.run.layout import RunDir

    cfg = resolved(compose_job([f"output_dir={tmp_path}"]))
    del cfg.generation["preflight"], cfg["export"], cfg.llm["dtype"], cfg.actors["group_requests"]
    run = RunDir(tmp_path)
    save_run_config(run, cfg)
    back = load_run_config(run)
    assert back.generation.preflight is True and back.export.license is None and back.llm.dtype == "auto"
    assert back.actors.group_requests is True and back.output_dir == str(tmp_path)

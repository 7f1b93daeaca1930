"""A config file of one's own, passed the Hydra way: `--config-path DIR --config-name NAME` on the launch's command
line, as seed 000's `generation.yaml` is (its defaults list on verl's `ppo_trainer`, found through
`hydra.searchpath: [pkg://verl.trainer.config]`).

`expand` composes that file with Hydra as the seed's runner did (its defaults list and searchpath, the command
line's values of the keys it has applied so that its interpolations read them), then turns the keys the file
itself writes into overrides placed before the command line's: every one of them then goes where any override
goes (config/verl_keys.py honours or refuses each verl key in one line; pipegen's own keys are typed by its
schema), so nothing the file says is dropped unseen. The job's shape (`SHAPE`: samples per prompt, lengths,
temperature, seed, rows, model and data, under verl's names) is handed on as the composed config has it, written
or left to verl's defaults, so the file means in pipegen what it meant to verl. The other keys the file leaves to
its defaults list (the ~600 keys of verl's ppo_trainer: its critic, optimiser, checkpoints) are verl's defaults
for training, not the user's choice; pipegen's own defaults stand for them. A key the command line sets wins over the file's (the file's is dropped,
not reported as a disagreement). A value whose interpolations pipegen's config can resolve itself (`${now:...}`,
`${trainer.project_name}`, `${trainer.experiment_name}`) is handed on as written, so the plan line can say what
`${now:}` does to the run's folder; every other value is handed on resolved.

`pkg://verl.trainer.config` is read as verl's config folder on disk (config/compose.py's `verl_config_dir`), so
composing the file never imports verl. A relative DIR is relative to the working directory.

Owns: that expansion. Must never: import verl or torch, write a file, or hand on a key the file does not write.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from pipegen.config.overrides import DICT_KEYS, keys_set, parse, to_overrides

FLAGS = {"--config-path": "path", "-cp": "path", "--config-dir": "dir", "-cd": "dir", "--config-name": "name",
         "-cn": "name"}
VERL_SEARCHPATH = "pkg://verl.trainer.config"
# interpolations pipegen's own config resolves the same way, handed on as written
KEPT_AS_WRITTEN = re.compile(r"\$\{(now:[^}]*|trainer\.project_name|trainer\.experiment_name)\}")


def split_flags(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """({"path": DIR, "name": NAME}, the rest) from `--config-path DIR` / `--config-path=DIR` and their short
    forms. ValueError, one line, for a flag without its value."""
    flags: dict[str, str] = {}
    rest: list[str] = []
    args = iter(argv)
    for arg in args:
        flag, eq, value = arg.partition("=")
        if flag not in FLAGS:
            rest.append(arg)
            continue
        if not eq:
            value = next(args, "")
        if not value or value.startswith("-"):
            raise ValueError(f"{flag} needs a value: {flag} DIR (the folder) or --config-name NAME (NAME.yaml in it)")
        flags[FLAGS[flag]] = value
    return flags, rest


def _targets(key: str) -> set[str]:
    """The keys an override of `key` sets: itself, and pipegen's key it is translated to."""
    from pipegen.config.verl_keys import Same, ToLlm, handling

    rule = handling(key)
    out = {key}
    if isinstance(rule, Same):
        out.add(rule.key)
    elif isinstance(rule, ToLlm):
        out.update(f"llm.{k}" for k in rule.keys.values())
    return out


def _leaves(node: Any, prefix: str = "") -> list[str]:
    """The dotted keys a written YAML mapping sets (a kwargs mapping, or an empty one, counts as one value)."""
    out: list[str] = []
    for k, v in node.items():
        path = f"{prefix}{k}"
        if isinstance(v, dict) and v and str(k) not in DICT_KEYS:
            out += _leaves(v, path + ".")
        else:
            out.append(path)
    return out


def expand(argv: list[str]) -> list[str]:
    """The command line with `--config-path DIR --config-name NAME` replaced by the overrides of the keys
    NAME.yaml writes (see the module's header); the command line as it is without those flags. ValueError, one
    line, for a file that is missing or does not compose."""
    flags, rest = split_flags(argv)
    if not flags:
        return list(argv)
    if "name" not in flags:
        raise ValueError("--config-path DIR needs --config-name NAME: the file DIR/NAME.yaml")
    folder = Path(flags.get("path") or flags.get("dir") or ".").expanduser().resolve()
    name = flags["name"].removesuffix(".yaml")
    file = folder / f"{name}.yaml"
    if not file.is_file():
        raise ValueError(f"--config-name {name}: there is no {file}; give --config-path the folder that holds it")
    try:
        written = OmegaConf.to_container(OmegaConf.load(file), resolve=False)
    except Exception as e:  # noqa: BLE001 (a YAML error spans lines: its first one names the place)
        raise ValueError(f"{file} is not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(written, dict):
        raise ValueError(f"{file} holds no mapping of keys")
    cfg = _compose(folder, name, written)
    given = [p for p in map(parse, rest) if p is not None and not p.prefix]
    for p in given:  # the command line's values, so that the file's interpolations read them
        if OmegaConf.select(cfg, p.key, default=_ABSENT, throw_on_missing=False) is not _ABSENT:
            OmegaConf.update(cfg, p.key, p.value, merge=False)
    cli = set().union(*(_targets(k) for k in keys_set(rest))) if rest else set()
    unresolved = OmegaConf.to_container(cfg, resolve=False)
    values: dict[str, Any] = {}
    own = _leaves({k: v for k, v in written.items() if k not in ("defaults", "hydra")})
    for key in [*own, *(k for k in _shape_keys(cfg) if k not in own)]:
        unset = _at(written, key) == "???" or _missing(cfg, key) or (
            key not in own and OmegaConf.select(cfg, key, default=None, throw_on_missing=False) is None)
        if _targets(key) & cli or unset:
            continue  # the command line sets it; or `???` (or a shape key verl leaves null): pipegen's default
        text = _at(unresolved, key)
        if isinstance(text, str) and "${" in text and "${" not in KEPT_AS_WRITTEN.sub("", text):
            values[key] = text  # resolved by pipegen's own config, as written
            continue
        value = OmegaConf.select(cfg, key, default=None, throw_on_missing=False)
        values[key] = OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
    return [*_rendered(values), *rest]


_ABSENT = object()


def _at(tree: Any, key: str) -> Any:
    for part in key.split("."):
        tree = tree.get(part) if isinstance(tree, dict) else None
    return tree


def _missing(cfg: DictConfig, key: str) -> bool:
    parent, _, leaf = key.rpartition(".")
    node = OmegaConf.select(cfg, parent) if parent else cfg
    return OmegaConf.is_config(node) and OmegaConf.is_missing(node, leaf)


# pipegen's own free-form mappings (typed dicts of its schema): a key is added into them with `++`, as a user adds
# one with `+`; ray.init's keys left null are Ray's own defaults, so they are not handed on
OWN_MAPPINGS = ("custom_reward_function.reward_kwargs", "ray_kwargs.ray_init")


def _rendered(values: dict[str, Any]) -> list[str]:
    """Each key's override, a mapping value under a kwargs key as one value."""
    out: list[str] = []
    for key, value in values.items():
        if key in OWN_MAPPINGS and isinstance(value, dict):
            out += [f"++{o}" for o in _own_leaves(key, value, drop_null=key == "ray_kwargs.ray_init")]
        elif isinstance(value, dict) and not value:
            out.append(f"{key}={{}}")
        else:
            out += to_overrides({key: value})
    return out


def _own_leaves(prefix: str, value: dict, drop_null: bool) -> list[str]:
    out: list[str] = []
    for k, v in value.items():
        if isinstance(v, dict) and v:
            out += _own_leaves(f"{prefix}.{k}", v, drop_null)
        elif not (drop_null and (v is None or v == {})):
            out += to_overrides({f"{prefix}.{k}": v})
    return out


def _compose(folder: Path, name: str, written: dict) -> DictConfig:
    """The file composed as Hydra composes it for its own app, verl's searchpath read from disk."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from pipegen.config.compose import verl_config_dir

    hydra = written.get("hydra") or {}
    search = [f"file://{verl_config_dir()}" if str(s).rstrip("/") == VERL_SEARCHPATH else str(s)
              for s in (hydra.get("searchpath") or [])]
    overrides = [f"hydra.searchpath=[{','.join(search)}]"] if search else []
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(folder), version_base=None):
            cfg = hydra_compose(config_name=name, overrides=overrides)
    except Exception as e:  # noqa: BLE001 (Hydra's errors span lines: the first names the problem)
        first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
        raise ValueError(f"--config-name {name} does not compose: {first}"
                         + (f" (is {VERL_SEARCHPATH} in its hydra.searchpath?)" if "ppo_trainer" in first else ""))
    OmegaConf.set_struct(cfg, False)
    return cfg


def overrides_of(cfg: DictConfig) -> list[str]:
    """A composed config as the overrides that make it, for `pipegen.run_generation(cfg)`:
    - seed 000's, as `hydra.compose` gives it (verl's ppo_trainer and what its file and overrides set; no
      `output_dir`): every key whose value as written differs from verl's ppo_trainer's. A key verl's YAML
      interpolates from another (`critic.rollout_n: ${oc.select:actor_rollout_ref.rollout.n,1}`) is written the
      same in both, so it follows the key it reads instead of being set twice.
    - a run's own saved conf/config.yaml (pipegen's, resolved): its llm, cluster and streams kinds, then each of
      pipegen's keys and each verl key pipegen reads (`Read` in config/verl_keys.py) whose value differs from
      pipegen's defaults for those kinds. verl's keys pipegen sets from its own (rollout.n from n) follow them.
    Every override then goes where the command line's go, honoured or refused in one line."""
    from pipegen.config.verl_keys import Read, handling

    if "output_dir" not in cfg:  # the seed's
        given = OmegaConf.to_container(cfg, resolve=False)
        base = OmegaConf.to_container(_compose_verl_defaults(), resolve=False)
        values = {}
        shape = set(_shape_keys(cfg))
        for key in _leaves(given):
            if _missing(cfg, key):
                continue
            if (_at(given, key) != _at(base, key)
                    or key in shape and OmegaConf.select(cfg, key, default=None, throw_on_missing=False) is not None):
                value = OmegaConf.select(cfg, key, default=None, throw_on_missing=False)
                values[key] = OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
        return _rendered(values)
    from pipegen.config.compose import VERL_GROUPS, compose, resolved

    kinds = [f"{g}={cfg[g].kind}" for g in ("llm", "cluster", "streams") if OmegaConf.select(cfg, f"{g}.kind")]
    given = OmegaConf.to_container(cfg, resolve=True)
    base = OmegaConf.to_container(resolved(compose([f"output_dir={cfg.output_dir}", *kinds])), resolve=True)
    values = {}
    for key in _leaves(given):
        ours = key.split(".", 1)[0] not in VERL_GROUPS
        if key.endswith(".kind") and key.split(".", 1)[0] in ("llm", "cluster", "streams"):
            continue  # handed on first, as the group's choice
        if (ours or isinstance(handling(key), Read)) and (_at(given, key) != _at(base, key) or key == "output_dir"):
            values[key] = _at(given, key)
    return [*kinds, *_rendered(values)]


# The job's shape: pipegen's own keys under verl's names (config/verl_keys.py's `Same`), which a composed seed config
# always holds (verl's ppo_trainer gives each one a value: rollout.n 1, 512-token lengths, every row): they are
# handed on as the config has them, set or not, so the seed's config means in pipegen what it meant to verl.
SHAPE = ("n", "temperature", "max_prompt_length", "max_response_length", "seed", "max_samples", "model_path",
         "train_files")


def _shape_keys(cfg: DictConfig) -> list[str]:
    from pipegen.config.verl_keys import VERL_KEYS, Same

    return [k for k, rule in VERL_KEYS.items() if isinstance(rule, Same) and rule.key in SHAPE
            and OmegaConf.select(cfg, k, default=_ABSENT, throw_on_missing=False) is not _ABSENT]


def _compose_verl_defaults() -> DictConfig:
    """verl's ppo_trainer as it composes with nothing set: what seed 000's file is written on."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from pipegen.config.compose import verl_config_dir

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=verl_config_dir(), version_base=None):
        return hydra_compose(config_name="ppo_trainer")

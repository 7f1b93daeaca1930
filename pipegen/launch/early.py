"""The launch's refusals that need only the command line, made before the launcher imports anything heavy.

A config file (`--config-path/--config-name`, config/config_file.py) that is missing or does not compose, a
mistyped key of pipegen's, verl's key that pipegen refuses, or `llm=` that disagrees with
verl's `rollout.name` is refused here, in about the time Python and OmegaConf take to start; a mistyped key in
verl's groups after one composition of the defaults (config/compose.py's `unknown_verl_key`), and a model_path
that is a Hub id neither cached nor on the Hub after huggingface_hub's one look (inputs/models.py's
`unreachable_hub_id`: nothing is downloaded here). The launcher imports its roles' machinery (numpy, pydantic,
the run's readers, and later verl) only once these have passed. The same checks run again inside the launch's
composition and input resolution (launch/job.py), so nothing is refused here that those would accept.

Owns: that first look. Must never: compose the command line's config (job.py does; a config file is composed
alone, with Hydra), download a model, write a
file, or import verl, torch or numpy.
"""

from __future__ import annotations

from pipegen.config.compose import refuse_new_keys, unknown_key, unknown_verl_key
from pipegen.config.config_file import expand as expand_config_file
from pipegen.config.overrides import given
from pipegen.config.verl_keys import translate as translate_verl_keys
from pipegen.inputs.models import unreachable_hub_id
from pipegen.launch.engine_choice import choose_engine

def first_refusal(argv: list[str]) -> str:
    """One line refusing the command line, or '' (the launch goes on to compose it)."""
    try:
        overrides = translate_verl_keys(choose_engine(expand_config_file(list(argv))).overrides)
        refuse_new_keys(overrides)
    except ValueError as e:
        return str(e)
    model = given(overrides, "model_path")
    return (unknown_key(overrides) or unknown_verl_key(overrides)
            or (unreachable_hub_id(model) if model else ""))

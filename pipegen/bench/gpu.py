"""Scenario `gpu`: pipegen tokens/s vs SGLang's own offline benchmark on the same model and prompts.

Runs only where torch sees a CUDA GPU and SGLang is installed (`./launch.sh` installs the `sglang` extra
on GPU machines); otherwise the table says why it was skipped. The measurement itself is not written
yet: on a GPU machine it reports that, rather than a made-up figure.

Owns: the check for a GPU and SGLang, and this scenario's line in the table.
"""

from __future__ import annotations

from pipegen.bench.common import ScenarioResult

KEY = "gpu"
TITLE = "7. GPU: pipegen vs SGLang's offline benchmark"


def run(quick: bool) -> ScenarioResult:
    res = ScenarioResult(KEY, TITLE)
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except Exception:  # a broken torch install is also "no GPU" for this table
        has_gpu = False
    if not has_gpu:
        res.skipped = "no GPU"
        print("gpu: skipped: no GPU")
        return res
    import importlib.util

    if importlib.util.find_spec("sglang") is None:
        res.skipped = "a GPU is visible but SGLang is not installed (pip install 'pipegen[sglang]')"
        return res
    res.skipped = ("GPU and SGLang present, but this scenario is not implemented yet: compare "
                   "`python -m sglang.bench_serving --request-rate inf` with pipegen's actors on the same servers")
    return res

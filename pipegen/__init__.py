"""pipegen: offline LLM trajectory generation for verl. The command line is `python -m pipegen.launch`; the
Python entry is `pipegen.generate(output_dir, **keys)` / `pipegen.run_generation(cfg)` (pipegen/api.py)."""

from pipegen.api import GenerationError, GenerationResult, generate, run_generation

__all__ = ["GenerationError", "GenerationResult", "generate", "run_generation"]

"""Variant A of the tiny models, which only the tests use: the converted SmolLM2 tokenizer under a 2-layer random
``llama`` (Variant C, the tiny Qwen2 the benchmarks also run, is ``pipegen.bench.doubles.tiny_models``).

Must never: download anything, or leave a half-built folder under its final name.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from pipegen.bench.doubles.tiny_models import add_top_level_rope_theta
from pipegen.inputs.models import build_folder_once, quiet_progress_bars

TINY_LLAMA_SMOL_RECIPE = "tiny-llama-smol/v1"


def build_tiny_llama_smol(dest_dir: str, smol_dir: str) -> str:
    """Variant A: the converted SmolLM2 tokenizer (copied verbatim from ``smol_dir``) under a random 2-layer llama.

    ChatML without tools; use it for fast generic tests that want SmolLM2's real tokenizer. ``smol_dir`` is the
    folder returned by ``resolve_model_path("smollm2-135m")``.
    """
    src = Path(smol_dir)

    def build(out: Path) -> None:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        # Copy the tokenizer files instead of re-saving them, so the folder loads identically under 4.x and 5.x.
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                     "vocab.json", "merges.txt"):
            if (src / name).is_file():
                shutil.copyfile(src / name, out / name)
        tok = AutoTokenizer.from_pretrained(str(src))
        vocab = -(-len(tok) // 128) * 128
        cfg = AutoConfig.for_model(
            "llama", vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
            tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        with quiet_progress_bars():
            model.save_pretrained(str(out))
        add_top_level_rope_theta(out)

    return str(build_folder_once(Path(os.path.expanduser(dest_dir)), build, TINY_LLAMA_SMOL_RECIPE))

"""A tiny random-weight vision-language model of a real architecture (Qwen2-VL) with its processor, and a few
small images in verl's multimodal parquet layout, for tests that must not download anything.

Owns:
  * ``build_tiny_qwen2_vl`` - ``Qwen2VLForConditionalGeneration`` (1-block vision tower, 2 text layers) behind the
    tiny Qwen's trained byte-level BPE (``pipegen.bench.doubles.tiny_models._train_tokenizer``) plus Qwen2-VL's vision tokens, with
    ``Qwen2VLProcessor``'s image processor (14-pixel patches, 2x2 merge) and Qwen2-VL's published chat template;
  * ``tiny_vlm_path`` - that model built once into ``<pipegen cache>/models/tiny-qwen2-vl``;
  * ``write_image_parquet`` - rows in verl's multimodal layout: an ``images`` column of ``{"bytes", "path"}``
    PNGs, ``<image>`` in the prompt, ``extra_info.index``.

Must never: download anything, or be imported by product code (tests only: tests/support/).
"""

from __future__ import annotations

import io
import os
from pathlib import Path

from pipegen.inputs.models import build_folder_once, models_dir, quiet_progress_bars

TINY_VLM_FOLDER = "tiny-qwen2-vl"
TINY_VLM_RECIPE = "tiny-qwen2-vl/v3"  # bump when the produced bytes change
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]

# Qwen2-VL-Instruct's published chat template, verbatim.
QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in "
    "content or 'image_url' in content %}{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}"
    "Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] "
    "== 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}"
    "Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content "
    "%}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}"
)


def _build_into(out: Path) -> None:
    import torch
    from tokenizers import AddedToken
    from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from pipegen.bench.doubles.tiny_models import ENDOFTEXT, IM_END, IM_START, MODEL_VOCAB_SIZE, _train_tokenizer

    tk = _train_tokenizer()
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS])
    ids = {t: tk.token_to_id(t) for t in [ENDOFTEXT, IM_END, *VISION_TOKENS]}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token=None, eos_token=IM_END, pad_token=ENDOFTEXT, padding_side="left",
        model_max_length=8192, clean_up_tokenization_spaces=False, chat_template=QWEN2_VL_CHAT_TEMPLATE,
        extra_special_tokens={"image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
                              "vision_bos_token": "<|vision_start|>", "vision_eos_token": "<|vision_end|>"},
        additional_special_tokens=[IM_START, IM_END, *VISION_TOKENS])
    # small pictures stay small: 56x56 px is 4x4 patches of 14 px, merged 2x2 into 4 image tokens. Saved as
    # the published Qwen2-VL-Instruct folders are: preprocessor_config.json (the image processor, naming
    # Qwen2VLProcessor) beside the tokenizer and its chat template, no video config. The PIL class writes the
    # same config as the torchvision one, and the folder names the latter, which verl's hf_processor loads.
    image_processor = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=112 * 112, patch_size=14,
                                               merge_size=2, temporal_patch_size=2)
    image_processor.image_processor_type = "Qwen2VLImageProcessor"  # what either backend loads from
    image_processor.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))

    pad_id, eos_id = ids[ENDOFTEXT], ids[IM_END]
    cfg = Qwen2VLConfig(
        text_config=dict(vocab_size=MODEL_VOCAB_SIZE, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
                         bos_token_id=pad_id, eos_token_id=eos_id, pad_token_id=pad_id),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=128, num_heads=2, mlp_ratio=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, in_channels=3),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True, bos_token_id=pad_id, eos_token_id=eos_id, pad_token_id=pad_id,
    )
    # the published Qwen2-VL config.json files carry the vision tower's channels under both names, and SGLang
    # 0.5.12 reads `in_chans` (transformers writes only `in_channels`): without it SGLang cannot load the model
    cfg.vision_config.in_chans = cfg.vision_config.in_channels
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(cfg).to(torch.float32)
    model.generation_config = GenerationConfig(bos_token_id=pad_id, eos_token_id=[eos_id, pad_id],
                                               pad_token_id=pad_id)
    with quiet_progress_bars():
        model.save_pretrained(str(out))


def build_tiny_qwen2_vl(dest_dir: str) -> str:
    """Build the tiny Qwen2-VL (and its processor) into ``dest_dir`` once; returns its path."""
    return str(build_folder_once(Path(os.path.expanduser(dest_dir)), _build_into, TINY_VLM_RECIPE))


def tiny_vlm_path(cache_dir: str | None = None) -> str:
    """The tiny Qwen2-VL, built once into ``<cache>/models/tiny-qwen2-vl``."""
    return build_tiny_qwen2_vl(str(models_dir(cache_dir) / TINY_VLM_FOLDER))


def png_bytes(width: int, height: int, seed: int) -> bytes:
    """A small seeded RGB picture as PNG bytes."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, format="PNG")
    return buf.getvalue()


def write_image_parquet(path: str | os.PathLike[str], rows: int = 4) -> str:
    """``rows`` prompts in verl's multimodal layout (geo3k's): ``prompt`` with ``<image>``, ``images`` as
    ``[{"bytes": png, "path": None}]`` (the second row holds two pictures), ``extra_info.index``."""
    import pandas as pd

    sizes = [(56, 56), (84, 56), (56, 84), (70, 70)]
    records = []
    for i in range(rows):
        w, h = sizes[i % len(sizes)]
        images = [{"bytes": png_bytes(w, h, seed=i), "path": None}]
        content = f"<image>What shape is in picture {i}?"
        if i % 4 == 1:
            images.append({"bytes": png_bytes(56, 56, seed=100 + i), "path": None})
            content = f"Compare <image> and <image>, case {i}."
        records.append({
            "data_source": "tiny_vision",
            "prompt": [{"role": "user", "content": content}],
            "images": images,
            "ability": "vision",
            "reward_model": {"style": "rule", "ground_truth": str(i)},
            "extra_info": {"index": i, "split": "train"},
        })
    pd.DataFrame(records).to_parquet(path)
    return str(path)


if __name__ == "__main__":
    print(tiny_vlm_path())

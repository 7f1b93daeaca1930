"""Images in prompts: the model's processor, and what a run with images, videos or audio can use.

verl's RLHFDataset reads a multimodal row from its `images` / `videos` / `audios` columns (data.image_key,
video_key, audio_key) and `<image>` markers in the prompt; its agent loops render the placeholder spans with the
model's processor, read every picture through `qwen_vl_utils` (`process_vision_info`), send the pictures with the
token ids (`image_data`) and build `multi_modal_inputs`. pipegen loads that processor exactly as verl's trainer
does (`verl.utils.hf_processor(path, use_fast=True)`, which binds the model's rope index to it) and hands the one
object to the dataset, the agent loops and the writer's postprocessing; the CPU server's vision path loads its
image processor through `load_model_processor` too. Both the processor (transformers' Qwen2-VL image and video
processors) and `qwen_vl_utils` need torchvision, which pyproject.toml lists and launch.sh installs with the
torch it was built against.

What each engine takes (`check_media`, at launch, one line each, naming the column and the fix):
- images: SGLang's `/generate` and pipegen's CPU server (`image_data` beside `input_ids`); vLLM's
  `/v1/completions` with token ids takes none, so a vLLM run with an image column is refused;
- videos and audio: no engine pipegen speaks carries them yet, so a column holding any is refused;
- a model without a processor (a text-only model) given an image column is refused, with verl's reason when the
  model has a processor that could not be built (e.g. torchvision missing);
- so is an image column where qwen_vl_utils cannot be imported (a torch without its matching torchvision).

Owns: loading the processor, and the launch refusals for media. Must never: read the rows' pictures (a parquet
footer and the model folder are all it reads), or change what verl's dataset or agent loops compute.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

IMAGE_PROTOCOLS = ("sglang",)  # engines whose generate call carries image_data (the CPU server speaks sglang)
_PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")


class MediaError(ValueError):
    """A dataset's media that this run cannot use, as one line naming the column and the fix."""


def _model_path(cfg: DictConfig) -> str:
    model = cfg.actor_rollout_ref.model
    return str(model.get("tokenizer_path") or model.path)


def load_processor(cfg: DictConfig) -> Any | None:
    """The model's processor (None for a text-only model), as verl's trainer loads it."""
    processor, _ = _load(cfg)
    template = cfg.actor_rollout_ref.model.get("custom_chat_template")
    if processor is not None and template is not None:  # as verl's AgentLoopWorker sets it
        processor.chat_template = template
    return processor


def _load(cfg: DictConfig) -> tuple[Any | None, str]:
    return load_model_processor(_model_path(cfg), bool(cfg.actor_rollout_ref.model.trust_remote_code))


def load_model_processor(path: str, trust_remote_code: bool = False) -> tuple[Any | None, str]:
    """(verl's `hf_processor` for the model, or None; why none could be built: verl's warning, else "")."""
    from verl.utils import hf_processor

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        processor = hf_processor(path, trust_remote_code=trust_remote_code, use_fast=True)
    failed = [str(w.message) for w in caught if "Failed to create processor" in str(w.message)]
    return processor, " ".join(failed[0].split()) if failed else ""


def media_columns(cfg: DictConfig, files: list[str]) -> dict[str, str]:
    """{kind: column} for each media column (images, videos, audios) a parquet train file has (its footer only)."""
    import pyarrow.parquet as pq

    keys = {"images": str(cfg.data.get("image_key", "images")), "videos": str(cfg.data.get("video_key", "videos")),
            "audios": str(cfg.data.get("audio_key", "audios"))}
    found: dict[str, str] = {}
    for f in files:
        if not str(f).endswith(".parquet"):
            continue
        names = set(pq.read_schema(f).names)
        found.update({kind: column for kind, column in keys.items() if column in names})
    return found


def check_media(cfg: DictConfig, files: list[str], processor_loaded: tuple[Any | None, str] | None = None) -> Any:
    """Refuse, in one line, media this run cannot use (module docstring); returns the model's processor."""
    columns = media_columns(cfg, files)
    for kind, key in (("videos", "video_key"), ("audios", "audio_key")):
        if kind in columns:
            raise MediaError(
                f"train_files: column '{columns[kind]}' (data.{key}) holds {kind[:-1]} data, which no engine pipegen "
                f"speaks carries yet; drop the column (or point data.{key} at a column that does not exist)")
    processor, reason = processor_loaded or _load(cfg)
    if "images" not in columns:
        return processor
    column = columns["images"]
    if processor is None:
        model = _model_path(cfg)
        has_one = any((Path(model) / name).is_file() for name in _PROCESSOR_FILES)
        why = (f"its processor could not be built ({reason})" if has_one and reason
               else "it has no processor (a text-only model)")
        raise MediaError(
            f"train_files: column '{column}' (data.image_key) holds images, but the model {model} cannot read them: "
            f"{why}; use a vision-language model with its processor (e.g. Qwen2.5-VL), or drop the column")
    protocol = str(cfg.llm.protocol)
    if protocol not in IMAGE_PROTOCOLS and protocol != "auto":
        raise MediaError(
            f"train_files: column '{column}' (data.image_key) holds images, but llm.protocol={protocol} sends token "
            "ids to /v1/completions, which takes no images; serve the model with SGLang (llm=sglang) or pipegen's "
            "CPU server (llm=cpu), or drop the column")
    try:  # verl's dataset and agent loops read every picture through it; it imports torchvision at its top
        import qwen_vl_utils  # noqa: F401
    except Exception as e:  # noqa: BLE001  (missing, or a torchvision that does not match this torch)
        raise MediaError(
            f"train_files: column '{column}' (data.image_key) holds images, but verl reads pictures through "
            f"qwen_vl_utils, which cannot be imported here ({type(e).__name__}: {' '.join(str(e).split())}); install "
            "the torchvision that matches your torch, or drop the column") from None
    return processor

"""Images in prompts: the model's processor, and what a run with images, videos or audio can use.

verl's RLHFDataset reads a multimodal row from its `images` / `videos` / `audios` columns (data.image_key,
video_key, audio_key) and `<image>` markers in the prompt; its agent loops render the placeholder spans with the
model's processor, send the pictures with the token ids (`image_data`) and build `multi_modal_inputs`. pipegen
loads that processor exactly as verl's trainer does (`verl.utils.hf_processor(path, use_fast=True)`) and hands
the one object to the dataset, the agent loops and the writer's postprocessing; the CPU server's vision path
loads its image processor through `load_model_processor` too, so every `pixel_values` comes from one backend.

Without torchvision (a CPU-only torch: PyPI's torchvision links the CUDA build and fails to import beside it),
transformers 5 cannot build Qwen2-VL's processor at all: its default image processor and its video processor
both need torchvision, so verl's `hf_processor` returns None. Then, and only then, pipegen builds the model's
own processor class with transformers' PIL image backend (AutoImageProcessor's `backend="pil"`, e.g.
`Qwen2VLImageProcessorPil`) and without its video processor (`_images_only`; video columns are refused at
launch anyway), binds the model's rope index to it as verl's `hf_processor` does, and logs one line saying so.
The PIL backend resizes with PIL instead of torch: the same grids, but a resized picture's `pixel_values` differ
from the torchvision backend's by up to about one 8-bit level, so every consumer in a run uses this one object.

What each engine takes (`check_media`, at launch, one line each, naming the column and the fix):
- images: SGLang's `/generate` and pipegen's CPU server (`image_data` beside `input_ids`); vLLM's
  `/v1/completions` with token ids takes none, so a vLLM run with an image column is refused;
- videos and audio: no engine pipegen speaks carries them yet, so a column holding any is refused;
- a model without a processor (a text-only model) given an image column is refused, with the reason when the
  model has a processor that could not be built;
- so is an image column where qwen_vl_utils cannot be imported: verl's dataset and agent loops read every
  picture through it (`process_vision_info`), and it imports torchvision at its top (0.0.14, the newest), so
  a CPU-only torch cannot run images end to end yet even though the processor above loads.

Owns: loading the processor, and the launch refusals for media. Must never: read the rows' pictures (a parquet
footer and the model folder are all it reads), or change what verl's dataset or agent loops compute.
"""

from __future__ import annotations

import json
import logging
import types
import warnings
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

IMAGE_PROTOCOLS = ("sglang",)  # engines whose generate call carries image_data (the CPU server speaks sglang)
_PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")
# the constructor of the processors verl binds a rope index to (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, GLM-4V)
_IMAGE_TEXT_VIDEO = ("image_processor", "tokenizer", "video_processor")

log = logging.getLogger("pipegen.inputs")


class MediaError(ValueError):
    """A dataset's media that this run cannot use, as one line naming the column and the fix."""


def _model_path(cfg: DictConfig) -> str:
    model = cfg.actor_rollout_ref.model
    return str(model.get("tokenizer_path") or model.path)


def load_processor(cfg: DictConfig) -> Any | None:
    """The model's processor (None for a text-only model): verl's `hf_processor`, or without torchvision the
    same processor class on transformers' PIL image backend (module docstring)."""
    processor, _ = _load(cfg)
    return processor


def _load(cfg: DictConfig) -> tuple[Any | None, str]:
    return load_model_processor(_model_path(cfg), bool(cfg.actor_rollout_ref.model.trust_remote_code))


def load_model_processor(path: str, trust_remote_code: bool = False) -> tuple[Any | None, str]:
    """(the processor or None, why none could be built: verl's warning, plus the PIL fallback's error)."""
    from verl.utils import hf_processor

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        processor = hf_processor(path, trust_remote_code=trust_remote_code, use_fast=True)
    failed = [str(w.message) for w in caught if "Failed to create processor" in str(w.message)]
    reason = " ".join(failed[0].split()) if failed else ""
    if processor is not None or "torchvision" not in reason.lower():
        return processor, reason
    try:
        processor = _pil_processor(path, trust_remote_code)
    except Exception as e:  # noqa: BLE001  (the launch refusal names both reasons)
        return None, f"{reason}; without torchvision: {type(e).__name__}: {' '.join(str(e).split())}"
    log.info("%s: image processor %s (transformers' PIL backend, no video processor): torchvision cannot be "
             "imported here, so verl's hf_processor could not build the processor", path,
             type(processor.image_processor).__name__)
    return processor, ""


def _pil_processor(path: str, trust_remote_code: bool) -> Any:
    """The model's processor class on the PIL image backend without its video processor, bound as verl's
    `hf_processor` binds it (`config`, and the model's `get_rope_index` / `get_vision_position_ids`)."""
    from transformers import AutoConfig, AutoTokenizer
    from transformers.models.auto.image_processing_auto import AutoImageProcessor  # the top-level name needs torchvision
    from transformers.models.auto.modeling_auto import MODEL_MAPPING
    from transformers.models.auto.processing_auto import processor_class_from_name

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    cls = processor_class_from_name(_processor_class_name(path, config))
    if cls is None or cls.get_attributes() != list(_IMAGE_TEXT_VIDEO):
        raise ValueError(f"no images-only build for processor {cls.__name__ if cls else None}")
    images_only = _images_only(cls)
    processor_dict, init_kwargs = images_only.get_processor_dict(path, trust_remote_code=trust_remote_code)
    image_processor = AutoImageProcessor.from_pretrained(path, backend="pil", trust_remote_code=trust_remote_code)
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    processor = images_only.from_args_and_dict([image_processor, tokenizer], processor_dict, **init_kwargs)
    processor.config = config
    model_class = MODEL_MAPPING[type(config)]
    for name in ("get_rope_index", "get_vision_position_ids"):
        if hasattr(model_class, name):
            setattr(processor, name, types.MethodType(getattr(model_class, name), processor))
    return processor


def _processor_class_name(path: str, config: Any) -> str:
    """The folder's `processor_class`, else the model type's (AutoProcessor's order, less the tokenizer's)."""
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    for name in _PROCESSOR_FILES:
        file = Path(path) / name
        if file.is_file() and json.loads(file.read_text()).get("processor_class"):
            return str(json.loads(file.read_text())["processor_class"])
    return str(PROCESSOR_MAPPING_NAMES.get(config.model_type))


def _images_only(cls: type) -> type:
    """`cls` whose sub-processors are its image processor and tokenizer: transformers derives a processor's
    parts from its constructor's parameters, and these constructors require a video processor when they have
    the parameter. It keeps `cls`'s name, which verl matches on (`hf_processor`, the agent loops)."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):  # noqa: N807
        # cls's constructor hands (image, tokenizer, video) to ProcessorMixin, which keeps one per attribute
        cls.__init__(self, image_processor, tokenizer, chat_template=chat_template, **kwargs)

    return type(cls.__name__, (cls,), {"__init__": __init__, "__module__": __name__, "__qualname__": cls.__name__,
                                       "__doc__": f"{cls.__name__} with images and text only (no video)."})


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
    protocol = str(cfg.llm.get("protocol", "sglang"))
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

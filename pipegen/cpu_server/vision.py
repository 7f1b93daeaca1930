"""The CPU server's vision path: SGLang's `image_data` turned into what a Qwen2-VL-family model's forward takes.

A request's `input_ids` already hold the processor's placeholder spans (`<|image_pad|>` x the picture's merged
patch count, rendered by verl's agent loop); `image_data` holds the pictures (PNG data URLs, or bare base64).
The model's image processor turns them into `pixel_values` and `image_grid_thw`: the one pipegen's dataset, agent
loops and writer use (`inputs.media.load_model_processor`: verl's `hf_processor`), so the features are the
trainer's; the model's own `get_rope_index` gives each row's M-RoPE position ids
for the prefill and its `rope_delta`, with which every decoded token's position is `cached tokens + delta` on
all three axes (what transformers' own generate does).

Owns: decoding image_data, the prefill's vision inputs and per-row rope deltas.
Must never: touch the network (pictures are data, never URLs to fetch), or run outside the model backend's worker thread.
"""

from __future__ import annotations

import base64
import io
from typing import Any

from pipegen.cpu_server.errors import bad_request


def is_vision_model(config: Any) -> bool:
    return getattr(config, "vision_config", None) is not None and hasattr(config, "image_token_id")


def check_image_data(value: Any, batch_size: int) -> list[tuple[str, ...]]:
    """SGLang's `image_data` per prompt: a string or list of strings for one prompt, a list of those for a batch."""
    if value is None:
        return [()] * batch_size
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list):
        raise bad_request("image_data: expected a string or a list of strings (base64 or data URLs)")
    if batch_size == 1 and all(isinstance(v, str) for v in value):
        return [tuple(value)]
    if len(value) != batch_size:
        raise bad_request("The length of image_data should be equal to the batch size.")
    out = []
    for v in value:
        items = [v] if isinstance(v, str) else v
        if v is not None and not (isinstance(items, list) and all(isinstance(i, str) for i in items)):
            raise bad_request("image_data: each prompt's images are a list of strings (base64 or data URLs)")
        out.append(tuple(items or ()))
    return out


def decode_picture(item: str) -> Any:
    """A data URL or bare base64 picture as a PIL RGB image (never a path or URL to fetch)."""
    from PIL import Image

    data = item.split(",", 1)[1] if item.startswith("data:") else item
    try:
        image = Image.open(io.BytesIO(base64.b64decode(data, validate=False)))
        image.load()
    except Exception as e:  # noqa: BLE001  (any undecodable picture is the client's error)
        raise bad_request(f"image_data: not a base64 picture ({type(e).__name__}); send data URLs") from None
    return image.convert("RGB")


class VisionInputs:
    """The image processor and the model's rope index, for the model backend's prefill (worker thread only)."""

    def __init__(self, model: Any, model_path: str):
        from pipegen.inputs.media import load_model_processor

        self.model = model
        processor, why = load_model_processor(model_path)
        if processor is None:
            raise ValueError(f"{model_path}: a vision-language model whose processor could not be built ({why})")
        self.image_processor = processor.image_processor
        self.image_token_id = int(model.config.image_token_id)

    def prefill(self, ids: Any, mask: Any, images: list[tuple[str, ...]]) -> tuple[dict[str, Any], Any]:
        """(forward kwargs for the left-padded group `ids`/`mask`, each row's rope delta [B]).
        images: each row's image_data; the group's pictures in row order fill its placeholder spans."""
        import torch

        pictures = [decode_picture(item) for row in images for item in row]
        kwargs: dict[str, Any] = {}
        grid = None
        if pictures:
            processed = self.image_processor(images=pictures, return_tensors="pt")
            grid = processed["image_grid_thw"]
            kwargs.update(pixel_values=processed["pixel_values"], image_grid_thw=grid)
            merge = int(getattr(self.image_processor, "merge_size", 2)) ** 2
            want, have = int((grid.prod(-1) // merge).sum()), int((ids == self.image_token_id).sum())
            if want != have:
                raise ValueError(f"image_data: the pictures fill {want} image tokens, the prompt has {have}")
        token_types = (ids == self.image_token_id).to(torch.int32)
        positions, deltas = self.model.model.get_rope_index(ids, token_types, image_grid_thw=grid,
                                                            attention_mask=mask)
        kwargs["position_ids"] = positions
        return kwargs, deltas.reshape(-1)

    @staticmethod
    def decode_positions(text_positions: Any, deltas: Any) -> Any:
        """A decode step's M-RoPE positions [3, B, 1] from the rows' text positions [B, 1] and rope deltas [B]."""
        return (text_positions + deltas.view(-1, 1)).unsqueeze(0).expand(3, -1, -1)

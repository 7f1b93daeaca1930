"""Pictures and processor tensors in the run contract: how an image travels in a stream line and to an engine,
and how `multi_modal_inputs` (a dict of tensors per row) lies in a batch file.

In a shard line a trajectory's `multi_modal_data` holds its pictures as verl's agent loop had them after
`process_vision_info` (already resized to the processor's patch grid), each as lossless PNG:
`{"images": [{"png_base64": "..."}]}`. The writer decodes them to the same pixels and hands the row to verl's
own postprocessing, which rebuilds `multi_modal_inputs` and the M-RoPE position ids with the processor. Chosen
by size: a picture of W x H pixels costs its PNG (at most ~3 WH bytes, less for real photos) x 4/3 in the
line, where the processor's `pixel_values` would cost 4 bytes x 3 channels x 2 frames x WH (~8x more, as
float32 JSON text more still). The dataset row keeps each picture's place (`{"type": "image"}`) in
`raw_prompt`, not the picture again.

In a batch file a tensor-dict column (`multi_modal_inputs`) stores per row each tensor's name, dtype, shape and
raw bytes in Arrow's own list/struct/binary types: data only, read back as numpy arrays.

Owns: the image entry of a line, the engine's image_data form (a PNG data URL), the tensor-dict encoding.
Must never: import verl or torch (status and the export read batch files), or lose a pixel (PNG only).
"""

from __future__ import annotations

import base64
import io
from typing import Any, Final

import numpy as np
import pyarrow as pa

PNG_KEY: Final = "png_base64"
IMAGES: Final = "images"
MULTI_MODAL_INPUTS: Final = "multi_modal_inputs"  # verl's non-tensor column of the processor's tensors per row
MEDIA_TYPES: Final = ("image", "video", "audio")  # content parts of a chat message that carry media

TENSOR_DICT_TYPE: Final = pa.list_(pa.struct([
    ("name", pa.string()), ("dtype", pa.string()), ("shape", pa.list_(pa.int64())), ("data", pa.large_binary())]))


def encode_image(image: Any) -> dict[str, str]:
    """A PIL image as its line entry: RGB PNG bytes in base64."""
    buf = io.BytesIO()
    image.convert("RGB").save(buf, format="PNG")
    return {PNG_KEY: base64.b64encode(buf.getvalue()).decode("ascii")}


def decode_image(entry: dict[str, str]) -> Any:
    """A line entry back as the PIL RGB image it was made from (same pixels)."""
    from PIL import Image

    image = Image.open(io.BytesIO(base64.b64decode(entry[PNG_KEY])))
    image.load()
    return image.convert("RGB")


def image_data_url(image: Any) -> str:
    """A PIL image as SGLang's `image_data` item: a PNG data URL."""
    return "data:image/png;base64," + encode_image(image)[PNG_KEY]


def is_encoded(value: Any) -> bool:
    return isinstance(value, dict) and PNG_KEY in value


def encode_multi_modal_data(data: dict[str, Any] | None) -> dict[str, Any] | None:
    """verl's `multi_modal_data` ({"images": [PIL, ...]}) as the line holds it."""
    if not data:
        return data
    unknown = set(data) - {IMAGES}
    if unknown:  # videos and audio are refused at launch; one reaching here is a bug, never dropped silently
        raise ValueError(f"multi_modal_data holds {sorted(unknown)}: pipegen carries images only")
    return {IMAGES: [img if is_encoded(img) else encode_image(img) for img in data.get(IMAGES) or []]}


def decode_multi_modal_data(data: dict[str, Any] | None) -> dict[str, Any] | None:
    """The line's `multi_modal_data` as verl's agent loop had it (PIL images)."""
    if not data:
        return data
    return {**data, IMAGES: [decode_image(e) if is_encoded(e) else e for e in data.get(IMAGES) or []]}


def strip_media(messages: Any) -> Any:
    """Chat messages with each media content part reduced to its place (`{"type": "image"}`): what the line's
    `raw_prompt` keeps (the pictures themselves travel once, in the trajectory's multi_modal_data)."""
    if not _sequence(messages):
        return messages
    out = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if _sequence(content):
            parts = [{"type": part["type"]} if isinstance(part, dict) and part.get("type") in MEDIA_TYPES else part
                     for part in content]
            message = {**message, "content": parts}
        out.append(message)
    return out


def load_pictures(messages: Any) -> None:
    """Decode every picture of the messages now. verl's dataset opens them lazily (`Image.open`), and the n
    samples of a prompt share them: the first decode, run in two agent loops' threads at once, races inside PIL
    (an AssertionError in its decoder). Same pixels, decoded once."""
    for message in messages if _sequence(messages) else ():
        content = message.get("content") if isinstance(message, dict) else None
        for part in content if _sequence(content) else ():
            picture = part.get("image") if isinstance(part, dict) else None
            if hasattr(picture, "load"):
                picture.load()


def has_media(messages: Any) -> bool:
    return _sequence(messages) and any(
        isinstance(m, dict) and _sequence(m.get("content"))
        and any(isinstance(p, dict) and p.get("type") in MEDIA_TYPES for p in m["content"]) for m in messages)


def _sequence(value: Any) -> bool:
    """A list as a dataset row holds it (parquet lists read back as numpy object arrays)."""
    return isinstance(value, (list, tuple, np.ndarray))


# ---- tensor dicts in a batch file ----


def tensor_dict_column(values: np.ndarray) -> pa.Array:
    """An object column of dicts {name: array-like} (None for a row without) as one Arrow column."""
    rows = []
    for value in values:
        if value is None:
            rows.append(None)
            continue
        entries = []
        for name, tensor in value.items():
            arr = np.ascontiguousarray(tensor.numpy() if hasattr(tensor, "numpy") else np.asarray(tensor))
            entries.append({"name": str(name), "dtype": arr.dtype.str, "shape": list(arr.shape),
                            "data": arr.tobytes()})
        rows.append(entries)
    return pa.array(rows, type=TENSOR_DICT_TYPE)


def is_tensor_dict_column(values: np.ndarray) -> bool:
    """An object column whose values are all dicts of arrays/tensors (or None), at least one of them a dict."""
    seen = False
    for value in values:
        if value is None:
            continue
        if not isinstance(value, dict) or not all(hasattr(t, "shape") and hasattr(t, "dtype")
                                                  for t in value.values()):
            return False
        seen = True
    return seen


def read_tensor_dict_column(column: pa.Array) -> list[dict[str, np.ndarray] | None]:
    """The column back as one dict of numpy arrays per row (None where the row had none)."""
    if column.type != TENSOR_DICT_TYPE:
        raise ValueError(f"a tensor-dict column of type {column.type}")
    out: list[dict[str, np.ndarray] | None] = []
    for row in column.to_pylist():
        if row is None:
            out.append(None)
            continue
        out.append({e["name"]: np.frombuffer(e["data"], dtype=np.dtype(e["dtype"])).reshape(e["shape"]).copy()
                    for e in row})
    return out

"""Training-file resolution and the packaged demo data set.

Owns: turning the user's ``data.train_files`` value into a list of existing local files, including the short
name ``demo`` for the packaged arithmetic set ``pipegen/inputs/demo_arith.parquet`` (made by
``python -m pipegen.inputs.make_demo``).
Must never: download data, read the files' contents (verl's RLHFDataset does that), or import verl / torch.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from pipegen.config.schema import DEMO_NAME, DEMO_PARQUET, is_demo  # the config's names for the demo set

_FIX = "pass an existing parquet/json file, a list of them, or 'demo' for the packaged arithmetic set"


def _one(item: object, spec: object) -> str:
    if not isinstance(item, (str, os.PathLike)):
        raise ValueError(f"train_files={spec!r}: {item!r} is not a path; {_FIX}")
    text = os.fspath(item).strip()
    if text == DEMO_NAME:
        if not DEMO_PARQUET.is_file():
            raise ValueError(f"train_files=demo: {DEMO_PARQUET} is missing; regenerate it with "
                             "python -m pipegen.inputs.make_demo")
        return str(DEMO_PARQUET)
    path = os.path.expandvars(os.path.expanduser(text))
    if not os.path.exists(path):
        raise ValueError(f"train_files: no such file {text}; {_FIX}")
    if not os.path.isfile(path):
        raise ValueError(f"train_files: {text} is not a file; {_FIX}")
    # Absolute, because the files are opened later by other processes whose working directory may differ.
    return os.path.abspath(path)


def resolve_train_files(spec: str | os.PathLike[str] | Iterable[str | os.PathLike[str]]) -> list[str]:
    """Resolve ``data.train_files`` to a non-empty list of absolute paths of existing files.

    ``spec`` is ``"demo"`` (the packaged ``demo_arith.parquet``), a path, or a list of paths/``"demo"`` (a Hydra
    ``ListConfig`` works too); ``~`` and ``$VARS`` are expanded. Raises ValueError with a one-line message naming
    the missing file and the fix.
    """
    if spec is None:
        raise ValueError(f"train_files is not set; {_FIX}")
    items = [spec] if isinstance(spec, (str, os.PathLike)) else list(spec)
    if not items:
        raise ValueError(f"train_files is empty; {_FIX}")
    return [_one(item, spec) for item in items]


__all__ = ["DEMO_NAME", "DEMO_PARQUET", "is_demo", "resolve_train_files"]

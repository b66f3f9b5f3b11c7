"""The generation router's validation as unit calls: every refusal names its field, and
comes before any work (no tokenizer call, no engine call). The mesh path of a refusal
(the error table, INVALID_ARGUMENT with field violations) is checked once, end to end,
in test_generation_mesh.py."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from aimesh.llm.v1 import generation_pb2, sampling_pb2
from mesh import caller
from mesh.deployments import FileStore
from mesh.failures import InvalidInput
from services.generation.canary_rule import CanaryRule, CanaryRuleSettings
from services.generation.pipeline import Pipeline
from services.generation.servicer import GenerationRouter
from services.generation.versions import Pool, Versions
from services.llm.settings import LlmSettings
from tests.services.llm.conftest import MAX_BATCH, MAX_SEQ_LEN, unlimited_meter

pytestmark = pytest.mark.unit

Constraint = sampling_pb2.OutputConstraint


class NoWork:
    """Tokenizer and engine both: any call past validation fails the test. Options are
    judged as the prefill+decode engine judges them (it supports every one)."""

    unsupported = Pipeline.unsupported

    def __getattr__(self, name: str):
        raise AssertionError(f"{name} called for a request validation should refuse")


BAD_REQUESTS = [
    ({"prompt": ""}, "prompt"),
    (
        {"prompt": "hi", "stopping": sampling_pb2.StoppingCriteria(max_new_tokens=0)},
        "stopping.max_new_tokens",
    ),
    (
        {"prompt": "hi", "stopping": sampling_pb2.StoppingCriteria(max_new_tokens=-3)},
        "stopping.max_new_tokens",
    ),
    (
        {"prompt": "hi", "stopping": sampling_pb2.StoppingCriteria(max_new_tokens=10**6)},
        "stopping.max_new_tokens",
    ),
    (
        {"prompt": "hi", "sampling": sampling_pb2.SamplingParameters(temperature=-0.5)},
        "sampling.temperature",
    ),
    (
        {"prompt": "hi", "sampling": sampling_pb2.SamplingParameters(temperature=math.nan)},
        "sampling.temperature",
    ),
    ({"prompt": "hi", "sampling": sampling_pb2.SamplingParameters(top_p=0.0)}, "sampling.top_p"),
    ({"prompt": "hi", "sampling": sampling_pb2.SamplingParameters(top_p=1.5)}, "sampling.top_p"),
    ({"prompt": "hi", "sampling": sampling_pb2.SamplingParameters(top_k=-1)}, "sampling.top_k"),
    (
        {
            "prompt": "hi",
            "sampling": sampling_pb2.SamplingParameters(logprobs=True, top_logprobs=21),
        },
        "sampling.top_logprobs",
    ),
    (
        {"prompt": "hi", "sampling": sampling_pb2.SamplingParameters(top_logprobs=-1)},
        "sampling.top_logprobs",
    ),
    (
        {"prompt": "hi", "sampling": sampling_pb2.SamplingParameters(top_logprobs=2)},
        "sampling.top_logprobs",
    ),
    ({"prompt": "hi", "sampling": sampling_pb2.SamplingParameters(n=17)}, "sampling.n"),
    ({"prompt": "hi", "sampling": sampling_pb2.SamplingParameters(n=2**32 - 1)}, "sampling.n"),
    ({"prompt": "hi", "model": "gpt-17"}, "model"),
    (
        {"prompt": "hi", "sampling": sampling_pb2.SamplingParameters(repetition_penalty=1e-30)},
        "sampling.repetition_penalty",
    ),
    ({"prompt": "hi", "request_id": "é"}, "request_id"),
    (
        {"prompt": "hi", "sampling": sampling_pb2.SamplingParameters(choices=["a", "a"])},
        "sampling.choices",
    ),
    (
        {"prompt": "hi", "sampling": sampling_pb2.SamplingParameters(choices=["a", ""])},
        "sampling.choices[1]",
    ),
    (
        {
            "prompt": "hi",
            "sampling": sampling_pb2.SamplingParameters(
                choice_token_ids=[sampling_pb2.TokenIds(ids=[1])]
            ),
        },
        "sampling.choice_token_ids",
    ),
    (
        {
            "prompt": "hi",
            "sampling": sampling_pb2.SamplingParameters(choices=["a"]),
            "stopping": sampling_pb2.StoppingCriteria(ignore_eos=True),
        },
        "stopping.ignore_eos",
    ),
    *[
        (
            {"prompt": "hi", "sampling": sampling_pb2.SamplingParameters(constraint=constraint)},
            field,
        )
        for constraint, field in [
            (Constraint(json_schema="{not json"), "sampling.constraint.json_schema"),
            (Constraint(json_schema='{"type": "nonsense"}'), "sampling.constraint.json_schema"),
            (Constraint(json_schema="[1, 2]"), "sampling.constraint.json_schema"),
            (Constraint(json_schema=""), "sampling.constraint.json_schema"),
            (Constraint(json_schema=" " * (64 * 1024 + 1)), "sampling.constraint.json_schema"),
            (
                Constraint(json_schema='{"$ref": "#/$defs/missing"}'),
                "sampling.constraint.json_schema",
            ),
            (Constraint(regex="(unclosed"), "sampling.constraint.regex"),
            (Constraint(lark_grammar="start: undefined_rule"), "sampling.constraint.lark_grammar"),
            (Constraint(json_object=False), "sampling.constraint.json_object"),
            (Constraint(json_schema="[" * 5000 + "]" * 5000), "sampling.constraint.json_schema"),
            (
                Constraint(json_schema='{"anyOf": [' * 300 + "{}" + "]}" * 300),
                "sampling.constraint.json_schema",
            ),
        ]
    ],
    (
        {
            "prompt": "hi",
            "sampling": sampling_pb2.SamplingParameters(
                choices=["a"], constraint=Constraint(json_object=True)
            ),
        },
        "sampling.constraint",
    ),
    (
        {
            "prompt": "hi",
            "sampling": sampling_pb2.SamplingParameters(constraint=Constraint(regex="a+")),
            "stopping": sampling_pb2.StoppingCriteria(ignore_eos=True),
        },
        "stopping.ignore_eos",
    ),
]


class Metadata:
    """The one part of a call's context validation reads."""

    def __init__(self, *pairs: tuple[str, str]) -> None:
        self.pairs = pairs

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self.pairs


def router_of_no_work(registry: Path) -> GenerationRouter:
    """A router whose own model "m" runs on NoWork, with an empty registry."""
    router = GenerationRouter(
        LlmSettings(max_seq_len=MAX_SEQ_LEN, max_batch_size=MAX_BATCH),
        CanaryRule(CanaryRuleSettings()),
        unlimited_meter(),
    )
    router.versions = Versions(
        store=FileStore(registry),
        own=Pool("m", "", NoWork(), NoWork(), NoWork()),
        channels=NoWork(),
        tls=None,
        poll_interval_s=1.0,
        warm_timeout_s=1.0,
        warm_up=NoWork(),
        watch=NoWork(),
        unwatch=NoWork(),
    )
    return router


@pytest.mark.parametrize(("request_fields", "field"), BAD_REQUESTS)
async def test_bad_input_is_refused_naming_the_field(request_fields, field, tmp_path):
    router = router_of_no_work(tmp_path / "deployments.json")
    request = generation_pb2.GenerateRequest(**request_fields)
    with pytest.raises(InvalidInput) as refused:
        async for _ in router.Generate(request, Metadata()):
            pass
    assert field in {violation.field for violation in refused.value.violations}


async def test_a_user_id_past_its_limit_is_refused_naming_the_metadata(tmp_path):
    router = router_of_no_work(tmp_path / "deployments.json")
    request = generation_pb2.GenerateRequest(prompt="hi")
    with pytest.raises(InvalidInput) as refused:
        async for _ in router.Generate(
            request, Metadata((caller.USER_METADATA_KEY, "u" * (caller.MAX_USER_BYTES + 1)))
        ):
            pass
    assert [v.field for v in refused.value.violations] == [f"metadata {caller.USER_METADATA_KEY}"]

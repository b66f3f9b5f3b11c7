"""The generation router's Triton option without a Triton server: its settings, the
stop-sequence holdback it puts on Triton's token stream, and its detokenizer stream at
its deadline (tests/triton runs the rest)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from pydantic import ValidationError

from aimesh.tokenizer.v1 import tokenizer_pb2_grpc
from mesh.client import create_channel
from mesh.config import MeshSettings
from services.generation.on_triton import Holdback
from services.generation.servicer import RouterOptions
from services.generation.text import TOKENIZER, Detokenizer


def test_triton_and_its_section_go_together():
    with pytest.raises(ValidationError, match="go together"):
        RouterOptions(backend="triton")
    with pytest.raises(ValidationError, match="go together"):
        RouterOptions.model_validate({"triton": {"model": "text_generation"}})
    assert RouterOptions().backend == "disaggregated"


def test_the_option_arrives_from_the_environment(monkeypatch):
    prefix = "AIMESH_SERVICES__GENERATION__OPTIONS__"
    monkeypatch.setenv(prefix + "BACKEND", "triton")
    monkeypatch.setenv(prefix + "TRITON__URL", "triton.aimesh.svc:8001")
    monkeypatch.setenv(prefix + "TRITON__MODEL", "text_generation")
    monkeypatch.setenv(prefix + "TRITON__TIMEOUT_S", "300")
    options = RouterOptions.model_validate(MeshSettings().service("generation").options)
    assert options.triton is not None
    assert (options.triton.url, options.triton.model, options.triton.timeout_s) == (
        "triton.aimesh.svc:8001",
        "text_generation",
        300,
    )


def feed(holdback: Holdback, pieces: list[str]) -> tuple[list[int], str]:
    ids: list[int] = []
    text = ""
    for token, piece in enumerate(pieces):
        released, released_text = holdback.feed(token, piece)
        ids += released
        text += released_text
        if holdback.stopped:
            break
    return ids, text


def test_without_stop_sequences_every_token_passes_at_once():
    holdback = Holdback(())
    assert holdback.feed(7, "Hi") == ([7], "Hi")
    assert holdback.feed(8, "") == ([8], "")
    assert not holdback.stopped and holdback.generated == 2


def test_text_that_may_start_a_stop_sequence_waits_and_a_stop_is_never_shown():
    holdback = Holdback(("</s>",))
    ids, text = feed(holdback, ["Paris", " is", " nice", "</", "s", ">", " more"])
    assert holdback.stopped
    assert (ids, text) == ([0, 1, 2], "Paris is nice")
    assert holdback.generated == 6, "the stop sequence's tokens were generated"


def test_a_prefix_that_does_not_become_a_stop_is_released_in_order():
    holdback = Holdback(("STOP",))
    assert holdback.feed(0, "a") == ([0], "a")
    assert holdback.feed(1, "ST") == ([], "")
    assert holdback.feed(2, "O") == ([], "")
    assert holdback.feed(3, "ry") == ([1, 2, 3], "STOry")
    assert not holdback.stopped and holdback.rest() == ([], "")


def test_what_is_held_when_the_stream_ends_comes_out_with_rest():
    holdback = Holdback(("\n\n",))
    ids, text = feed(holdback, ["end", "\n"])
    assert (ids, text) == ([0], "end")
    assert holdback.rest() == ([1], "\n")
    assert holdback.rest() == ([], "")


async def test_a_detokenizer_stream_past_its_deadline_reports_deadline_exceeded(serve_process):
    """Its deadline ends a margin before the caller's: the caller's next token meets a
    finished stream, and must learn why (DEADLINE_EXCEEDED), not "RPC already finished"."""
    tokenizer = await serve_process("tokenizer")
    async with create_channel(tokenizer.target, MeshSettings(), services=[TOKENIZER]) as channel:
        call = tokenizer_pb2_grpc.TokenizerServiceStub(channel).DetokenizeStream(timeout=1.0)
        detokenizer = Detokenizer(call)
        await detokenizer.open("late")
        assert await detokenizer.push([504]) != ""
        await asyncio.sleep(1.5)
        with pytest.raises(grpc.aio.AioRpcError) as late:
            await detokenizer.push([3575])
    assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

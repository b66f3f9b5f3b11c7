"""The generation router's Triton option without a server: its settings, and the
stop-sequence holdback it puts on Triton's token stream (tests/triton runs the rest)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from mesh.config import MeshSettings
from services.generation.on_triton import Holdback
from services.generation.servicer import RouterOptions


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

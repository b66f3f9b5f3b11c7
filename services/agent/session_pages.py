"""GetSession a page at a time: a long session is read in pages bounded by count and by
bytes, so no response meets a client's receive limit (gRPC's default is 4 MiB) however
many turns the session has or however long one answer is.

A page token is where the last page ended (its last turn's start and run id, the order
turns are kept in), opaque to the client: turns answered after the first page was read
still appear on a later page, and a turn is never listed twice.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re

from aimesh.agent.v1 import agent_pb2
from mesh.validation import Violations
from services.agent.run_store import Turn, TurnKey

DEFAULT_PAGE_TURNS = 20
MAX_PAGE_TURNS = 100
# Turns' bytes per page: a quarter of gRPC's default receive limit, the rest headroom.
MAX_PAGE_BYTES = 1024 * 1024
# A page token is a float and a run id in JSON, base64: far below this.
MAX_TOKEN_BYTES = 256
# What a repeated Turn field costs beyond the Turn itself: its tag and length.
_FIELD_OVERHEAD = 6
_RUN_ID = re.compile(r"[0-9a-f]{32}")


def page_token(key: TurnKey) -> str:
    raw = json.dumps([key.created_at, key.run_id], separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode()


def _parsed_token(token: str) -> TurnKey | None:
    try:
        created_at, run_id = json.loads(base64.urlsafe_b64decode(token.encode()))
    except (binascii.Error, ValueError, TypeError):
        return None
    if not isinstance(created_at, (int, float)) or isinstance(created_at, bool):
        return None
    if not math.isfinite(created_at) or not isinstance(run_id, str):
        return None
    return TurnKey(float(created_at), run_id) if _RUN_ID.fullmatch(run_id) else None


def checked(
    request: agent_pb2.GetSessionRequest, violations: Violations
) -> tuple[int, TurnKey | None]:
    """The request's page size (its default resolved) and where its page starts (None:
    the first turn); a violation for each field that is out of bounds."""
    violations.in_range(request.page_size, "page_size", 0, MAX_PAGE_TURNS)
    after = None
    if request.page_token:
        token = request.page_token
        after = _parsed_token(token) if len(token) <= MAX_TOKEN_BYTES else None
        violations.check(
            after is not None, "page_token", "must be a next_page_token GetSession returned"
        )
    return request.page_size or DEFAULT_PAGE_TURNS, after


def _message(turn: Turn) -> agent_pb2.Turn:
    return agent_pb2.Turn(
        run_id=turn.run_id,
        question=turn.question,
        answer=turn.answer,
        state=turn.state,
        created_at=turn.created_at,
    )


def _cut_to_fit(message: agent_pb2.Turn, budget: int) -> None:
    """Cuts the answer (at a character's edge) so the turn takes at most `budget` bytes."""
    answer = message.answer.encode()
    message.answer = ""
    room = max(0, budget - message.ByteSize() - _FIELD_OVERHEAD - 8)  # 8: the answer's tag
    message.answer = answer[:room].decode(errors="ignore")
    message.answer_truncated = True


def page(turns: list[Turn], size: int) -> agent_pb2.GetSessionResponse:
    """The response for `turns` (at most size + 1 of them, read after the request's
    token): the first `size` that fit in MAX_PAGE_BYTES, and the token of the next page
    when any turn is left over. The first turn always goes in, its answer cut to fit if
    it alone is too large."""
    response = agent_pb2.GetSessionResponse()
    used = 0
    for turn in turns[:size]:
        message = _message(turn)
        cost = message.ByteSize() + _FIELD_OVERHEAD
        if used + cost > MAX_PAGE_BYTES:
            if response.turns:
                break
            _cut_to_fit(message, MAX_PAGE_BYTES)
            cost = message.ByteSize() + _FIELD_OVERHEAD
        response.turns.append(message)
        used += cost
    if len(response.turns) < len(turns):
        last = response.turns[-1]
        response.next_page_token = page_token(TurnKey(last.created_at, last.run_id))
    return response

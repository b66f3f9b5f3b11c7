"""API keys: a file of sha256 digests, each naming a tenant and its scopes, re-read when
it changes (a rotated key works, and a revoked one stops, without a restart).

One key model for every door: the edge's authorizer (mesh/edge/authorizer.py) and the
OpenAI gateway (services/gateway/keys.py, which adds per-tenant limits in the same file)
read the same format, so one file can serve both. The file holds only digests, so it can
live in a Kubernetes Secret or a repo without handing out keys; a key itself is never
stored, compared or logged, only its digest. JSON (`{"keys": [...]}`) or TOML
(`[[keys]]`), chosen by the file's suffix:

    [[keys]]
    sha256 = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
    tenant = "acme"
    scopes = ["read", "generate", "embed"]

Scopes: `read` (search, list), `generate` (text, agent runs, tool calls), `embed`
(embeddings, rerank), `images` (diffusion), `write` (create collections, upsert, delete),
`admin` (operations on the mesh itself).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

log = logging.getLogger(__name__)

Scope = Literal["read", "generate", "embed", "images", "write", "admin"]
ALL_SCOPES: frozenset[str] = frozenset(Scope.__args__)  # type: ignore[attr-defined]
T = TypeVar("T")
P = TypeVar("P")


class KeyEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    tenant: str = Field(min_length=1, max_length=128, pattern=r"^[\x21-\x7e]+$")
    scopes: list[Scope]


@dataclass(frozen=True)
class Principal:
    """Who a request is for: the tenant its key belongs to and what it may do (how much,
    the meter knows: mesh/metering.py)."""

    tenant: str
    scopes: frozenset[str]


def digest(key: str) -> str:
    """What the file stores for `key`."""
    return hashlib.sha256(key.encode()).hexdigest()


def bearer_key(headers: Mapping[str, str]) -> str | None:
    """The key of `authorization: Bearer KEY`; None without one."""
    scheme, _, key = headers.get("authorization", "").partition(" ")
    return key.strip() or None if scheme.lower() == "bearer" else None


def read_key_file(path: Path) -> Any:
    text = path.read_text()
    return tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)


class WatchedFile(Generic[T]):
    """`parse` of one file, re-read on the first look after the file changed. A file that
    does not parse leaves the last good parse in force (and says so in the log, naming no
    value), so a half-written rotation never locks every tenant out; a missing file is
    `empty`."""

    def __init__(
        self, path: Path, parse: Callable[[Any], T], empty: T, *, kind: str = "API key file"
    ) -> None:
        self.path = path
        self._parse = parse
        self._empty = empty
        self.kind = kind
        self._seen: tuple[int, int, int] | None = None
        self._current = empty

    def _stamp(self) -> tuple[int, int, int] | None:
        try:
            stat = os.stat(self.path)
        except FileNotFoundError:
            return None
        return stat.st_ino, stat.st_mtime_ns, stat.st_size

    def current(self) -> T:
        stamp = self._stamp()
        if stamp == self._seen:
            return self._current
        self._seen = stamp
        if stamp is None:
            log.error("%s is missing", self.kind, extra={"path": str(self.path)})
            self._current = self._empty
            return self._current
        try:
            self._current = self._parse(read_key_file(self.path))
        except (OSError, ValueError, ValidationError) as error:
            # ValidationError names fields and positions, never a value that could be a key.
            log.error(
                "%s did not parse; what was read before stays in force",
                self.kind,
                extra={"path": str(self.path), "problem": type(error).__name__},
            )
            return self._current
        log.info("%s loaded", self.kind, extra={"path": str(self.path)})
        return self._current


class KeyFile(BaseModel):
    """The keys of a file; its `tenants` tables are the meter's (mesh/metering.py, when the
    file is also [limits] tenants_file), not read here."""

    model_config = ConfigDict(extra="forbid")

    keys: list[KeyEntry] = Field(default_factory=list)
    tenants: dict[str, Any] = Field(default_factory=dict)


def _principals(data: Any) -> dict[str, Principal]:
    parsed = KeyFile.model_validate(data)
    return {e.sha256: Principal(e.tenant, frozenset(e.scopes)) for e in parsed.keys}


class KeyStore(Generic[P]):
    """The principals of one key file, by key; `principals` parses the file (a reader
    that needs more of it, such as the gateway's limits, brings its own)."""

    def __init__(self, path: Path, principals: Callable[[Any], dict[str, P]] = _principals) -> None:
        self._file = WatchedFile(path, principals, {})

    def lookup(self, key: str | None) -> P | None:
        """The principal `key` stands for; None for no key or an unknown one."""
        principals = self._file.current()
        return None if key is None else principals.get(digest(key))

"""Prefill engine: one prompt at a time on the model thread, KV kept under a lease.

The KV of a prefilled prompt stays here until the decode worker has pulled it and calls
Release, or until its lease runs out, so a decoder that crashed mid-pull cannot leak
this worker's memory. The store has a byte budget; past it, Prefill is refused with
RESOURCE_EXHAUSTED rather than letting memory grow without bound.

A handle's id is made here (128 random bits), never by a caller, and the KV is bound to
the client its Prefill was for (`x-aimesh-client`, mesh/caller.py): a Pull or Release for
another client finds nothing, as if the id were unknown.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mesh.failures import NotFound, Overloaded
from services.llm import metrics
from services.llm.kv_codec import KvState, kv_nbytes, kv_tokens
from services.llm.kv_transfer import new_handle_id
from services.llm.llama import Llama
from services.llm.sampling import SamplingParams, sample
from services.prefill.prefix_cache import PrefixCache

if TYPE_CHECKING:
    from services.llm.llama_cpp import LlamaCpp

log = logging.getLogger(__name__)


@dataclass
class Lease:
    handle_id: str
    kv: KvState
    num_tokens: int
    nbytes: int
    expires_at: float  # time.monotonic()
    expires_unix_ms: int
    traceparent: str = ""
    owner: str = ""


@dataclass
class KvStore:
    capacity_bytes: int
    clock: Callable[[], float] = time.monotonic
    _leases: dict[str, Lease] = field(default_factory=dict)
    used_bytes: int = 0

    def __len__(self) -> int:
        return len(self._leases)

    def put(self, kv: KvState, ttl_s: float, traceparent: str = "", owner: str = "") -> Lease:
        """Leases `kv` to `owner` under a new id."""
        nbytes = kv_nbytes(kv)
        if self.used_bytes + nbytes > self.capacity_bytes:
            self.expire()
        if self.used_bytes + nbytes > self.capacity_bytes:
            soonest = min((lease.expires_at for lease in self._leases.values()), default=0.0)
            raise Overloaded(
                f"KV store full ({self.used_bytes} of {self.capacity_bytes} bytes leased)",
                retry_after_s=max(soonest - self.clock(), 0.05),
                reason="KV_STORE_FULL",
            )
        lease = Lease(
            handle_id=new_handle_id(),
            kv=kv,
            num_tokens=kv_tokens(kv),
            nbytes=nbytes,
            expires_at=self.clock() + ttl_s,
            expires_unix_ms=int((time.time() + ttl_s) * 1000),
            traceparent=traceparent,
            owner=owner,
        )
        self._leases[lease.handle_id] = lease
        self.used_bytes += nbytes
        metrics.PREFILL_KV_LEASED_BYTES.set(self.used_bytes)
        return lease

    def get(self, handle_id: str, owner: str = "") -> Lease:
        lease = self._leases.get(handle_id)
        if lease is not None and lease.expires_at <= self.clock():
            self.release(handle_id, lease.owner)
            lease = None
        if lease is None or lease.owner != owner:
            raise NotFound(
                f"KV handle {handle_id!r} is unknown, released or expired",
                resource_type="kv_handle",
                resource_name=handle_id,
            )
        return lease

    def release(self, handle_id: str, owner: str = "") -> bool:
        lease = self._leases.get(handle_id)
        if lease is None or lease.owner != owner:
            return False
        del self._leases[handle_id]
        self.used_bytes -= lease.nbytes
        metrics.PREFILL_KV_LEASED_BYTES.set(self.used_bytes)
        return True

    def expire(self) -> int:
        now = self.clock()
        expired = [lease for lease in self._leases.values() if lease.expires_at <= now]
        for lease in expired:
            self.release(lease.handle_id, lease.owner)
        return len(expired)


@dataclass(frozen=True)
class PrefillResult:
    first_token: int
    logprob: float
    kv: KvState
    compute_s: float
    # Leading prompt tokens whose KV came from the prefix cache, not computed.
    cached_tokens: int = 0
    lookup_s: float = 0.0


class PrefillEngine:
    def __init__(self, model: Llama | LlamaCpp, prefixes: PrefixCache) -> None:
        self.model = model
        self.prefixes = prefixes

    def run(self, token_ids: list[int], params: SamplingParams) -> PrefillResult:
        """Blocking: call it on the model thread, the only one that touches the cache."""
        started = time.perf_counter()
        hit = self.prefixes.lookup(token_ids)
        looked_up = time.perf_counter()
        cached = hit.tokens if hit else 0
        try:
            logits, kv = self.model.prefill(token_ids, hit.kv if hit else None, cached)
        except Exception:
            if hit is None:
                raise
            # A cached prefix that will not load must not fail every prompt that starts
            # with it: it goes, and this prompt runs whole.
            log.exception("a cached prefix failed to load; dropped")
            self.prefixes.discard(hit)
            hit, cached = None, 0
            logits, kv = self.model.prefill(token_ids)
        token, logprob = sample(logits, params, token_ids, index=0)
        computed = time.perf_counter()
        self.prefixes.insert(token_ids, kv, hit)
        return PrefillResult(
            token,
            logprob,
            kv,
            compute_s=computed - looked_up,
            cached_tokens=cached,
            lookup_s=(looked_up - started) + (time.perf_counter() - computed),
        )

    def warm_up(self) -> None:
        """One prompt through the engine, not cached: it is no one's prefix."""
        prompt = [self.model.config.bos_token_id or 0] * 8
        self.model.prefill(prompt)

"""Prefill engine: one prompt at a time on the model thread, KV kept under a lease.

The KV of a prefilled prompt stays here until the decode worker has pulled it and calls
Release, or until its lease runs out, so a decoder that crashed mid-pull cannot leak
this worker's memory. The store has a byte budget; past it, Prefill is refused with
RESOURCE_EXHAUSTED rather than letting memory grow without bound.

A handle's id is made here (128 random bits), never by a caller, and the KV is bound to
the client its Prefill was for (`x-aimesh-client`, mesh/caller.py): a Pull or Release for
another client finds nothing, as if the id were unknown. A caller that must be able to
free the KV before it learns the handle (its generation cancelled while the answer was on
its way) sends a release token of its own choosing with the Prefill and releases by that.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from mesh.failures import NotFound, Overloaded
from services.llm import metrics
from services.llm.guide import Guide
from services.llm.kv_codec import KvState, kv_nbytes, kv_tokens
from services.llm.kv_transfer import new_handle_id
from services.llm.llama import Llama
from services.llm.passes import cut_at_or_before, passes
from services.llm.prefix import UNSCOPED
from services.llm.requests import choice_seed
from services.llm.sampling import Draw, SamplingParams, sample
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
    release_token: str = ""
    # Every handle that reads this KV, this one included: one per choice of the prompt
    # (SamplingParameters.n). Shared by those leases; the KV's bytes are held until the
    # last of them is released.
    readers: set[str] = field(default_factory=set)


# How long a release by token for a KV not made yet is remembered: longer than any prefill
# can take, so a KV made after its caller already gave up is dropped at once. Bounded in
# number too (10,000 take about 1.5 MB); past the bound the oldest is forgotten, and that
# KV, if it ever comes, lives out its lease.
TOMBSTONE_S = 300.0
MAX_TOMBSTONES = 10_000

# (owner, release token): a token frees only its own client's KV.
TokenKey = tuple[str, str]


@dataclass
class KvStore:
    capacity_bytes: int
    clock: Callable[[], float] = time.monotonic
    _leases: dict[str, Lease] = field(default_factory=dict)
    # A release token's handles: the readers set its leases share.
    _by_token: dict[TokenKey, set[str]] = field(default_factory=dict)
    # Tokens released before their KV existed -> when they are forgotten (expiry order).
    _tombstones: OrderedDict[TokenKey, float] = field(default_factory=OrderedDict)
    used_bytes: int = 0

    def __len__(self) -> int:
        return len(self._leases)

    def put(
        self,
        kv: KvState,
        ttl_s: float,
        traceparent: str = "",
        owner: str = "",
        release_token: str = "",
    ) -> Lease:
        """Leases `kv` to `owner` under a new id; not at all if `release_token` was
        released already (its caller gave up before the KV was made)."""
        return self.put_shared(kv, ttl_s, 1, traceparent, owner, release_token)[0]

    def put_shared(
        self,
        kv: KvState,
        ttl_s: float,
        readers: int,
        traceparent: str = "",
        owner: str = "",
        release_token: str = "",
    ) -> list[Lease]:
        """As put, under `readers` handles, each released apart (the choices of one
        prompt each pull it); its bytes count once, until the last is released.
        `release_token` frees them all."""
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
        handles = [new_handle_id() for _ in range(readers)]
        shared = set(handles)
        leases = [
            Lease(
                handle_id=handle_id,
                kv=kv,
                num_tokens=kv_tokens(kv),
                nbytes=nbytes,
                expires_at=self.clock() + ttl_s,
                expires_unix_ms=int((time.time() + ttl_s) * 1000),
                traceparent=traceparent,
                owner=owner,
                release_token=release_token,
                readers=shared,
            )
            for handle_id in handles
        ]
        if release_token and self._tombstones.pop((owner, release_token), None) is not None:
            return leases
        if release_token:
            self._by_token[owner, release_token] = shared
        for lease in leases:
            self._leases[lease.handle_id] = lease
        self.used_bytes += nbytes
        metrics.PREFILL_KV_LEASED_BYTES.set(self.used_bytes)
        return leases

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
        lease.readers.discard(handle_id)
        if not lease.readers:
            self._by_token.pop((owner, lease.release_token), None)
            self.used_bytes -= lease.nbytes
            metrics.PREFILL_KV_LEASED_BYTES.set(self.used_bytes)
        return True

    def release_by_token(self, release_token: str, owner: str = "") -> bool:
        """Frees `owner`'s KV made with `release_token`; one not made yet is remembered
        (bounded in time and number) and dropped when it is made."""
        handle_ids = self._by_token.get((owner, release_token))
        if handle_ids is not None:
            return any([self.release(handle_id, owner) for handle_id in list(handle_ids)])
        self._tombstones[owner, release_token] = self.clock() + TOMBSTONE_S
        self._tombstones.move_to_end((owner, release_token))
        while len(self._tombstones) > MAX_TOMBSTONES:
            self._tombstones.popitem(last=False)
        return False

    def expire(self) -> int:
        now = self.clock()
        while self._tombstones and next(iter(self._tombstones.values())) <= now:
            self._tombstones.popitem(last=False)
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
    # The most likely first tokens, when the request asked for them.
    top: tuple[tuple[int, float], ...] = ()
    # The first tokens of choices 1 to n-1 (SamplingParameters.n), each drawn with its
    # own seed from the same last position.
    others: tuple[Draw, ...] = ()


class PrefillEngine:
    def __init__(
        self, model: Llama | LlamaCpp, prefixes: PrefixCache, fixed_passes: bool = True
    ) -> None:
        self.model = model
        self.prefixes = prefixes
        # Passes cut at fixed positions (services/llm/passes.py): the same KV and first
        # token with or without a prefix-cache hit.
        self.fixed_passes = fixed_passes

    def run(
        self,
        token_ids: list[int],
        params: SamplingParams,
        scope: int = UNSCOPED,
        guide: Guide | None = None,
        choices: int = 1,
    ) -> PrefillResult:
        """Blocking: call it on the model thread, the only one that touches the cache.
        The prompt reads and feeds the prefix cache of `scope` alone; `guide` (a
        constrained request's matcher, at its start) masks the first token. Each of
        `choices` draws a first token from the one pass, choice i with seed + i."""
        started = time.perf_counter()
        usable = cut_at_or_before if self.fixed_passes else None
        hit = self.prefixes.lookup(token_ids, scope, usable)
        looked_up = time.perf_counter()
        cached = hit.tokens if hit else 0
        cuts = passes(cached, len(token_ids)) if self.fixed_passes else None
        try:
            logits, kv = self.model.prefill(token_ids, hit.kv if hit else None, cached, cuts)
        except Exception:
            if hit is None:
                raise
            # A cached prefix that will not load must not fail every prompt that starts
            # with it: it goes, and this prompt runs whole.
            log.exception("a cached prefix failed to load; dropped")
            self.prefixes.discard(hit)
            hit, cached = None, 0
            logits, kv = self.model.prefill(
                token_ids, cuts=passes(0, len(token_ids)) if self.fixed_passes else None
            )
        allowed = guide.allowed() if guide is not None else None
        draw, *others = [
            sample(logits, _choice(params, i), token_ids, index=0, allowed=allowed)
            for i in range(choices)
        ]
        computed = time.perf_counter()
        self.prefixes.insert(token_ids, kv, hit, scope)
        return PrefillResult(
            draw.token,
            draw.logprob,
            kv,
            compute_s=computed - looked_up,
            cached_tokens=cached,
            lookup_s=(looked_up - started) + (time.perf_counter() - computed),
            top=draw.top,
            others=tuple(others),
        )

    def warm_up(self) -> None:
        """One prompt through the engine, not cached: it is no one's prefix."""
        prompt = [self.model.config.bos_token_id or 0] * 8
        self.model.prefill(prompt)


def _choice(params: SamplingParams, index: int) -> SamplingParams:
    """Choice `index`'s sampling: its own seed, the rest shared."""
    if index == 0 or params.greedy:
        return params
    return replace(params, seed=choice_seed(params.seed or 0, index))

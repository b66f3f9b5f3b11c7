"""Prefill's prefix cache and the router's prefix-aware pick of a prefill worker, on their
own: lookups against a brute-force longest common prefix, eviction by bytes, and the
pick's affinity and its fallback to load."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mesh.breaker import Outcome, State
from mesh.client import ChannelPool
from mesh.config import MeshSettings
from services.generation.workers import AFFINITY_SLACK, PrefillPicker
from services.llm import metrics
from services.llm.kv_codec import SequenceState
from services.llm.passes import cut_at_or_before
from services.llm.prefix import BLOCK_TOKENS, UNSCOPED, block_hashes, cache_scope
from services.prefill.prefix_cache import PrefixCache

pytestmark = pytest.mark.unit

PREAMBLE = list(range(1000, 1040))  # 40 tokens: two whole blocks and 8 more


def state(tokens: list[int], bytes_per_token: int = 10) -> SequenceState:
    return SequenceState(bytes(len(tokens) * bytes_per_token), len(tokens))


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_a_prompt_sharing_a_cached_prefix_finds_that_prefix_token_exact():
    cache = PrefixCache(1 << 20)
    first = [*PREAMBLE, 1, 2, 3]
    kv = state(first)
    assert cache.lookup(first) is None
    cache.insert(first, kv)
    hit = cache.lookup([*PREAMBLE, 7, 8])
    assert hit is not None
    assert hit.kv is kv
    assert hit.tokens == len(PREAMBLE)  # past the last whole block, to the first differing token


def test_the_same_prompt_again_leaves_its_last_token_to_compute():
    cache = PrefixCache(1 << 20)
    prompt = [*PREAMBLE, 1, 2]
    cache.insert(prompt, state(prompt))
    hit = cache.lookup(prompt)
    assert hit is not None and hit.tokens == len(prompt) - 1
    cache.insert(prompt, state(prompt), hit)
    assert len(cache) == 1


def test_a_hit_counts_only_the_tokens_prefill_will_use():
    """With fixed passes a hit is used to its last cut: that is the hit, and all of it
    a miss when no cut is covered; a prompt extending the entry still replaces it."""
    cache = PrefixCache(1 << 20)
    long_preamble = list(range(1000, 1100))  # 100 tokens: one cut (64) covered
    first = [*long_preamble, 1, 2, 3]
    cache.insert(first, state(first))
    hits_before = metrics.PREFIX_CACHE_HITS._value.get()
    hit = cache.lookup([*long_preamble, 7], usable=cut_at_or_before)
    assert hit is not None and hit.tokens == 64
    assert metrics.PREFIX_CACHE_HITS._value.get() - hits_before == 64
    assert cache.lookup([*PREAMBLE, 7], usable=cut_at_or_before) is None  # 40 < 64
    longer = [*first, 4, 5]
    extended = cache.lookup(longer, usable=cut_at_or_before)
    cache.insert(longer, state(longer), extended)
    assert len(cache) == 1


def test_less_than_a_block_in_common_is_a_miss():
    cache = PrefixCache(1 << 20)
    cache.insert([*PREAMBLE[: BLOCK_TOKENS - 1], *range(50)], state(list(range(65))))
    assert cache.lookup([*PREAMBLE[: BLOCK_TOKENS - 1], 999, *range(50)]) is None
    assert cache.lookup(PREAMBLE[:BLOCK_TOKENS]) is None  # one block, but nothing after it


def test_the_least_recently_used_prompt_is_evicted_to_fit_a_new_one():
    prompts = [[*PREAMBLE, n] for n in range(3)]
    one = len(state(prompts[0]).data)
    cache = PrefixCache(2 * one)
    evicted = metrics.PREFIX_CACHE_EVICTIONS._value.get()
    cache.insert(prompts[0], state(prompts[0]))
    cache.insert([999, *PREAMBLE], state(prompts[1]))
    assert cache.lookup([*PREAMBLE, 5]).kv.num_tokens == len(prompts[0])  # used: now the newest
    cache.insert(prompts[2], state(prompts[2]))
    assert len(cache) == 2 and cache.used_bytes == 2 * one
    assert metrics.PREFIX_CACHE_EVICTIONS._value.get() == evicted + 1
    assert cache.lookup([999, *PREAMBLE, 3]) is None  # the unused one went
    assert cache.lookup([*PREAMBLE, 6]) is not None


def test_a_prompt_larger_than_the_whole_cache_or_a_disabled_cache_keeps_nothing():
    prompt = [*PREAMBLE, 1]
    for capacity in (0, len(state(prompt).data) - 1):
        cache = PrefixCache(capacity)
        cache.insert(prompt, state(prompt))
        assert len(cache) == 0 and cache.used_bytes == 0
        assert cache.lookup(prompt) is None


def test_a_prompt_extending_a_cached_one_replaces_it():
    cache = PrefixCache(1 << 20)
    cache.insert(PREAMBLE, state(PREAMBLE))
    longer = [*PREAMBLE, 1, 2, 3]
    hit = cache.lookup(longer)
    assert hit is not None and hit.tokens == len(PREAMBLE)
    cache.insert(longer, state(longer), hit)
    assert len(cache) == 1 and cache.used_bytes == len(state(longer).data)


def test_hits_and_queries_are_counted_in_prompt_tokens():
    cache = PrefixCache(1 << 20)
    queries = metrics.PREFIX_CACHE_QUERIES._value.get()
    hits = metrics.PREFIX_CACHE_HITS._value.get()
    cache.insert([*PREAMBLE, 1], state([*PREAMBLE, 1]))
    cache.lookup([*PREAMBLE, 2, 3])
    assert metrics.PREFIX_CACHE_QUERIES._value.get() == queries + len(PREAMBLE) + 2
    assert metrics.PREFIX_CACHE_HITS._value.get() == hits + len(PREAMBLE)


prompt_lists = st.lists(
    st.lists(st.integers(0, 2), min_size=1, max_size=80), min_size=1, max_size=12
)


@settings(max_examples=200, deadline=None)
@given(cached=prompt_lists, query=st.lists(st.integers(0, 2), min_size=1, max_size=80))
def test_a_hit_is_a_true_common_prefix_within_a_block_of_the_longest(cached, query):
    cache = PrefixCache(1 << 30)
    for prompt in cached:
        cache.insert(prompt, state(prompt))
    limit = len(query) - 1
    longest = max(
        (min(common_prefix(p, query), limit) for p in cached if len(p) >= BLOCK_TOKENS),
        default=0,
    )
    hit = cache.lookup(query)
    if longest < BLOCK_TOKENS:
        assert hit is None
        return
    assert hit is not None
    assert BLOCK_TOKENS <= hit.tokens <= limit
    assert hit.tokens > longest - BLOCK_TOKENS
    stored = next(
        p for p in cached if len(p) == hit.kv.num_tokens and p[: hit.tokens] == query[: hit.tokens]
    )
    assert stored[: hit.tokens] == query[: hit.tokens]


def picker(count: int) -> PrefillPicker:
    return PrefillPicker(
        [f"127.0.0.1:{9000 + n}" for n in range(count)], ChannelPool(MeshSettings())
    )


def test_a_prompt_goes_where_its_prefix_went():
    pick = picker(3)
    first = pick.pick([*PREAMBLE, 1])
    pick.done(first)
    others = {pick.pick(list(range(n * 100, n * 100 + 40))) for n in range(2)}
    for target in others:
        pick.done(target)
    assert first not in others  # fresh prompts spread over the idle workers
    for n in range(5):
        target = pick.pick([*PREAMBLE, 50 + n])
        pick.done(target)
        assert target == first


def test_a_busy_worker_loses_its_prefixes_to_the_least_busy():
    pick = picker(2)
    home = pick.pick([*PREAMBLE, 1])
    held = [pick.pick([*PREAMBLE, 2 + n]) for n in range(AFFINITY_SLACK)]
    assert set(held) == {home}  # within the slack, affinity wins
    assert pick.pick([*PREAMBLE, 9]) != home  # past it, load does


async def test_a_worker_with_an_open_breaker_is_skipped_while_another_is_closed():
    pick = picker(2)
    home = pick.pick([*PREAMBLE, 1])
    pick.done(home)
    pick.channels.get(home)
    breaker = pick.channels.breakers[home]
    for _ in range(breaker.settings.minimum_calls):
        breaker.record(Outcome.FAILURE, 0.0)
    assert breaker.state is State.OPEN
    assert pick.pick([*PREAMBLE, 2]) != home
    await pick.channels.close()


def test_a_cached_prompt_is_found_only_in_its_own_scope():
    cache = PrefixCache(1 << 20)
    acme, globex = cache_scope("acme", ""), cache_scope("globex", "")
    salted = cache_scope("acme", "user-1")
    prompt = [*PREAMBLE, 1, 2]
    cache.insert(prompt, state(prompt), scope=acme)
    assert cache.lookup(prompt, globex) is None
    assert cache.lookup(prompt, salted) is None
    assert cache.lookup(prompt) is None  # the unscoped (mesh-wide) cache, too
    assert cache.lookup(prompt, acme).tokens == len(prompt) - 1
    # The same tokens in two scopes are two entries, each its own tenant's.
    cache.insert(prompt, state(prompt), scope=globex)
    assert len(cache) == 2
    assert cache.lookup(prompt, globex).entry is not cache.lookup(prompt, acme).entry


def test_scopes_differ_by_client_and_salt_and_read_no_pair_as_another():
    assert cache_scope("", "") == UNSCOPED
    scopes = {
        cache_scope(c, s) for c, s in [("a", ""), ("", "a"), ("a", "b"), ("ab", ""), ("a\0b", "")]
    }
    assert len(scopes) == 5
    assert block_hashes(PREAMBLE, scope=cache_scope("a", "")) != block_hashes(PREAMBLE)


def test_the_pick_remembers_a_prefix_within_its_scope_only():
    picker = PrefillPicker(["a", "b"], ChannelPool(MeshSettings()))
    acme, globex = cache_scope("acme", ""), cache_scope("globex", "")
    first = picker.pick(PREAMBLE, acme)
    picker.done(first)
    assert picker.pick(PREAMBLE, acme) == first
    picker.done(first)
    worker = next(w for w in picker.workers if w.target == first)
    assert worker.cached_blocks(block_hashes(PREAMBLE, scope=acme)) == 2
    assert worker.cached_blocks(block_hashes(PREAMBLE, scope=globex)) == 0

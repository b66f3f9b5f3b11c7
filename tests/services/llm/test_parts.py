"""Sampling, stopping, the KV wire codec and the model cache, each on its own."""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aimesh.llm.v1 import kv_cache_pb2, sampling_pb2
from mesh.artifacts import manifest_problems
from mesh.validation import Violations
from services.llm import artifacts, kv_codec
from services.llm.requests import sampling_params
from services.llm.sampling import SamplingParams, sample
from services.llm.stopping import Finish, StopChecker

pytestmark = pytest.mark.unit


def test_greedy_and_degenerate_filters_agree():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    best = int(logits.argmax())
    assert sample(logits, SamplingParams(), [], 0)[0] == best
    assert sample(logits, SamplingParams(temperature=1.0, top_k=1, seed=3), [], 0)[0] == best
    assert sample(logits, SamplingParams(temperature=1.0, top_p=1e-6, seed=3), [], 0)[0] == best


def test_seeded_sampling_depends_only_on_seed_and_index():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=1.0, seed=42)
    draws = [sample(logits, params, [], i)[0] for i in range(20)]
    assert draws == [sample(logits, params, [], i)[0] for i in range(20)]
    other = [sample(logits, SamplingParams(temperature=1.0, seed=43), [], i)[0] for i in range(20)]
    assert draws != other


def test_sampled_draws_follow_the_distribution_and_never_a_filtered_token():
    """10,000 draws (one seed, each step its own generator): every token comes up as
    often as its probability says, within 5 standard deviations, and one top_k filtered
    out never does."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 3.0e-3, -9.0])
    params = SamplingParams(temperature=1.0, top_k=6, seed=11)
    draws = 10_000
    counts = torch.bincount(
        torch.tensor([sample(logits, params, [], i).token for i in range(draws)]), minlength=7
    )
    expected = torch.softmax(logits[:6], dim=-1)
    assert counts[6] == 0
    tolerance = 5 * torch.sqrt(expected * (1 - expected) / draws)
    assert torch.all((counts[:6] / draws - expected).abs() <= tolerance), counts


@pytest.mark.parametrize("temperature", [1e-40, 1e-45, 1e-8])
def test_a_near_zero_temperature_is_greedy_not_nan(temperature):
    """1e-40 used to pass validation and overflow the logits to inf, then NaN."""
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 20
    token, logprob, _ = sample(logits, SamplingParams(temperature=temperature, seed=1), [5, 9], 0)
    assert token == int(logits.argmax())
    assert math.isfinite(logprob)


_floats = st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=True, width=32)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    temperature=_floats,
    top_k=st.integers(0, 2000),
    top_p=st.none() | _floats,
    repetition_penalty=_floats,
    frequency_penalty=_floats,
    seed=st.none() | st.integers(0, 2**64 - 1),
    history=st.lists(st.integers(0, 999), max_size=40),
    scale=st.sampled_from([1.0, 30.0, 1e4]),
)
def test_whatever_validation_lets_through_samples_a_token(
    temperature, top_k, top_p, repetition_penalty, frequency_penalty, seed, history, scale
):
    """The engine handles every value validation accepts: no exception, no NaN."""
    message = sampling_pb2.SamplingParameters(
        temperature=temperature,
        top_k=top_k,
        repetition_penalty=repetition_penalty,
        frequency_penalty=frequency_penalty,
    )
    if top_p is not None:
        message.top_p = top_p
    if seed is not None:
        message.seed = seed
    violations = Violations()
    params = sampling_params(message, 1000, violations)
    if violations:
        return
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(len(history))) * scale
    token, logprob, _ = sample(logits, params, history, len(history))
    assert 0 <= token < 1000
    assert not math.isnan(logprob)


def test_top_logprobs_are_the_models_distribution_most_likely_first():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(2)) * 3
    expected = torch.log_softmax(logits, dim=-1)
    greedy = sample(logits, SamplingParams(top_logprobs=5), [], 0)
    assert [token for token, _ in greedy.top] == torch.topk(logits, 5).indices.tolist()
    assert greedy.top[0] == (greedy.token, pytest.approx(greedy.logprob))
    for token, logprob in greedy.top:
        assert logprob == pytest.approx(float(expected[token]), abs=1e-5)
    # Temperature changes the draw, never what the model believed.
    hot = sample(logits, SamplingParams(temperature=1.9, seed=4, top_logprobs=5), [], 0)
    assert hot.top == greedy.top
    assert hot.logprob == pytest.approx(float(expected[hot.token]), abs=1e-5)
    assert sample(logits, SamplingParams(), [], 0).top == ()


def test_a_masked_token_is_never_a_likely_alternative():
    logits = torch.arange(10, dtype=torch.float32)
    allowed = torch.zeros(10, dtype=torch.bool)
    allowed[[2, 5]] = True
    draw = sample(logits, SamplingParams(top_logprobs=4), [], 0, allowed=allowed)
    assert [token for token, _ in draw.top] == [5, 2]
    assert math.fsum(math.exp(logprob) for _, logprob in draw.top) == pytest.approx(1.0)


def test_repetition_penalty_pushes_seen_tokens_down():
    logits = torch.zeros(10)
    logits[3] = 2.0
    logits[4] = 1.9
    assert sample(logits, SamplingParams(), [], 0)[0] == 3
    assert sample(logits, SamplingParams(repetition_penalty=1.5), [3], 0)[0] == 4


def test_decode_stops_on_the_end_token_without_emitting_it():
    checker = StopChecker(max_new_tokens=100, eos_ids=frozenset({0}))
    assert checker.feed(7) == [7]
    assert checker.feed(0) == []
    assert checker.finish is Finish.EOS and checker.generated == 2
    assert checker.feed(8) == []


def test_decode_stops_at_the_length_or_the_context_with_the_last_token():
    checker = StopChecker(max_new_tokens=2, eos_ids=frozenset({0}))
    assert checker.feed(7) == [7] and checker.finish is None
    assert checker.feed(8) == [8] and checker.finish is Finish.LENGTH
    full = StopChecker(max_new_tokens=100, eos_ids=frozenset({0}))
    assert full.feed(7, room_left=False) == [7] and full.finish is Finish.LENGTH
    ignoring = StopChecker(max_new_tokens=100, eos_ids=frozenset({0}), ignore_eos=True)
    assert ignoring.feed(0) == [0] and ignoring.finish is None


def _kv(tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.randn(3, tokens, 64), torch.randn(3, tokens, 64)) for _ in range(4)]


def test_kv_round_trip_is_exact():
    kv = _kv(37)
    assembler = kv_codec.KvAssembler(4, (3, 37, 64), "float32")
    chunks = list(kv_codec.encode(kv, kv_codec.MIN_CHUNK_BYTES))
    for chunk in chunks:
        assembler.add(chunk)
    out = assembler.finish(
        kv_cache_pb2.PullComplete(num_chunks=len(chunks), total_bytes=assembler.total_bytes)
    )
    assert all(
        torch.equal(a, b)
        for (k, v), (k2, v2) in zip(kv, out, strict=True)
        for a, b in ((k, k2), (v, v2))
    )


def test_kv_stream_with_a_gap_or_missing_end_is_refused():
    chunks = list(kv_codec.encode(_kv(300), kv_codec.MIN_CHUNK_BYTES))
    gapped = kv_codec.KvAssembler(4, (3, 300, 64), "float32")
    gapped.add(chunks[0])
    with pytest.raises(ValueError, match="expected 1"):
        gapped.add(chunks[2])
    truncated = kv_codec.KvAssembler(4, (3, 300, 64), "float32")
    for chunk in chunks[:-1]:
        truncated.add(chunk)
    with pytest.raises(ValueError):
        truncated.finish(
            kv_cache_pb2.PullComplete(num_chunks=len(chunks) - 1, total_bytes=truncated.total_bytes)
        )


def test_an_engine_state_round_trips_exactly_and_a_gap_a_cut_or_torch_chunks_are_refused():
    state = kv_codec.SequenceState(bytes(range(256)) * 1000, num_tokens=11)
    chunks = list(kv_codec.encode(state, kv_codec.MIN_CHUNK_BYTES))
    assert len(chunks) == 4
    assert {(c.layer, c.part, c.dtype) for c in chunks} == {
        (0, kv_cache_pb2.KV_PART_STATE, "uint8")
    }
    assembler = kv_codec.StateAssembler(len(state.data), state.num_tokens)
    for chunk in chunks:
        assembler.add(chunk)
    complete = kv_cache_pb2.PullComplete(num_chunks=len(chunks), total_bytes=len(state.data))
    assert assembler.finish(complete) == state
    gapped = kv_codec.StateAssembler(len(state.data), state.num_tokens)
    gapped.add(chunks[0])
    with pytest.raises(ValueError, match="expected 1"):
        gapped.add(chunks[2])
    cut = kv_codec.StateAssembler(len(state.data), state.num_tokens)
    for chunk in chunks[:-1]:
        cut.add(chunk)
    with pytest.raises(ValueError, match="before the state was complete"):
        cut.finish(kv_cache_pb2.PullComplete(num_chunks=3, total_bytes=cut.total_bytes))
    smaller = kv_codec.StateAssembler(len(state.data) - 1, state.num_tokens)
    with pytest.raises(ValueError, match="shape"):
        smaller.add(chunks[0])
    with pytest.raises(ValueError, match="no sequence state"):
        kv_codec.StateAssembler(64 * 3 * 37 * 4, 37).add(next(kv_codec.encode(_kv(37), 1 << 20)))


@pytest.mark.system  # the GGUF converted again
def test_corrupt_model_cache_is_rebuilt_before_it_is_served(tmp_path, model_dir):
    """A truncated safetensors file in the cache is detected and rebuilt from the GGUF."""
    cache = tmp_path / "cache"
    target = cache / "models" / artifacts.DEFAULT_NAME
    shutil.copytree(model_dir, target)
    weights = target / "model.safetensors"
    with weights.open("r+b") as handle:
        handle.truncate(weights.stat().st_size // 2)
    rebuilt = artifacts.default_model(cache)
    assert rebuilt == target
    assert manifest_problems(rebuilt) == []
    assert weights.stat().st_size == (model_dir / "model.safetensors").stat().st_size


def test_kv_is_found_only_by_the_client_it_was_made_for():
    """A handle's id is the store's own (128 random bits) and its KV belongs to the client
    of the Prefill that made it: another client's Pull or Release finds nothing."""
    from mesh.failures import NotFound
    from services.llm.kv_transfer import HANDLE_ID
    from services.prefill.engine import KvStore

    store = KvStore(capacity_bytes=10**9)
    mine, also_mine = store.put(_kv(8), 30, owner="acme"), store.put(_kv(8), 30, owner="acme")
    assert HANDLE_ID.fullmatch(mine.handle_id) and mine.handle_id != also_mine.handle_id
    with pytest.raises(NotFound):
        store.get(mine.handle_id, "intruder")
    with pytest.raises(NotFound):
        store.get(mine.handle_id)  # no client at all
    assert store.release(mine.handle_id, "intruder") is False and len(store) == 2
    assert store.get(mine.handle_id, "acme") is mine
    assert store.release(mine.handle_id, "acme") and store.release(also_mine.handle_id, "acme")
    assert len(store) == 0 and store.used_bytes == 0


def test_a_release_token_frees_its_clients_kv_even_before_it_is_made():
    """The router's way out when cancelled while prefill's answer is on its way: it never
    learns the handle, so it releases by the token it sent; a token released first keeps
    the KV from being kept at all. Another client's release by the same token does
    nothing to it."""
    from services.llm.kv_transfer import new_handle_id
    from services.prefill.engine import KvStore

    store = KvStore(capacity_bytes=10**9)
    early, late = new_handle_id(), new_handle_id()
    assert store.release_by_token(early, "acme") is False
    store.put(_kv(8), 30, owner="acme", release_token=early)
    assert len(store) == 0 and store.used_bytes == 0
    store.put(_kv(8), 30, owner="acme", release_token=late)
    assert store.release_by_token(late, "intruder") is False and len(store) == 1
    assert store.release_by_token(late, "acme") is True
    assert len(store) == 0 and store.used_bytes == 0


def test_the_choices_of_one_prompt_each_hold_the_kv_until_the_last_lets_go():
    """sampling.n: one KV under a handle per choice. Its bytes count once; a choice's
    decode that released its handle leaves the KV for the others; the last release frees
    it, and the release token frees every handle at once."""
    from mesh.failures import NotFound
    from services.llm.kv_transfer import new_handle_id
    from services.prefill.engine import KvStore

    store = KvStore(capacity_bytes=10**9)
    kv = _kv(8)
    first, second, third = store.put_shared(kv, 30, 3, owner="acme")
    assert len({first.handle_id, second.handle_id, third.handle_id}) == 3
    one_kv = store.used_bytes
    assert one_kv == first.nbytes and len(store) == 3
    assert store.release(first.handle_id, "acme") and store.used_bytes == one_kv
    assert store.release(first.handle_id, "acme") is False  # once per handle
    with pytest.raises(NotFound):
        store.get(first.handle_id, "acme")
    assert store.get(second.handle_id, "acme").kv is kv
    assert store.release(second.handle_id, "acme") and store.release(third.handle_id, "acme")
    assert len(store) == 0 and store.used_bytes == 0

    token = new_handle_id()
    store.put_shared(_kv(8), 30, 4, owner="acme", release_token=token)
    assert store.release_by_token(token, "acme") is True
    assert len(store) == 0 and store.used_bytes == 0


def test_a_local_model_directory_is_used_as_given_and_checked(tmp_path, model_dir):
    from mesh.failures import NotReady

    assert artifacts.resolve_model(model_dir, tmp_path) == model_dir
    with pytest.raises(NotReady, match=r"config\.json"):
        artifacts.resolve_model(tmp_path, tmp_path)
    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken, ignore=shutil.ignore_patterns("*.safetensors"))
    with pytest.raises(NotReady, match="manifest"):
        artifacts.resolve_model(broken, tmp_path)


def test_guided_choice_keeps_only_tokens_that_continue_a_choice():
    params = SamplingParams(choices=((5, 6, 0), (5, 7, 0), (9, 0)))
    logits = torch.zeros(10)
    logits[3] = 10.0  # the model's favourite, never a choice
    first = sample(logits, params, history=[1, 2], index=0).token
    assert first == 5 or first == 9
    logits[6], logits[7] = 1.0, 2.0
    second = sample(logits, params, history=[1, 2, 5], index=1).token
    assert second == 7
    third = sample(logits, params, history=[1, 2, 5, 7], index=2).token
    assert third == 0

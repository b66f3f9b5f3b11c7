"""The model, the slot cache and continuous batching, against transformers; the decode
scheduler on both engines (torch and llama.cpp)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import pytest
import torch

from aimesh.llm.v1.sampling_pb2 import OutputConstraint
from mesh.failures import NotReady, OutOfMemory
from services.decode.engine import DecodeEngine, Sequence, Slots
from services.llm.artifacts import gguf_path
from services.llm.guide import Vocabularies
from services.llm.kv_codec import KvState, SequenceState, kv_tokens
from services.llm.llama import Llama, SlotCache, TorchSlots, resolve_device, resolve_dtype
from services.llm.sampling import SamplingParams
from services.llm.stopping import Finish, StopChecker
from services.prefill.engine import PrefillEngine
from services.prefill.prefix_cache import PrefixCache
from tests.conftest import eventually
from tests.services.llm.conftest import greedy_reference

pytestmark = pytest.mark.unit

# How far a prefill continued from a cached prefix may move the last position's logits
# from a whole prefill's: not at all on either engine on this machine (measured over 12
# prompt pairs), but a GEMM may block another number of rows differently elsewhere.
PREFIX_LOGIT_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def llama(model_dir) -> Llama:
    return Llama.load(model_dir)


def test_prefill_logits_match_transformers(llama, reference, prompts):
    model, tokenizer = reference
    for prompt in prompts[:4]:
        ids = tokenizer(prompt)["input_ids"]
        logits, kv = llama.prefill(ids)
        with torch.inference_mode():
            expected = model(torch.tensor([ids])).logits[0, -1]
        assert torch.allclose(logits, expected, atol=1e-4, rtol=1e-4)
        assert len(kv) == llama.config.num_layers
        assert kv[0][0].shape == (llama.config.num_kv_heads, len(ids), llama.config.head_dim)


def batched_greedy(llama: Llama, prompt_ids: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy tokens for each prompt, prefilled one by one and decoded as one batch."""
    cache = SlotCache(llama.config, slots=len(prompt_ids), max_len=128, dtype=llama.dtype)
    generated = []
    for slot, ids in enumerate(prompt_ids):
        logits, kv = llama.prefill(ids)
        cache.load(slot, kv)
        generated.append([int(logits.argmax())])
    for _ in range(new_tokens - 1):
        logits = llama.decode(
            [gen[-1] for gen in generated],
            [len(ids) + len(gen) - 1 for ids, gen in zip(prompt_ids, generated, strict=True)],
            cache,
        )
        for gen, row in zip(generated, logits, strict=True):
            gen.append(int(row.argmax()))
    return generated


# ~15 s of 64-token decodes: the system tier keeps make test-fast under 3 minutes.
@pytest.mark.system
def test_batched_decode_steps_match_transformers_greedy(llama, reference, prompts):
    _, tokenizer = reference
    prompt_ids = [tokenizer(prompt)["input_ids"] for prompt in prompts[:4]]
    for ids, gen in zip(prompt_ids, batched_greedy(llama, prompt_ids, 16), strict=True):
        expected = greedy_reference(reference, ids, 16)
        assert gen[: len(expected)] == expected


@pytest.mark.system  # two bfloat16 models, 45 steps
def test_bfloat16_greedy_equals_transformers_in_bfloat16(model_dir, bfloat16_reference, prompts):
    """Alone, the bfloat16 model is transformers in bfloat16 bit for bit: prefill and each
    decode step make the same calls in the same order (a lone sequence's attention takes
    no mask, as transformers' does), so every step's logits are equal and the greedy
    output matches token for token. Batched rows are not bit-equal to lone ones: a
    projection over 16 rows rounds differently than over one, in transformers too."""
    model, tokenizer = bfloat16_reference
    llama = Llama.load(model_dir, torch.bfloat16)
    for prompt in prompts:
        ids = tokenizer(prompt)["input_ids"]
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([ids]),
                max_new_tokens=24,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=tokenizer.eos_token_id,
            )
        expected = out.sequences[0, len(ids) :].tolist()
        cache = SlotCache(llama.config, slots=1, max_len=128, dtype=torch.bfloat16)
        logits, kv = llama.prefill(ids)
        cache.load(0, kv)
        tokens = [int(logits.argmax())]
        assert torch.equal(logits, out.logits[0][0].float()), prompt
        for step in range(1, len(expected)):
            logits = llama.decode([tokens[-1]], [len(ids) + step - 1], cache)[0]
            assert torch.equal(logits, out.logits[step][0].float()), (prompt, step)
            tokens.append(int(logits.argmax()))
        assert tokens == expected, prompt


def test_torch_kv_is_written_as_the_state_llama_cpp_writes_for_the_same_prompt(llama, reference):
    """Torch prefill's KV as llama.cpp's state: byte for byte llama.cpp's own outside the
    K and V rows, and rows within llama.cpp's rounding of them (its matmuls quantize
    activations to 8 bits; measured here at most 5.3% of a layer's norm, against 151% for
    K with its dimensions in the wrong order)."""
    from services.llm.llama_cpp import LlamaCpp

    _, tokenizer = reference
    prompt_ids = tokenizer("Once upon a time, in a land far away, there lived")["input_ids"]
    model = LlamaCpp(gguf_path(), llama.config, sequences=1, max_seq_len=128, threads=1)
    try:
        written = model.state_of(llama.prefill(prompt_ids)[1]).data
        own = model.prefill(prompt_ids)[1].data
    finally:
        model.close()
    assert len(written) == len(own)
    tokens, c = len(prompt_ids), llama.config
    rows = tokens * c.num_kv_heads * c.head_dim * 2
    offset = 12 + 4 + 12 * tokens + 8  # head, cell count, cells, V layout and layer count
    assert written[:offset] == own[:offset]
    for _ in range(2 * c.num_layers):  # each layer's K, then each layer's V
        assert written[offset : offset + 12] == own[offset : offset + 12]  # type, row size
        ours, theirs = (
            torch.frombuffer(bytearray(data[offset + 12 : offset + 12 + rows]), dtype=torch.float16)
            for data in (written, own)
        )
        assert float((ours.float() - theirs.float()).norm() / theirs.float().norm()) < 0.1
        offset += 12 + rows
    assert offset == len(own)


@dataclass(frozen=True)
class Engine:
    """One engine as decode serves it: its prefill, and its decode slots made to size."""

    name: str
    # (prompt ids, optionally a cached prefix's KV and how many of its tokens to keep)
    prefill: Callable[..., tuple[torch.Tensor, KvState]]
    slots: Callable[[int, int], Slots]


@pytest.fixture(scope="module", params=["torch", "llama.cpp"])
def engine(request, llama, model_dir) -> Iterator[Engine]:
    """Every decode scheduler test runs on both engines: the scheduler's joins, moves and
    frees must keep each sequence's own output on either."""
    if request.param == "torch":
        yield Engine("torch", llama.prefill, lambda n, length: TorchSlots(llama, n, length))
        return
    from services.llm.llama_cpp import LlamaCpp

    def made(sequences: int, max_seq_len: int) -> LlamaCpp:
        model = LlamaCpp(
            gguf_path(), llama.config, sequences=sequences, max_seq_len=max_seq_len, threads=1
        )
        opened.append(model)
        return model

    opened: list[LlamaCpp] = []
    prefiller = made(1, 256)
    yield Engine("llama.cpp", prefiller.prefill, made)
    for model in opened:
        model.close()


def _sequence(engine: Engine, tokenizer, prompt: str, length: int, **params) -> Sequence:
    ids = tokenizer(prompt)["input_ids"]
    logits, kv = engine.prefill(ids)
    first = int(logits.argmax())
    checker = StopChecker(max_new_tokens=length, eos_ids=frozenset({-1}))
    checker.feed(first)
    return Sequence(ids, kv, first, SamplingParams(**params), checker)


async def _collect(sequence: Sequence) -> list[int] | BaseException:
    tokens = [sequence.first_token]
    while True:
        emission = await sequence.outbox.get()
        if emission.error is not None:
            return emission.error
        tokens += emission.tokens
        if emission.finish is not None:
            return tokens


async def _decoded_alone(engine: Engine, sequence: Sequence) -> list[int] | BaseException:
    decoder = DecodeEngine(engine.slots(1, 256), max_batch_size=1, max_seq_len=256)
    decoder.start()
    try:
        decoder.submit(sequence)
        return await _collect(sequence)
    finally:
        await decoder.stop()


async def _alone(engine: Engine, tokenizer, prompt: str, length: int) -> list[int]:
    return await _decoded_alone(engine, _sequence(engine, tokenizer, prompt, length))


def _greedy_after(ids: list[int], logits: torch.Tensor, kv: KvState, length: int) -> Sequence:
    checker = StopChecker(max_new_tokens=length, eos_ids=frozenset({-1}))
    checker.feed(int(logits.argmax()))
    return Sequence(ids, kv, int(logits.argmax()), SamplingParams(), checker)


async def test_a_prompt_continued_from_a_cached_prefix_decodes_as_if_prefilled_whole(
    engine, reference
):
    """Prefill's prefix cache: another prompt's KV stands for the shared start, only the
    rest is computed, and decode continues it as it would a whole prefill."""
    _, tokenizer = reference
    preamble = (
        "You are a careful assistant. Answer in one short sentence, cite the document you "
        "used, and say so when the documents do not hold the answer.\n"
    )
    earlier = tokenizer(preamble + "Question: what is the capital of France?")["input_ids"]
    prompt = tokenizer(preamble + "Question: which planet is largest?")["input_ids"]
    shared = next(i for i, (a, b) in enumerate(zip(earlier, prompt, strict=False)) if a != b)
    assert shared >= 16
    _, earlier_kv = engine.prefill(earlier)
    whole_logits, whole_kv = engine.prefill(prompt)
    logits, kv = engine.prefill(prompt, earlier_kv, shared)
    assert kv_tokens(kv) == len(prompt)
    assert int(logits.argmax()) == int(whole_logits.argmax())
    assert torch.allclose(logits, whole_logits, atol=PREFIX_LOGIT_TOLERANCE)
    continued = await _decoded_alone(engine, _greedy_after(prompt, logits, kv, 16))
    assert continued == await _decoded_alone(
        engine, _greedy_after(prompt, whole_logits, whole_kv, 16)
    )


async def test_sequences_joining_and_leaving_mid_batch_keep_their_own_output(
    engine, reference, prompts
):
    """Continuous batching: staggered arrivals, different lengths, slots compacted as
    sequences leave; each output must equal that sequence decoded alone."""
    _, tokenizer = reference
    decoder = DecodeEngine(engine.slots(3, 256), max_batch_size=3, max_seq_len=256)
    decoder.start()
    lengths = [5, 12, 3, 9, 7, 14]

    async def run(prompt: str, length: int, delay: float) -> list[int]:
        await asyncio.sleep(delay)
        sequence = _sequence(engine, tokenizer, prompt, length)
        decoder.submit(sequence)
        tokens = [sequence.first_token]
        while True:
            emission = await sequence.outbox.get()
            tokens += emission.tokens
            if emission.finish is not None:
                assert emission.finish is Finish.LENGTH
                return tokens

    try:
        outputs = await asyncio.gather(
            *(run(p, n, 0.05 * i) for i, (p, n) in enumerate(zip(prompts, lengths, strict=False)))
        )
    finally:
        await decoder.stop()
    for prompt, length, output in zip(prompts, lengths, outputs, strict=False):
        # The checker never sees EOS here (eos_ids={-1}): raw greedy tokens.
        assert output == await _alone(engine, tokenizer, prompt, length)


async def test_cancelled_sequence_leaves_at_the_next_step(engine, reference):
    _, tokenizer = reference
    decoder = DecodeEngine(engine.slots(2, 256), max_batch_size=2, max_seq_len=256)
    decoder.start()
    try:
        sequence = _sequence(engine, tokenizer, "Tell me everything:", 500)
        decoder.submit(sequence)
        await sequence.outbox.get()
        steps_at_cancel = decoder.steps
        decoder.cancel(sequence)
        await eventually(lambda: not decoder.running, interval_s=0.001)
        assert decoder.steps - steps_at_cancel <= 1
    finally:
        await decoder.stop()


def test_weights_cache_and_inputs_live_on_the_models_device_and_logits_come_back_to_cpu(llama):
    cache = SlotCache(llama.config, 2, 32, llama.dtype, llama.device)
    logits, kv = llama.prefill([1, 2, 3])
    cache.load(0, kv)
    step = llama.decode([4], [3], cache)
    assert {llama.embed.device, cache.keys[0].device, kv[0][0].device} == {llama.device}
    assert logits.device.type == "cpu" and step.device.type == "cpu"
    assert step.dtype == torch.float32


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_asking_for_cuda_without_it_fails_at_startup_not_mid_request():
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(RuntimeError, match="no CUDA device"):
        resolve_device("cuda")


def test_auto_dtype_is_bfloat16_only_where_the_hardware_multiplies_it(monkeypatch):
    cpu = torch.device("cpu")
    assert resolve_dtype("float32", cpu) == torch.float32
    assert resolve_dtype("bfloat16", cpu) == torch.bfloat16
    # The CPU's instruction set is the edge this machine cannot vary: both answers of the
    # probe torch reads it with.
    for native, expected in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda native=native: native)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
        assert resolve_dtype("auto", cpu) == expected


async def test_a_sequence_that_fails_to_sample_fails_alone(engine, reference):
    """One row's sampling bug (a choice outside the vocabulary, which validation would
    refuse) used to fail the whole step and with it every neighbour's stream."""
    _, tokenizer = reference
    decoder = DecodeEngine(engine.slots(4, 256), max_batch_size=4, max_seq_len=256)
    decoder.start()
    try:
        good = _sequence(engine, tokenizer, "The capital of France is", 12)
        bad = _sequence(engine, tokenizer, "Once upon a time", 12)
        bad.params = replace(bad.params, choices=((bad.first_token, 10**9),))
        decoder.submit(good)
        decoder.submit(bad)
        good_out, bad_out = await asyncio.gather(_collect(good), _collect(bad))
    finally:
        await decoder.stop()
    assert isinstance(bad_out, IndexError)
    assert good_out == await _alone(engine, tokenizer, "The capital of France is", 12)


async def test_a_kv_that_does_not_load_fails_only_its_own_sequence(engine, reference):
    _, tokenizer = reference
    decoder = DecodeEngine(engine.slots(4, 256), max_batch_size=4, max_seq_len=256)
    decoder.start()
    try:
        good = _sequence(engine, tokenizer, "def fibonacci(n):", 10)
        bad = _sequence(engine, tokenizer, "List three colors:", 10)
        # A layer short, or a state cut short: neither loads.
        bad.kv = (
            bad.kv[:-1]
            if isinstance(bad.kv, list)
            else SequenceState(bad.kv.data[:-10], bad.kv.num_tokens)
        )
        decoder.submit(good)
        decoder.submit(bad)
        good_out, bad_out = await asyncio.gather(_collect(good), _collect(bad))
    finally:
        await decoder.stop()
    assert isinstance(bad_out, Exception)
    assert good_out == await _alone(engine, tokenizer, "def fibonacci(n):", 10)


class _OutOfMemoryAboveOneRow:
    """Fault injection: the real slots, except that a step over more than one sequence
    raises torch's out-of-memory error, as a GPU that is nearly full would."""

    def __init__(self, slots: Slots) -> None:
        self.slots = slots
        self.config, self.compacted = slots.config, slots.compacted
        self.forward_on_gpu = slots.forward_on_gpu
        self.load, self.move, self.free = slots.load, slots.move, slots.free

    def decode(self, tokens, positions, slots):
        if len(tokens) > 1:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return self.slots.decode(tokens, positions, slots)


async def test_out_of_memory_evicts_the_longest_sequence_and_the_rest_go_on(engine, reference):
    _, tokenizer = reference
    slots = _OutOfMemoryAboveOneRow(engine.slots(4, 256))
    decoder = DecodeEngine(slots, max_batch_size=4, max_seq_len=256)
    decoder.start()
    short = "Hi"
    long = "Tell me a long story about a dragon who lived in a castle by the sea"
    try:
        kept = _sequence(engine, tokenizer, short, 8)
        evicted = _sequence(engine, tokenizer, long, 8)
        decoder.submit(kept)
        decoder.submit(evicted)
        kept_out, evicted_out = await asyncio.gather(_collect(kept), _collect(evicted))
    finally:
        await decoder.stop()
    assert isinstance(evicted_out, OutOfMemory) and evicted_out.retry_after_s
    assert kept_out == await _alone(engine, tokenizer, short, 8)


async def test_a_dead_scheduler_fails_every_stream_and_refuses_new_ones(engine, reference):
    _, tokenizer = reference
    decoder = DecodeEngine(engine.slots(2, 256), max_batch_size=2, max_seq_len=256)
    task = decoder.start()
    waiting = _sequence(engine, tokenizer, "Water boils at", 50)
    decoder.waiting.append(waiting)  # queued, never scheduled: the task dies first
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    decoder.fail_all(NotReady("decode-scheduler stopped"))
    assert isinstance(await _collect(waiting), NotReady)
    with pytest.raises(NotReady):
        decoder.submit(_sequence(engine, tokenizer, "Water boils at", 5))
    await decoder.stop()


def test_a_cached_prefix_that_will_not_load_is_dropped_and_the_prompt_runs_whole(llama):
    from services.llm.llama_cpp import LlamaCpp

    model = LlamaCpp(gguf_path(), llama.config, sequences=1, max_seq_len=128, threads=1)
    try:
        cache = PrefixCache(1 << 24)
        prompt = list(range(100, 200))
        cache.insert(prompt[:64], SequenceState(bytes(1000), 64))  # no state llama.cpp reads
        result = PrefillEngine(model, cache).run(prompt, SamplingParams())
        whole_logits, _ = model.prefill(prompt)
    finally:
        model.close()
    assert result.cached_tokens == 0
    assert result.first_token == int(whole_logits.argmax())
    assert len(cache) == 1  # the broken entry went; this prompt's came
    hit = cache.lookup([*prompt, 7])
    assert hit is not None and hit.tokens == len(prompt)


def _same_kv(one: KvState, other: KvState) -> bool:
    if isinstance(one, SequenceState) or isinstance(other, SequenceState):
        return one == other
    return all(
        torch.equal(k, k2) and torch.equal(v, v2)
        for (k, v), (k2, v2) in zip(one, other, strict=True)
    )


@pytest.mark.system  # ~12 s an engine: past make test-fast's budget, in the full run
@pytest.mark.parametrize("kind", ["torch", "llama.cpp"])
def test_a_prompt_gives_the_same_bits_with_or_without_a_prefix_cache_hit(llama, reference, kind):
    """Run whole, then again with most of it cached (by itself, and by a longer prompt
    sharing its start), a prompt gives the same first token, logprob and KV bit for bit:
    prefill cuts its passes at fixed positions and uses a hit up to the last of them.
    One pass from wherever the hit ended gave different bits, and llama.cpp's decode
    different greedy text from there."""
    from services.llm.llama_cpp import LlamaCpp

    model = (
        llama
        if kind == "torch"
        else LlamaCpp(gguf_path(), llama.config, sequences=1, max_seq_len=512, threads=1)
    )
    tokenizer = reference[1]
    text = " ".join(f"Item {n}: the colour of the sky on day {n} was blue." for n in range(60))
    ids = tokenizer(text)["input_ids"]
    try:
        for length in (70, 150, 300):
            prompt = ids[:length]
            whole = PrefillEngine(model, PrefixCache(0)).run(prompt, SamplingParams())
            cache = PrefixCache(1 << 28)
            engine = PrefillEngine(model, cache)
            engine.run(ids[: length + 40], SamplingParams())  # a longer prompt, cached
            from_longer = engine.run(prompt, SamplingParams())
            from_itself = engine.run(prompt, SamplingParams())
            assert 0 < from_longer.cached_tokens <= from_itself.cached_tokens < length
            for result in (from_longer, from_itself):
                assert (result.first_token, result.logprob) == (whole.first_token, whole.logprob)
                assert _same_kv(result.kv, whole.kv), (kind, length, result.cached_tokens)
    finally:
        if kind == "llama.cpp":
            model.close()


def _constrained(
    engine: Engine, tokenizer, vocabularies: Vocabularies, prompt: str, length: int
) -> Sequence:
    """A greedy sequence under a regex, its first token masked as prefill masks it."""
    ids = tokenizer(prompt)["input_ids"]
    logits, kv = engine.prefill(ids)
    guide = vocabularies.guide(OutputConstraint(regex=r"[a-z ,.]{1,200}"))
    assert guide is not None
    first = int(logits.masked_fill(~guide.allowed(), float("-inf")).argmax())
    guide.advance(first)
    checker = StopChecker(max_new_tokens=length, eos_ids=frozenset(vocabularies.get().eos_ids))
    checker.feed(first)
    return Sequence(ids, kv, first, SamplingParams(), checker, guide=guide)


async def test_masks_beside_the_forward_pass_or_after_it_sample_the_same(
    engine, reference, llama, model_dir
):
    """A GPU's forward pass leaves the CPU free, and decode computes the masks of a step
    in a second thread meanwhile; on a CPU it computes them after. Either way each
    constrained row keeps its form and the free row its own output."""
    _, tokenizer = reference
    vocabularies = Vocabularies(
        lambda: model_dir, llama.config.vocab_size, llama.config.eos_token_ids
    )
    prompts = ["The capital of France is", "List three colours:"]
    outputs = {}
    for beside in (False, True):
        slots = engine.slots(4, 256)
        slots.forward_on_gpu = beside
        decoder = DecodeEngine(slots, max_batch_size=4, max_seq_len=256)
        decoder.start()
        try:
            sequences = [_constrained(engine, tokenizer, vocabularies, p, 8) for p in prompts]
            free = _sequence(engine, tokenizer, "The quick brown fox", 8)
            for sequence in [*sequences, free]:
                decoder.submit(sequence)
            outputs[beside] = await asyncio.gather(*map(_collect, [*sequences, free]))
        finally:
            await decoder.stop()
    assert outputs[True] == outputs[False]
    *constrained, free = outputs[True]
    for tokens in constrained:
        assert re.fullmatch(r"[a-z ,.]{1,200}", tokenizer.decode(tokens)), tokenizer.decode(tokens)
    assert free == await _alone(engine, tokenizer, "The quick brown fox", 8)

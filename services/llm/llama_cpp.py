"""The llama.cpp engine: the model's GGUF (4-bit weights for the embedded model) on
llama.cpp's hand-written CPU kernels, behind the interface of the torch engine
(services/llm/llama.py), so prefill and decode serve either.

On a CPU a decode step is bound by the bytes of weights it reads: the torch engine reads
fp32, llama.cpp reads Q4_1 with AVX2 kernels made for it (docs/benchmarks.md). Sampling,
penalties, seeds, guided choice and stopping stay the mesh's own, over the logits this
engine returns, so a request behaves alike on both engines.

The binding is llama-cpp-python's low-level ctypes API: its high-level `Llama` keeps one
sequence; here one context holds every decode slot as a llama.cpp sequence id, and one
`llama_decode` steps them all. The KV that moves from prefill to decode is llama.cpp's own
sequence state (`llama_state_seq_get_data` / `_set_data`): its bytes depend on the library
version, the cache's element types and its layout, so the handle says all three
(kv_format) and decode refuses a state it cannot read.
"""

from __future__ import annotations

import ctypes
import logging
import struct
from collections.abc import Sequence
from pathlib import Path

import llama_cpp as lib
import numpy as np
import torch

from aimesh.llm.v1 import kv_cache_pb2
from mesh.failures import NotReady
from services.llm import llama_backend
from services.llm.gguf import llama_errors
from services.llm.kv_codec import KvState, SequenceState
from services.llm.llama import LayerKV, LlamaConfig

log = logging.getLogger(__name__)

ENGINE = "llama.cpp"
ENGINE_VERSION = f"llama-cpp-python {lib.__version__}"
# llama.cpp's default cache types; the state's bytes depend on them.
KV_TYPES = "k=f16,v=f16"
# Every context keeps one KV stream per sequence (kv_unified off), so a sequence's cells
# stay in order in a stream of its own, and its output is bit for bit what it would be
# alone, whoever joins or leaves the batch. With one stream shared, the cells freed by a
# leaving sequence were refilled by its neighbours' next tokens, and their attention,
# summed in cell order in float16, drifted by up to a logit (measured here). A state is
# written by prefill's one-sequence context, so it holds one stream.
LAYOUT = "streams=1"
# A sequence state starts with a magic number and a sequence id (4 bytes each), then the
# KV's stream count (llama-context.cpp state_seq_write_data, llama-kv-cache.cpp
# state_write; checked by the exact version in the KV format and by the tests).
_STREAM_COUNT = slice(8, 12)
# Prompt tokens per llama_decode call in prefill (llama.cpp's default logical batch).
PREFILL_CHUNK = 512
# What a one-stream state holds after its 12-byte head (llama-kv-cache.cpp state_write):
# the cell count; per cell its position, one sequence id and that id; whether V is stored
# transposed and the layer count; then every layer's K rows, then every layer's V rows,
# each preceded by its element type and row size.
_U32, _CELL, _ROWS = struct.Struct("<I"), struct.Struct("<iIi"), struct.Struct("<iQ")
_GGML_F16 = 1


def kv_format(model_sha256: str) -> kv_cache_pb2.KvFormat:
    """What a state written by this engine from the model of `model_sha256` is."""
    return kv_cache_pb2.KvFormat(
        engine=ENGINE,
        engine_version=ENGINE_VERSION,
        model_sha256=model_sha256,
        kv_types=KV_TYPES,
        layout=LAYOUT,
    )


class LlamaCpp:
    """One GGUF model and one context of `sequences` slots of up to `max_seq_len` tokens.

    Not thread-safe: every call runs on the owning service's one model thread.
    """

    def __init__(
        self,
        gguf: Path,
        config: LlamaConfig,
        *,
        sequences: int,
        max_seq_len: int,
        threads: int,
    ) -> None:
        llama_backend.start()
        self.config = config
        self.max_seq_len = max_seq_len
        self.sequences = sequences
        with llama_errors() as errors:
            self._model = lib.llama_model_load_from_file(
                str(gguf).encode(), lib.llama_model_default_params()
            )
        if not self._model:
            raise NotReady(f"llama.cpp could not load {gguf}: {'; '.join(errors) or 'no reason'}")
        self.vocab_size = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self._model))
        if self.vocab_size != config.vocab_size:
            lib.llama_model_free(self._model)
            raise NotReady(
                f"{gguf} has {self.vocab_size} tokens, the model directory {config.vocab_size}: "
                "not the same model"
            )
        self._threads = threads
        self._context = None
        try:
            self._context = self._new_context(sequences, sequences * max_seq_len, unified=False)
            # Whether the sequences share one KV stream: only where a state is not one
            # cache's one block (a sliding-window model keeps two caches, a hybrid a KV cache
            # and a recurrent state), which `_in_streams` cannot rewrite as n streams. Such a
            # state moves between contexts of one stream, and a sequence's attention then
            # sums cells its neighbours also fill, as llama-server's unified cache does.
            self.unified = sequences > 1 and not self._states_are_one_block()
            if self.unified:
                lib.llama_free(self._context)
                self._context = None
                self._context = self._new_context(sequences, sequences * max_seq_len, unified=True)
        except BaseException:
            if self._context:
                lib.llama_free(self._context)
            lib.llama_model_free(self._model)
            raise
        self._memory = lib.llama_get_memory(self._context)
        self._batch = lib.llama_batch_init(max(PREFILL_CHUNK, sequences), 0, 1)
        description = ctypes.create_string_buffer(256)
        lib.llama_model_desc(self._model, description, len(description))
        # "<arch> <size class> <weights' type>", e.g. "llama 256M Q4_1": GetInfo's dtype
        # is the weights' type (the size class is llama.cpp's bucket, not the model's).
        self.weights_type = description.value.decode(errors="replace").split(" ", 2)[-1]
        # A cached prefix's state cut short continues a prompt only where the cache holds
        # every position (not a sliding window's last tokens, not a recurrent state).
        self.reuses_prefix = not (
            lib.llama_model_n_swa(self._model)
            or lib.llama_model_is_recurrent(self._model)
            or lib.llama_model_is_hybrid(self._model)
        )
        self._state_head = self._torch_state_head()
        # Whether torch prefill's KV can be written as this context's state (load).
        self.reads_torch = self._state_head is not None

    def close(self) -> None:
        if self._context:
            lib.llama_batch_free(self._batch)
            lib.llama_free(self._context)
            lib.llama_model_free(self._model)
            self._context = None

    # ---- the calls prefill and decode make ----

    def prefill(
        self,
        token_ids: list[int],
        prefix: SequenceState | None = None,
        cached: int = 0,
        cuts: Sequence[tuple[int, int]] | None = None,
    ) -> tuple[torch.Tensor, SequenceState]:
        """Runs a prompt in slot 0; returns the last position's logits [vocab] and the
        prompt's sequence state, and leaves the slot empty. With a `prefix` (an earlier
        prompt's state from prefill's prefix cache), its first `cached` positions stand for
        the prompt's first `cached` tokens, and only the rest run: in passes of at most
        PREFILL_CHUNK tokens, or in the passes `cuts` gives (services/llm/passes.py)."""
        try:
            if prefix is not None and cached:
                self.load(0, prefix)
                if not lib.llama_memory_seq_rm(self._memory, 0, cached, -1):
                    raise RuntimeError("llama.cpp could not cut a cached prefix short")
            else:
                cached = 0
            if cuts is None:
                starts = range(cached, len(token_ids), PREFILL_CHUNK)
                cuts = [(start, min(start + PREFILL_CHUNK, len(token_ids))) for start in starts]
            for start, end in cuts:
                chunk = token_ids[start:end]
                self._decode(chunk, range(start, end), [0] * len(chunk), False)
            logits = self._logits(1)[0]
            return logits, SequenceState(self._export(0), len(token_ids))
        finally:
            self.free(0)

    # A sequence keeps its slot, a KV stream of its own, until it leaves.
    compacted = False
    forward_on_gpu = False  # this build's kernels are the CPU's

    def decode(self, token_ids: list[int], positions: list[int], slots: list[int]) -> torch.Tensor:
        """One step: token i sits at positions[i] of the sequence in slots[i]. Returns
        logits [n, vocab]."""
        self._decode(token_ids, positions, slots, True)
        return self._logits(len(token_ids))

    def readable(self, kv: KvState) -> SequenceState:
        """A sequence's state as it is, torch prefill's KV written as one (`state_of`,
        which only reads what __init__ set: any thread may call it)."""
        return kv if isinstance(kv, SequenceState) else self.state_of(kv)

    def load(self, slot: int, kv: KvState) -> None:
        """Reads a sequence's state, or torch prefill's KV written as one, into `slot`,
        refusing one that did not fit exactly."""
        state = self.readable(kv)
        self.free(slot)
        data = self._in_streams(state.data)
        buffer = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        read = lib.llama_state_seq_set_data(self._context, buffer, len(data), slot)
        last = lib.llama_memory_seq_pos_max(self._memory, slot)
        if read != len(data) or last != state.num_tokens - 1:
            self.free(slot)
            raise ValueError(
                f"llama.cpp read {read} of {len(state.data)} state bytes ending at position "
                f"{last}, for {state.num_tokens} tokens"
            )

    def state_of(self, kv: list[LayerKV]) -> SequenceState:
        """Torch KV ([kv heads, tokens, head dim] per layer, any float dtype) as this
        context's one-stream state, so that a prefill on torch's GEMMs hands decode KV it
        continues on llama.cpp's kernels. The torch engine rotates K the Hugging Face way
        (dimension i with i + half); llama.cpp's GGUF conversion permuted K's weights so
        that it rotates dimension 2i with 2i + 1, so K's dimensions are permuted likewise."""
        if self._state_head is None:
            raise ValueError(
                "this llama.cpp build's KV state is not one torch KV can be written as"
            )
        tokens = kv[0][0].shape[1]
        cells = np.zeros((tokens, 3), dtype="<i4")
        cells[:, 0] = np.arange(tokens)
        cells[:, 1] = 1
        keys, values = [], []
        for layer_keys, layer_values in kv:
            heads, _, dim = layer_keys.shape
            interleaved = (
                layer_keys.reshape(heads, tokens, 2, dim // 2)
                .transpose(2, 3)
                .reshape(heads, tokens, dim)
            )
            for rows, out in ((interleaved, keys), (layer_values, values)):
                by_token = rows.transpose(0, 1).to(torch.float16).contiguous()
                out += [_ROWS.pack(_GGML_F16, heads * dim * 2), by_token.numpy().tobytes()]
        parts = [self._state_head, _U32.pack(tokens), cells.tobytes()]
        parts += [_U32.pack(0), _U32.pack(len(kv)), *keys, *values]
        return SequenceState(b"".join(parts), tokens)

    def move(self, source: int, target: int, length: int) -> None:
        raise NotImplementedError("llama.cpp sequences keep their slots (compacted is False)")

    def free(self, slot: int) -> None:
        lib.llama_memory_seq_rm(self._memory, slot, -1, -1)

    # ---- helpers ----

    def _decode(
        self,
        tokens: list[int],
        positions: range | list[int],
        slots: range | list[int],
        logits: bool,
    ) -> None:
        """One llama_decode; logits for every token, or (`logits` False) for the last only."""
        batch = self._batch
        count = len(tokens)
        for i, (token, position, slot) in enumerate(zip(tokens, positions, slots, strict=True)):
            batch.token[i] = token
            batch.pos[i] = position
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = slot
            batch.logits[i] = logits or i == count - 1
        batch.n_tokens = count
        status = lib.llama_decode(self._context, batch)
        if status == 1:  # mesh.shared.memory reads this as out of memory
            raise MemoryError("llama.cpp found no free KV cells for this step: out of memory")
        if status != 0:
            raise RuntimeError(f"llama_decode failed with status {status}")

    def _logits(self, rows: int) -> torch.Tensor:
        """The last decode's `rows` outputs' logits, copied out as float32 [rows, vocab]."""
        values = np.ctypeslib.as_array(lib.llama_get_logits(self._context), (rows, self.vocab_size))
        return torch.from_numpy(values.copy())

    def _in_streams(self, data: bytes) -> bytes:
        """A one-stream state rewritten for this context's stream count: the count, the
        stream as it is, and an empty cell count for each other stream (llama.cpp reads a
        sequence's cells into that sequence's own stream whichever block holds them)."""
        one = (1).to_bytes(4, "little")
        if data[_STREAM_COUNT] != one:
            raise ValueError("the state does not hold exactly one KV stream")
        if self.sequences == 1 or self.unified:
            return data
        count = self.sequences.to_bytes(4, "little")
        return data[:8] + count + data[12:] + bytes(4 * (self.sequences - 1))

    def _torch_state_head(self) -> bytes | None:
        """The first 12 bytes of a one-stream state, if the rest of this context's layout
        is what state_of writes (f16 K and V, V not transposed), learned from a state of one
        token llama.cpp writes here; None otherwise. (A context of n streams writes a
        sequence's state as n streams, the others empty: `_in_streams` in reverse.)"""
        c = self.config
        self._decode([c.bos_token_id or 0], [0], [0], False)
        data = self._export(0)
        self.free(0)
        empty = bytes(4 * (self.sequences - 1))
        if data[_STREAM_COUNT] != _U32.pack(self.sequences) or not data.endswith(empty):
            return None
        body = data[12 : len(data) - len(empty)]
        cells = _U32.pack(1) + _CELL.pack(0, 1, 0) + _U32.pack(0) + _U32.pack(c.num_layers)
        if not body.startswith(cells):
            return None
        row = c.num_kv_heads * c.head_dim * 2
        offset = len(cells)
        for _ in range(2 * c.num_layers):  # K of every layer, then V of every layer
            if body[offset : offset + _ROWS.size] != _ROWS.pack(_GGML_F16, row):
                return None
            offset += _ROWS.size + row
        return data[:8] + _U32.pack(1) if offset == len(body) else None

    def _new_context(self, sequences: int, tokens: int, *, unified: bool) -> lib.llama_context_p:
        params = lib.llama_context_default_params()
        params.n_ctx = tokens
        params.n_batch = params.n_ubatch = max(PREFILL_CHUNK, sequences)
        params.n_seq_max = sequences
        params.n_threads = params.n_threads_batch = self._threads
        params.kv_unified = unified
        params.no_perf = True
        with llama_errors() as errors:
            context = lib.llama_init_from_model(self._model, params)
        if not context:
            reason = "; ".join(errors) or "no reason given"
            raise NotReady(f"llama.cpp could not make a context of {tokens} tokens: {reason}")
        return context

    def _states_are_one_block(self) -> bool:
        """Whether a one-token state of this context is a one-stream context's state of the
        same token with the stream count raised and empty streams appended (what
        `_in_streams` writes), learned by writing both: true for a model with one KV cache."""
        token = [self.config.bos_token_id or 0]
        batch = lib.llama_batch_init(1, 0, 1)
        try:
            ours = self._one_token_state(self._context, batch, token)
            probe = self._new_context(1, PREFILL_CHUNK, unified=False)
            try:
                alone = self._one_token_state(probe, batch, token)
            finally:
                lib.llama_free(probe)
        finally:
            lib.llama_batch_free(batch)
        empty = bytes(4 * (self.sequences - 1))
        return ours == alone[:8] + _U32.pack(self.sequences) + alone[12:] + empty

    @staticmethod
    def _one_token_state(
        context: lib.llama_context_p, batch: lib.llama_batch, token: list[int]
    ) -> bytes:
        batch.token[0], batch.pos[0], batch.n_seq_id[0], batch.seq_id[0][0] = token[0], 0, 1, 0
        batch.logits[0] = True
        batch.n_tokens = 1
        if lib.llama_decode(context, batch) != 0:
            raise RuntimeError("llama.cpp could not run one token")
        state = _sequence_state(context, 0)
        lib.llama_memory_seq_rm(lib.llama_get_memory(context), 0, -1, -1)
        return state

    def _export(self, slot: int) -> bytes:
        return _sequence_state(self._context, slot)


def _sequence_state(context: lib.llama_context_p, slot: int) -> bytes:
    """The sequence in `slot` as llama.cpp's state bytes."""
    size = lib.llama_state_seq_get_size(context, slot)
    buffer = (ctypes.c_uint8 * size)()
    if lib.llama_state_seq_get_data(context, buffer, size, slot) != size:
        raise RuntimeError("llama.cpp wrote a sequence state of another size than it said")
    return bytes(buffer)

"""A Llama-family decoder written for serving: prefill one prompt, then step many
sequences at once over a slot KV cache.

transformers' modules are built for one padded batch at a time; continuous batching needs
sequences of different lengths to share one forward pass, joining and leaving between
steps. So the forward pass is written here directly on the weight tensors (fused QKV and
gate/up projections, no nn.Module dispatch), and tests/services/llm/test_llama.py checks
its logits and greedy tokens against transformers' own LlamaForCausalLM.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from mesh.failures import NotReady
from services.llm.artifacts import load_state_dict
from services.llm.linear import Projection, packable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_directory(cls, directory: Path) -> LlamaConfig:
        raw = json.loads((directory / "config.json").read_text())
        if raw.get("model_type") != "llama":
            raise NotReady(
                f"{directory}: the torch engine runs llama models, not "
                f"{raw.get('model_type')!r}; the llama.cpp engine runs it from its GGUF "
                "([engines.llm] gguf = <the model's GGUF>)"
            )
        rope = raw.get("rope_parameters") or {
            "rope_type": (raw.get("rope_scaling") or {}).get("rope_type", "default"),
            "rope_theta": raw.get("rope_theta", 10000.0),
        }
        if rope.get("rope_type", "default") != "default":
            raise NotReady(f"{directory}: rope_type {rope['rope_type']!r} is not supported")
        if raw.get("attention_bias") or raw.get("mlp_bias"):
            raise NotReady(f"{directory}: biased projections are not supported")
        eos = raw.get("eos_token_id")
        generation = directory / "generation_config.json"
        if generation.is_file():
            eos = json.loads(generation.read_text()).get("eos_token_id", eos)
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        heads = raw["num_attention_heads"]
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads", heads),
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw["rms_norm_eps"],
            rope_theta=rope["rope_theta"],
            max_position_embeddings=raw["max_position_embeddings"],
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


@dataclass
class _Layer:
    input_norm: torch.Tensor
    qkv: Projection  # hidden -> (heads + 2 * kv_heads) * head_dim
    out: Projection
    post_norm: torch.Tensor
    gate_up: Projection  # hidden -> 2 * intermediate
    down: Projection


# Per layer: keys and values of one sequence, each [kv_heads, tokens, head_dim].
LayerKV = tuple[torch.Tensor, torch.Tensor]


def resolve_device(name: str) -> torch.device:
    """'auto' | 'cpu' | 'cuda' -> a device; asking for CUDA where torch has none fails."""
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("engines.llm.device is 'cuda', but torch sees no CUDA device")
    use_cuda = name == "cuda" or (name == "auto" and torch.cuda.is_available())
    return torch.device("cuda" if use_cuda else "cpu")


def native_bfloat16(device: torch.device) -> bool:
    """Whether the device multiplies bfloat16 in hardware: a CUDA GPU that supports it, or
    a CPU with AVX-512 BF16 or AMX. Elsewhere bfloat16 halves the bytes a step reads but
    its matrix products are emulated: on this project's AVX2 machines one decode step's
    projections took 19 ms for one row (fp32: 37) but 266 ms for 16 rows (fp32: 68)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto' | 'float32' | 'bfloat16' -> the dtype the model is served in on `device`."""
    if name == "auto":
        return torch.bfloat16 if native_bfloat16(device) else torch.float32
    return getattr(torch, name)


class SlotCache:
    """Preallocated K and V for `slots` sequences of up to `max_len` tokens, per layer.

    Running sequences always occupy slots 0..n-1 (a leaving sequence's slot is refilled
    by moving the last one down), so a decode step attends over plain views
    `[:n, :, :length]` and never copies the cache.
    """

    def __init__(
        self,
        config: LlamaConfig,
        slots: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (slots, config.num_kv_heads, max_len, config.head_dim)
        self.max_len = max_len
        layers = range(config.num_layers)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in layers]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in layers]

    def load(self, slot: int, kv: list[LayerKV]) -> None:
        """Copies one sequence's KV in, from whichever device it arrived on.

        Checked first, since `copy_` broadcasts: a KV with a missing layer or one head
        would otherwise load without complaint and decode garbage."""
        _, heads, _, head_dim = self.keys[0].shape
        if len(kv) != len(self.keys):
            raise ValueError(f"KV has {len(kv)} layers, the cache {len(self.keys)}")
        for k, v in kv:
            if k.shape != v.shape or k.dim() != 3 or (k.shape[0], k.shape[2]) != (heads, head_dim):
                raise ValueError(
                    f"KV of shape {tuple(k.shape)} does not fit ({heads}, n, {head_dim})"
                )
            if k.shape[1] > self.max_len:
                raise ValueError(f"KV of {k.shape[1]} tokens exceeds the cache's {self.max_len}")
        for layer, (k, v) in enumerate(kv):
            length = k.shape[1]
            self.keys[layer][slot, :, :length].copy_(k)
            self.values[layer][slot, :, :length].copy_(v)

    def move(self, source: int, target: int, length: int) -> None:
        for keys, values in zip(self.keys, self.values, strict=True):
            keys[target, :, :length].copy_(keys[source, :, :length])
            values[target, :, :length].copy_(values[source, :, :length])


class TorchSlots:
    """The torch engine's decode slots: a SlotCache and the model stepping over it, with
    the calls the llama.cpp engine (services/llm/llama_cpp.py) answers too."""

    compacted = True  # decode attends over views of the first n slots

    def __init__(self, model: Llama, slots: int, max_len: int) -> None:
        self.model = model
        self.config = model.config
        self.cache = SlotCache(model.config, slots, max_len, model.dtype, model.device)
        self.forward_on_gpu = model.device.type == "cuda"

    def readable(self, kv: list[LayerKV]) -> list[LayerKV]:
        return kv

    def load(self, slot: int, kv: list[LayerKV]) -> None:
        self.cache.load(slot, kv)

    def move(self, source: int, target: int, length: int) -> None:
        self.cache.move(source, target, length)

    def free(self, slot: int) -> None:
        """Nothing to free: a slot's tensors are overwritten when it is next used."""

    def decode(self, token_ids: list[int], positions: list[int], slots: list[int]) -> torch.Tensor:
        if slots != list(range(len(slots))):
            raise ValueError(f"torch decodes slots 0..n-1 in order, not {slots}")
        return self.model.decode(token_ids, positions, self.cache)


class Llama:
    # A cached prefix's KV serves any prompt that starts with it (every position is kept).
    reuses_prefix = True

    def __init__(
        self,
        config: LlamaConfig,
        state: dict[str, torch.Tensor],
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ):
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)

        packed = packable(dtype, self.device)

        def weight(name: str) -> torch.Tensor:
            return state[name].to(device=self.device, dtype=dtype).contiguous()

        def projection(*names: str) -> Projection:
            return Projection(torch.cat([weight(name) for name in names]), packed)

        self.embed = weight("model.embed_tokens.weight")
        self.norm = weight("model.norm.weight")
        head = "lm_head.weight"
        tied = config.tie_word_embeddings or head not in state
        self.lm_head = Projection(self.embed, packed) if tied else projection(head)
        self.layers = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            self.layers.append(
                _Layer(
                    input_norm=weight(p + "input_layernorm.weight"),
                    qkv=projection(*(p + f"self_attn.{n}_proj.weight" for n in ("q", "k", "v"))),
                    out=projection(p + "self_attn.o_proj.weight"),
                    post_norm=weight(p + "post_attention_layernorm.weight"),
                    gate_up=projection(*(p + f"mlp.{n}_proj.weight" for n in ("gate", "up"))),
                    down=projection(p + "mlp.down_proj.weight"),
                )
            )
        inv_freq = 1.0 / (
            config.rope_theta
            ** (torch.arange(0, config.head_dim, 2, dtype=torch.float32) / config.head_dim)
        )
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        angles = torch.cat([freqs, freqs], dim=-1)
        self._cos = angles.cos().to(device=self.device, dtype=dtype)
        self._sin = angles.sin().to(device=self.device, dtype=dtype)

    @classmethod
    def load(
        cls,
        directory: Path,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> Llama:
        config = LlamaConfig.from_directory(directory)
        model = cls(config, load_state_dict(directory), dtype, device)
        # What dtype "auto" and device "auto" came to on this machine, for the operator.
        log.info(
            "model loaded",
            extra={
                "model": directory.name,
                "dtype": str(dtype).removeprefix("torch."),
                "device": str(model.device),
                "packed_weights": model.lm_head.packed,
            },
        )
        return model

    # ---- building blocks ----

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return weight * x32.to(x.dtype)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    def _qkv(
        self, layer: _Layer, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[N, hidden] -> q [N, heads, hd], k and v [N, kv_heads, hd], rotated."""
        c = self.config
        h = self._rms_norm(x, layer.input_norm)
        q, k, v = layer.qkv(h).split(
            [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim],
            dim=-1,
        )
        cos = self._cos[positions].unsqueeze(1)
        sin = self._sin[positions].unsqueeze(1)
        q = self._rope(q.view(-1, c.num_heads, c.head_dim), cos, sin)
        k = self._rope(k.view(-1, c.num_kv_heads, c.head_dim), cos, sin)
        return q, k, v.view(-1, c.num_kv_heads, c.head_dim)

    def _finish_layer(self, layer: _Layer, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        x = x + layer.out(attended)
        gate, up = layer.gate_up(self._rms_norm(x, layer.post_norm)).chunk(2, dim=-1)
        return x + layer.down(F.silu(gate) * up)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """float32 logits on the CPU, where sampling runs whatever the model's device."""
        return self.lm_head(self._rms_norm(x, self.norm)).float().cpu()

    # ---- serving entry points ----

    @torch.inference_mode()
    def prefill(
        self,
        token_ids: list[int],
        prefix: list[LayerKV] | None = None,
        cached: int = 0,
        cuts: Sequence[tuple[int, int]] | None = None,
    ) -> tuple[torch.Tensor, list[LayerKV]]:
        """Runs a prompt; returns the last position's logits [vocab] and its KV. With a
        `prefix` (an earlier prompt's KV from prefill's prefix cache), its first `cached`
        positions stand for the prompt's first `cached` tokens, and only the rest run: in
        one pass, or in the passes `cuts` gives (services/llm/passes.py)."""
        cached = cached if prefix is not None else 0
        logits = torch.empty(0)
        kv = prefix
        for start, end in cuts or [(cached, len(token_ids))]:
            logits, kv = self._pass(token_ids[:end], kv, start)
        assert kv is not None
        return logits, kv

    def _pass(
        self, token_ids: list[int], prefix: list[LayerKV] | None, cached: int
    ) -> tuple[torch.Tensor, list[LayerKV]]:
        """One forward pass over token_ids[cached:], after the prefix's first `cached`."""
        c = self.config
        ids = torch.tensor(token_ids[cached:], dtype=torch.long, device=self.device)
        positions = torch.arange(cached, len(token_ids), device=self.device)
        # After a prefix, query i (position cached + i) sees keys 0 .. cached + i.
        mask = (
            torch.ones(len(ids), len(token_ids), dtype=torch.bool, device=self.device).tril(cached)
            if cached
            else None
        )
        x = self.embed[ids]
        kv: list[LayerKV] = []
        for index, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, positions)
            k_heads, v_heads = k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()
            if prefix is not None and cached:
                past_keys, past_values = prefix[index]
                k_heads = torch.cat([past_keys[:, :cached], k_heads], dim=1)
                v_heads = torch.cat([past_values[:, :cached], v_heads], dim=1)
            kv.append((k_heads, v_heads))
            attended = F.scaled_dot_product_attention(
                q.transpose(0, 1).unsqueeze(0),
                k_heads.unsqueeze(0),
                v_heads.unsqueeze(0),
                attn_mask=mask,
                is_causal=mask is None,
                enable_gqa=c.num_heads != c.num_kv_heads,
            )
            x = self._finish_layer(layer, x, attended[0].transpose(0, 1).reshape(len(ids), -1))
        return self._logits(x[-1:])[0], kv

    @torch.inference_mode()
    def decode(self, token_ids: list[int], positions: list[int], cache: SlotCache) -> torch.Tensor:
        """One step for the sequences in slots 0..n-1; token i sits at positions[i].

        Returns logits [n, vocab]. Each sequence's K/V at its position is written into the
        cache first, then every sequence attends over its own slot up to its position.
        """
        c = self.config
        n = len(token_ids)
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        length = max(positions) + 1
        rows = torch.arange(n, device=self.device)
        # [n, 1, 1, length]: True where a sequence may attend (its own filled positions).
        # A sequence alone attends to all `length` positions and gets no mask: that is
        # transformers' own call, and in bfloat16 it rounds exactly as transformers does.
        span = torch.arange(length, device=self.device)
        mask = (span.unsqueeze(0) <= pos.unsqueeze(1))[:, None, None, :] if n > 1 else None
        x = self.embed[ids]
        for index, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, pos)
            keys, values = cache.keys[index], cache.values[index]
            keys[rows, :, pos] = k
            values[rows, :, pos] = v
            # Grouped-query attention reads each KV head for its query heads in place: no
            # repeated copy of the cache.
            attended = F.scaled_dot_product_attention(
                q.view(n, c.num_heads, 1, c.head_dim),
                keys[:n, :, :length],
                values[:n, :, :length],
                attn_mask=mask,
                enable_gqa=c.num_heads != c.num_kv_heads,
            )
            x = self._finish_layer(layer, x, attended.reshape(n, -1))
        return self._logits(x)

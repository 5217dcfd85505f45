"""Reference Beam target in PyTorch: GQA attention (optional QK-norm), top-k MoE, per-sequence croppable KV cache.

Numerics follow Hugging Face's Qwen3-MoE / Qwen2-MoE (fp32 RMSNorm and router softmax, rotate-half RoPE) so the
logits match transformers; the layout follows Beam (`BeamConfig`). Weights load from a Hugging Face checkpoint
through one name table (`hf_tensor_specs`), fusing q/k/v and gate/up as they are read.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from beamtrt import native
from beamtrt.config import BeamConfig
from beamtrt.errors import CheckpointError, ConfigError


def right_padded(prompts: Sequence[Sequence[int]], device: torch.device | str = "cpu"
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> (ids [B, T] right-padded with 0, lengths [B]): the ragged-batch input of forward()."""
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    ids = torch.zeros(len(prompts), int(lengths.max()), dtype=torch.long, device=device)
    for b, p in enumerate(prompts):
        ids[b, :len(p)] = torch.tensor(p, device=device)
    return ids, lengths


class SlotCache:
    """Per-slot lengths, shared by the target's KV cache and the drafter's context cache."""

    lengths: torch.Tensor  # [B] tokens held per slot

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    def reset(self, slots: Sequence[int]) -> None:
        """Empty the given slots (a finished request's slot is reused by the next)."""
        lengths = self.lengths.clone()  # not in place: lengths may be an inference-mode tensor
        lengths[list(slots)] = 0
        self.lengths = lengths


class KVCache(SlotCache):
    """K/V of every layer for B sequence slots; each slot has its own length and can be cropped (rolled back)."""

    @staticmethod
    def shape(cfg: BeamConfig, batch: int, max_len: int) -> tuple[int, ...]:
        return cfg.num_hidden_layers, batch, cfg.num_key_value_heads, max_len, cfg.head_dim

    def __init__(self, cfg: BeamConfig, batch: int, max_len: int, dtype: torch.dtype, device: torch.device | str):
        shape = self.shape(cfg, batch, max_len)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [L, B, KV, max_len, D]
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)  # [B] committed tokens per slot
        self.max_len = max_len

    def crop(self, lengths: torch.Tensor | Sequence[int], slots: torch.Tensor | None = None) -> None:
        """Roll slots back to `lengths` (each <= its current length); rows past it are dead. Default: every slot."""
        current = self.lengths if slots is None else self.lengths[slots]
        lengths = torch.as_tensor(lengths, dtype=torch.long, device=self.lengths.device)
        if lengths.shape != current.shape or bool((lengths < 0).any() | (lengths > current).any()):
            raise ValueError(f"crop lengths {lengths.tolist()} must be within [0, {current.tolist()}]")
        new = lengths.clone() if slots is None else self.lengths.clone()
        if slots is not None:
            new[slots] = lengths
        self.lengths = new


@dataclass
class BeamOutput:
    logits: torch.Tensor | None  # [B, T, V] fp32 (T = 1 with last_only; None with taps_only)
    taps: list[torch.Tensor]     # per requested layer: [B, T, H], the residual stream after that layer


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # statistics in fp32


class Rotary(nn.Module):
    """Rotate-half RoPE with a lazily grown cos/sin table (default, linear and llama3 frequency rules)."""

    def __init__(self, cfg: BeamConfig):
        super().__init__()
        self.inv_freq = _inv_freq(cfg)  # fp32 on the host; the tables move to the activations' device and dtype
        self.size = 0
        self.tables: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        needed = int(positions.max()) + 1
        if self.size < needed:
            self.size = max(needed, 2 * self.size, 256)
            self.tables.clear()
        key = (positions.device, dtype)
        if key not in self.tables:
            freqs = torch.outer(torch.arange(self.size, dtype=torch.float32, device="cpu"), self.inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)
            signed_sin = torch.cat((-freqs.sin(), freqs.sin()), dim=-1)  # rotate-half's sign, for roll()
            self.tables[key] = emb.cos().to(positions.device, dtype), signed_sin.to(positions.device, dtype)
        cos, sin = self.tables[key]
        return cos[positions], sin[positions]  # [B, T, D] each


def _inv_freq(cfg: BeamConfig) -> torch.Tensor:
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64, device="cpu").float() / d))
    rs = cfg.rope_scaling or {}
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind == "linear":
        inv_freq = inv_freq / rs["factor"]
    elif kind == "llama3":
        factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old_ctx = rs["original_max_position_embeddings"]
        wavelen = 2 * torch.pi / inv_freq
        scaled = torch.where(wavelen > old_ctx / lo, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_ctx / hi) & (wavelen <= old_ctx / lo)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE: x * cos + cat(-x2, x1) * sin, with the sign folded into `sin` (see Rotary)."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)


@dataclass
class StepLayout:
    """Where one forward's tokens go in the KV cache (shared by every layer), and how rows are computed.

    `invariant`: every row gets the same bits whatever the number of rows and tokens in the forward — GEMMs through
    the host kernel's row-invariant GEMM (else one product per row), attention one query at a time over exactly
    its keys, a token's experts summed in id order. The fused host kernel has this property by construction; the
    eager path needs it where that kernel cannot run (quantization hooks, tensor-parallel shards, a shared expert, no
    compiler): there a verify pass of 8 rows and 8 single-token steps otherwise round differently, and FP4-quantized
    activations turn last-bit differences into different tokens.
    """

    positions: torch.Tensor               # [B, T] absolute positions
    rows: torch.Tensor                    # [B, 1] cache slot of each input row
    slots: torch.Tensor | None            # [B] cache slots, or None when the input covers every slot in order
    slot: int                             # the one slot, when B == 1
    mask: torch.Tensor | None             # [B, 1, T, kv_len] key visibility; None for one row and one query, and
    #                                       when invariant (each query then sees exactly its keys)
    kv_len: int                           # keys to attend over: max(start + T)
    rope: tuple[torch.Tensor, torch.Tensor]  # cos, sin: [B, T, D]
    invariant: bool = False               # each row computed as it would be alone (decode / verify shapes, below)


ActHook = Callable[[torch.Tensor], torch.Tensor]
SMALL_M = 16  # LM-head inputs of at most this many rows take the W·xᵀ path on CPU (see lm_logits)


def _host_gemm(x: torch.Tensor, weight: torch.Tensor, rows: int, any_rows: bool = False) -> bool:
    """Whether x [rows, K] · weightᵀ takes the host kernel's GEMM: on CPU, a few rows (any number with `any_rows`),
    outside autograd (it keeps no graph, so a product that needs gradients stays with PyTorch)."""
    return (bool(rows) and x.device.type == "cpu" and native.gemm_usable(weight, rows, any_rows)
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))


@functools.cache
def _half_gemm_native(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies `dtype` (bf16 / fp16) natively in oneDNN (AVX-512 BF16 / FP16, AMX)."""
    check = {torch.bfloat16: "_is_mkldnn_bf16_supported", torch.float16: "_is_mkldnn_fp16_supported"}[dtype]
    try:
        return bool(getattr(torch.ops.mkldnn, check)())
    except (AttributeError, RuntimeError):  # a build without the query: assume the slow path
        return False


def _torch_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, except that bf16/fp16 products on a CPU without native half-precision GEMMs run in fp32 and round
    once (a 101-token beam-mini prefill in bf16 on an AVX2 host: 2.2-2.7 s in bf16, 0.6 s so)."""
    if (x.device.type != "cpu" or weight.dtype not in (torch.bfloat16, torch.float16)
            or _half_gemm_native(weight.dtype)):
        return F.linear(x, weight, bias)
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)


def linear(x: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype | None = None,
           bias: torch.Tensor | None = None, invariant: bool = False) -> torch.Tensor:
    """x [..., K] · weight [N, K]ᵀ (+ bias) in `dtype` (x's by default).

    On CPU, for a few rows outside autograd, through the host kernel's GEMM: CPU BLAS runs x·Wᵀ with a few rows far
    below the weight stream's speed (the drafter's 8-row block: ~5x slower). `invariant`: every row's result is the
    same bits whatever the number of rows (the host GEMM for any row count, else one product per row), which PyTorch's
    GEMMs do not promise (see StepLayout.invariant)."""
    rows = x.numel() // x.shape[-1]
    if _host_gemm(x, weight, rows, invariant):
        y = native.gemm(x.reshape(rows, -1), weight).view(*x.shape[:-1], -1)
        y = y if bias is None else y + bias.float()
    elif invariant and rows:
        flat = x.reshape(rows, -1)
        y = torch.cat([F.linear(flat[i:i + 1], weight, bias) for i in range(rows)]).view(*x.shape[:-1], -1)
    else:
        y = _torch_linear(x, weight, bias)
    return y.to(dtype or x.dtype)


def _gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, invariant: bool) -> torch.Tensor:
    """The target's own GEMMs: row-invariant when asked (see StepLayout), else PyTorch's."""
    return linear(x, weight, bias=bias, invariant=True) if invariant else _torch_linear(x, weight, bias)


def _act(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, invariant: bool) -> torch.Tensor:
    """An elementwise op with exp or tanh inside (silu, sigmoid, soft-capping) on x [..., n]; `invariant`: one row at
    a time. PyTorch's CPU kernels run such ops as vector code in a loop's body and scalar code in its tail (and
    split big tensors between threads), so an element's bits depend on where it falls in the whole tensor."""
    if not invariant or not x.numel():
        return fn(x)
    return torch.stack([fn(row) for row in x.reshape(-1, x.shape[-1])]).view(x.shape)


def _hook(fn: ActHook | None, x: torch.Tensor) -> torch.Tensor:
    return x if fn is None else fn(x)


@dataclass(frozen=True)
class Shard:
    """What one tensor-parallel rank holds and how partial results combine (see runtime/tp.py): the config the
    model is built with is the rank-local one (its heads, intermediate slices and vocabulary rows)."""

    vocab_start: int             # first global vocabulary row of the rank's embedding / LM head rows
    vocab_size: int              # the real (global) vocabulary; the gathered logits are cut to it
    expert_start: int            # first global expert id the rank holds
    num_local_experts: int
    allreduce: Callable[[torch.Tensor], torch.Tensor]   # sum over ranks (identical result on every rank)
    allgather: Callable[[torch.Tensor], torch.Tensor]   # concatenate every rank's last dim
    on_host: Callable[[Any], list] | None = None         # the objects of the ranks sharing this rank's host (Dist's)

    def lookup(self, table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Rows of a vocab-parallel table for global ids: each rank contributes the rows it holds."""
        local = ids - self.vocab_start
        held = (local >= 0) & (local < table.shape[0])
        rows = F.embedding(local.clamp(0, table.shape[0] - 1), table) * held[..., None].to(table.dtype)
        return self.allreduce(rows)


class Attention(nn.Module):
    """GQA attention with fused qkv. Hooks (None = off) see the qkv / o_proj inputs and the new K and V before
    they are cached: emulated activation and KV-cache quantization, or calibration observers."""

    qkv_in: ActHook | None = None
    o_in: ActHook | None = None
    k_out: ActHook | None = None
    v_out: ActHook | None = None
    reduce: ActHook | None = None  # tensor parallel: sum o_proj's partial outputs over ranks

    def __init__(self, cfg: BeamConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        qkv_bias = cfg.attention_bias or cfg.qkv_bias
        self.qkv = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=qkv_bias)  # fused [q; k; v]
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.use_qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.use_qk_norm else None

    def forward(self, x: torch.Tensor, step: StepLayout, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        # x: [B, T, H]; k_cache, v_cache: [slots, KV, max_len, D]
        B, T, _ = x.shape
        rope = step.rope
        heads = _gemm(_hook(self.qkv_in, x), self.qkv.weight, self.qkv.bias, step.invariant)
        heads = heads.view(B, T, -1, self.head_dim)  # [B, T, n_heads + 2 * n_kv, D]
        qk, v = heads[:, :, :self.n_heads + self.n_kv], heads[:, :, self.n_heads + self.n_kv:]
        if self.q_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, :, :self.n_heads]), self.k_norm(qk[:, :, self.n_heads:])), dim=2)
        qk = _rotate(qk, rope[0].unsqueeze(2), rope[1].unsqueeze(2))  # q and k rotated together
        q, k = qk[:, :, :self.n_heads].transpose(1, 2), _hook(self.k_out, qk[:, :, self.n_heads:])
        v = _hook(self.v_out, v)
        if step.invariant:  # each query alone over exactly the keys it sees: the same call for 1 row or many
            out = self.attend_rows(q, k, v, step, k_cache, v_cache)
        elif step.mask is None:  # one row, one query: every key is visible
            keys, values = k_cache[step.slot, :, :step.kv_len], v_cache[step.slot, :, :step.kv_len]  # [KV, S, D]
            keys[:, -1], values[:, -1] = k[0, 0], v[0, 0]
            # the G query heads sharing a KV head act as G queries of one head (no mask: all keys are visible)
            q = q.reshape(1, self.n_kv, -1, self.head_dim)  # [1, KV, G, D]
            out = F.scaled_dot_product_attention(q, keys[None], values[None]).view(B, -1, T, self.head_dim)
        else:
            k_cache[step.rows, :, step.positions] = k  # advanced indices first: [B, T, KV, D]
            v_cache[step.rows, :, step.positions] = v
            if step.slots is None:  # every slot, in order: a view
                keys, values = k_cache[:, :, :step.kv_len], v_cache[:, :, :step.kv_len]  # [B, KV, S, D]
            else:  # a subset of the slots: gathered
                keys, values = k_cache[step.slots, :, :step.kv_len], v_cache[step.slots, :, :step.kv_len]
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=step.mask,
                                                 enable_gqa=self.n_heads != self.n_kv)
        out = _gemm(_hook(self.o_in, out.transpose(1, 2).reshape(B, T, -1)), self.o_proj.weight, self.o_proj.bias,
                    step.invariant)
        return _hook(self.reduce, out)

    def attend_rows(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: StepLayout,
                    k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """Write k, v [B, T, KV, D] into the cache and attend each query q [B, n_heads, T, D] over its slot's keys
        up to its own position, one call per query: [B, n_heads, T, D]. The batched, masked call gives a row other
        bits than the one-row call (different blocking of the keys), which a greedy argmax can notice."""
        k_cache[step.rows, :, step.positions] = k
        v_cache[step.rows, :, step.positions] = v
        out = torch.empty_like(q)
        for b, (slot, positions) in enumerate(zip(step.rows[:, 0].tolist(), step.positions.tolist())):
            for t, position in enumerate(positions):
                keys, values = k_cache[slot, :, :position + 1], v_cache[slot, :, :position + 1]  # [KV, S, D]
                query = q[b, :, t].reshape(1, self.n_kv, -1, self.head_dim)  # [1, KV, G, D]: G heads share a KV head
                out[b, :, t] = F.scaled_dot_product_attention(query, keys[None], values[None]).view(-1, self.head_dim)
        return out


class MLP(nn.Module):
    """SwiGLU with fused [gate; up]; hooks (None = off) see the two GEMM inputs."""

    fc_in: ActHook | None = None
    proj_in: ActHook | None = None
    reduce: ActHook | None = None  # tensor parallel: sum the down projection's partial outputs over ranks

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor, invariant: bool = False) -> torch.Tensor:
        gate, up = linear(_hook(self.fc_in, x), self.gate_up.weight, invariant=invariant).chunk(2, dim=-1)
        act = _act(F.silu, gate, invariant) * up
        return _hook(self.reduce, linear(_hook(self.proj_in, act), self.down.weight, invariant=invariant))


class MoE(nn.Module):
    """Top-k routed experts (softmax in fp32, optional renormalization) plus an optional sigmoid-gated shared expert.

    Hooks (None = off): `fc_in` sees the experts' input once (before routing: it is the same for every expert),
    `proj_in` each expert's SwiGLU output.
    """

    fc_in: ActHook | None = None
    proj_in: ActHook | None = None
    reduce: ActHook | None = None  # tensor / expert parallel: sum the partial outputs over ranks

    def __init__(self, cfg: BeamConfig, experts: tuple[int, int] | None = None):
        """experts: (first id, count) of the experts this module holds (expert parallelism); default all."""
        super().__init__()
        E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.expert_start, self.num_local = experts or (0, E)
        self.router = nn.Linear(H, E, bias=False)  # routes over every expert, held or not
        self.w_gate_up = nn.Parameter(torch.empty(self.num_local, 2 * I, H))  # per expert [gate; up]
        self.w_down = nn.Parameter(torch.empty(self.num_local, H, I))
        self.shared = MLP(H, cfg.shared_expert_intermediate_size) if cfg.shared_expert_intermediate_size else None
        self.shared_gate = nn.Linear(H, 1, bias=False) if self.shared is not None else None

    def route(self, x: torch.Tensor, invariant: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        # x: [N, H] -> weights [N, k] (x.dtype), expert ids [N, k]
        logits = _gemm(x, self.router.weight, None, invariant)
        if self.norm_topk_prob:  # softmax over the top-k logits == renormalized top-k of the full softmax
            top, ids = torch.topk(logits, self.top_k, dim=-1)
            return F.softmax(top, dim=-1, dtype=torch.float32).to(x.dtype), ids
        weights, ids = torch.topk(F.softmax(logits, dim=-1, dtype=torch.float32), self.top_k, dim=-1)
        return weights.to(x.dtype), ids

    def swiglu(self, e: int, x: torch.Tensor, invariant: bool = False) -> torch.Tensor:
        """Expert e's SwiGLU activation (the down projection's input). x: [N, H] -> [N, I]"""
        gate, up = _gemm(x, self.w_gate_up[e - self.expert_start], None, invariant).chunk(2, dim=-1)
        return _act(F.silu, gate, invariant) * up

    def expert(self, e: int, x: torch.Tensor, invariant: bool = False) -> torch.Tensor:
        return _gemm(_hook(self.proj_in, self.swiglu(e, x, invariant)), self.w_down[e - self.expert_start], None,
                     invariant)

    def holds(self, e: int) -> bool:
        return self.expert_start <= e < self.expert_start + self.num_local

    def forward(self, x: torch.Tensor, invariant: bool = False) -> torch.Tensor:
        """x [..., H]; invariant: see StepLayout (a token's experts are added in expert-id order either way)."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, ids = self.route(x, invariant)  # the router (and the shared expert) see the input before the hook
        xe = _hook(self.fc_in, x)
        out = torch.zeros_like(x)
        if x.shape[0] == 1:  # decode at batch 1: no gather/scatter
            for e, w in sorted(zip(ids[0].tolist(), weights[0]), key=lambda pair: pair[0]):
                if self.holds(e):
                    out = out + self.expert(e, xe, invariant) * w
        else:
            for e in filter(self.holds, torch.unique(ids).tolist()):
                token, slot = torch.where(ids == e)
                out.index_add_(0, token, self.expert(e, xe[token], invariant) * weights[token, slot, None])
        if self.shared is not None:  # the shared expert's own partial sums
            gate = _gemm(x, self.shared_gate.weight, None, invariant)
            out = out + self.shared(x, invariant) * _act(torch.sigmoid, gate, invariant)
        return _hook(self.reduce, out).view(shape)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: BeamConfig, layer: int, shard: Shard | None = None):
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        experts = (shard.expert_start, shard.num_local_experts) if shard else None
        self.mlp = MoE(cfg, experts) if cfg.is_moe_layer(layer) else MLP(cfg.hidden_size, cfg.intermediate_size)
        if shard is not None:
            self.attn.reduce = self.mlp.reduce = shard.allreduce
            if getattr(self.mlp, "shared", None) is not None:
                self.mlp.shared.reduce = None  # summed with the routed experts' partials, by MoE.reduce

    def forward(self, x: torch.Tensor, step: StepLayout, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.input_norm(x), step, k_cache, v_cache)
        return x + self.mlp(self.post_attn_norm(x), step.invariant)


class BeamForCausalLM(nn.Module):
    def __init__(self, cfg: BeamConfig, shard: Shard | None = None):
        """shard: this rank's part under tensor parallelism (cfg is then the rank-local config); None = whole."""
        super().__init__()
        self.cfg = cfg
        self.shard = shard
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, shard) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = Rotary(cfg)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def embed_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] -> [..., H] (vocab-parallel under a shard)."""
        return self.embed(ids) if self.shard is None else self.shard.lookup(self.embed.weight, ids)

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        return KVCache(self.cfg, batch, max_len, self.dtype, self.device)

    def head(self, h: torch.Tensor, invariant: bool = False) -> torch.Tensor:
        """Final norm -> LM head -> logit transform. h: [..., H] -> fp32 logits [..., V]."""
        return self.lm_logits(self.norm(h), invariant)

    @property
    def head_weight(self) -> torch.Tensor:
        """The LM head's [V, H] weight: the embedding's when tied."""
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def lm_logits(self, z: torch.Tensor, invariant: bool = False) -> torch.Tensor:
        """LM head + logit transform of an already-normed hidden z: [..., H] -> fp32 [..., V] (the drafter reuses it).
        invariant: see StepLayout."""
        weight = self.head_weight
        rows = z.numel() // z.shape[-1]
        if invariant:
            logits = linear(z, weight, torch.float32, invariant=True)
        elif (1 < rows <= SMALL_M and z.dtype == torch.float32 and z.device.type == "cpu"
                and not _host_gemm(z, weight, rows)):
            # a verify block or a draft without the host kernel: x·Wᵀ with a few rows leaves cores idle in CPU BLAS;
            # W·xᵀ does not (2x faster for 8 rows of beam-mini's 49,152 x 576 head on the 2-core dev machine)
            logits = (weight @ z.reshape(rows, -1).T).T.reshape(*z.shape[:-1], -1)
        else:  # the host kernel's GEMM where `linear` may take it (a draft block, a few rows), else F.linear
            logits = linear(z, weight, torch.float32)
        if self.shard is not None:  # vocab-parallel head: every rank gets the whole row, padding cut off
            logits = self.shard.allgather(logits)[..., :self.shard.vocab_size]
        return self.logit_transform(logits, invariant)

    def logit_transform(self, logits: torch.Tensor, invariant: bool = False) -> torch.Tensor:
        """The config's final logit multiplier and soft-capping, applied to the LM head's fp32 output (invariant: see
        StepLayout)."""
        if self.cfg.logit_scale != 1.0:
            logits = logits * self.cfg.logit_scale
        if self.cfg.final_logit_softcapping is not None:
            cap = self.cfg.final_logit_softcapping
            logits = cap * _act(torch.tanh, logits / cap, invariant)
        return logits

    def step_layout(self, start: torch.Tensor, T: int, slots: torch.Tensor | None = None) -> StepLayout:
        """Where T new tokens per row go: start [B] is each row's current length; slots as in forward().

        Decode and verify shapes (T <= native.MAX_ROWS) on CPU run row-invariant (see StepLayout.invariant):
        speculative greedy decoding is lossless only if a verified row gets the bits a single-token step would."""
        B, device = start.shape[0], start.device
        positions = start[:, None] + torch.arange(T, device=device)  # [B, T]
        kv_len = int(positions[:, -1].max()) + 1
        rows = (torch.arange(B, device=device) if slots is None else slots)[:, None]
        invariant = T <= native.MAX_ROWS and device.type == "cpu"
        mask = None
        if (B > 1 or T > 1) and not invariant:  # key j is visible to query t of row b iff j <= start[b] + t
            mask = (torch.arange(kv_len, device=device) <= positions[..., None])[:, None]  # [B, 1, T, kv]
        return StepLayout(positions, rows, slots, int(rows[0, 0]) if B == 1 else -1, mask, kv_len,
                          self.rotary(positions, self.dtype), invariant)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, cache: KVCache, num_tokens: torch.Tensor | None = None,
                taps: Sequence[int] = (), last_only: bool = False, slots: torch.Tensor | None = None,
                taps_only: bool = False) -> BeamOutput:
        """Append T tokens to cache slots and return their logits (and the requested taps).

        input_ids: [B, T], right-padded; num_tokens: [B] valid tokens per row (default T); slots: [B] the cache
        slot of each row (default: row b -> slot b, and B must equal the cache's batch). Row b's tokens sit at
        positions lengths[slot] + t; the slot's length then grows by num_tokens[b], so padded tokens are dead (their
        logits and taps are meaningless: the fused CPU path skips them and returns zeros there).
        taps_only: return the taps and no logits; the PyTorch path stops after the last tap layer, which leaves the
        cache without the later layers' K/V (for one-shot feature extraction, not for decoding on).
        """
        B, T = input_ids.shape
        device = input_ids.device
        if slots is None and B != cache.batch:
            raise ValueError(f"input batch {B} != cache batch {cache.batch}")
        if B > 1 and T > native.MAX_ROWS and device.type == "cpu":
            return self._row_by_row(input_ids, cache, num_tokens, taps, last_only, slots, taps_only)
        start = cache.lengths if slots is None else cache.lengths[slots]  # [B]
        if num_tokens is None:
            num_tokens = torch.full_like(start, T)
        kv_len = int((start + T).max())
        if kv_len > cache.max_len:
            raise ValueError(f"sequence length {kv_len} exceeds the KV cache capacity {cache.max_len}")
        if last_only:
            out_index = torch.arange(B, device=device) * T + num_tokens - 1  # [B] flat rows whose logits are wanted
        if native.usable(self, cache, T):  # CPU decode / verify: one fused call (see beamtrt.native)
            positions = start[:, None] + torch.arange(T, device=device)
            rows = torch.arange(B, device=device) if slots is None else slots
            live = None if bool((num_tokens == T).all()) else torch.arange(T, device=device) < num_tokens[:, None]
            logits, captured = native.beam_step(self, cache, input_ids, positions, rows,
                                                out_index if last_only else torch.arange(B * T, device=device),
                                                list(taps), live)
            logits = self.logit_transform(logits, invariant=True).view(B, 1 if last_only else T, -1)
            logits = None if taps_only else logits
            captured = [t.to(self.dtype) for t in captured]
        else:
            step = self.step_layout(start, T, slots)
            want = {layer: i for i, layer in enumerate(taps)}
            captured = [None] * len(want)
            h = self.embed_ids(input_ids)
            depth = max(taps) + 1 if taps_only and taps else len(self.layers)
            for i, layer in enumerate(self.layers[:depth]):
                h = layer(h, step, cache.k[i], cache.v[i])
                if i in want:
                    captured[want[i]] = h
            if last_only:
                h = h.reshape(B * T, -1)[out_index][:, None]  # [B, 1, H]
            logits = None if taps_only else self.head(h, step.invariant)
        if slots is None:
            cache.lengths = start + num_tokens
        else:
            lengths = cache.lengths.clone()  # not in place: it may be an inference-mode tensor
            lengths[slots] = start + num_tokens
            cache.lengths = lengths
        return BeamOutput(logits=logits, taps=captured)

    def _row_by_row(self, input_ids: torch.Tensor, cache: KVCache, num_tokens: torch.Tensor | None,
                    taps: Sequence[int], last_only: bool, slots: torch.Tensor | None, taps_only: bool) -> BeamOutput:
        """forward() of a batch wider than the row-invariant shapes on the CPU (a prefill), one row at a time and
        without its padding: batched, a row's GEMMs would take the other rows too, and its last bits (then a greedy
        choice) would depend on what it is batched with, e.g. a prompt's on the requests admitted beside it."""
        B, T = input_ids.shape
        counts = [T] * B if num_tokens is None else num_tokens.tolist()
        if min(counts) < 1:
            raise ValueError("every row of a prefill needs at least one token")
        rows = range(B) if slots is None else slots.tolist()
        outs = [self.forward(input_ids[b:b + 1, :n], cache, None, taps, last_only,
                             torch.tensor([row], device=cache.lengths.device), taps_only)
                for b, (n, row) in enumerate(zip(counts, rows))]

        def padded(parts: list[torch.Tensor]) -> torch.Tensor:  # [1, n_b, X] each -> [B, T, X], zeros past n_b
            return torch.cat([F.pad(t, (0, 0, 0, T - t.shape[1])) for t in parts])
        logits = (None if taps_only else torch.cat([o.logits for o in outs]) if last_only  # [B, 1, V]
                  else padded([o.logits for o in outs]))
        return BeamOutput(logits=logits, taps=[padded([o.taps[i] for o in outs]) for i in range(len(taps))])


# ---- Hugging Face checkpoint: one name table -----------------------------------------------------------------

def hf_tensor_specs(cfg: BeamConfig) -> dict[str, tuple[tuple[int, ...], str, tuple]]:
    """HF tensor name -> (shape, our parameter name, destination slice) for every tensor of a Beam checkpoint.

    The slice is (expert, row offset) into fused parameters; () means the whole parameter.
    """
    H, Q, KV = cfg.hidden_size, cfg.q_size, cfg.kv_size
    specs: dict[str, tuple[tuple[int, ...], str, tuple]] = {
        "model.embed_tokens.weight": ((cfg.vocab_size, H), "embed.weight", ()),
        "model.norm.weight": ((H,), "norm.weight", ()),
    }
    if not cfg.tie_word_embeddings:
        specs["lm_head.weight"] = ((cfg.vocab_size, H), "lm_head.weight", ())
    for i in range(cfg.num_hidden_layers):
        hf, us = f"model.layers.{i}.", f"layers.{i}."
        specs[hf + "input_layernorm.weight"] = ((H,), us + "input_norm.weight", ())
        specs[hf + "post_attention_layernorm.weight"] = ((H,), us + "post_attn_norm.weight", ())
        for proj, rows, offset in (("q", Q, 0), ("k", KV, Q), ("v", KV, Q + KV)):
            specs[hf + f"self_attn.{proj}_proj.weight"] = ((rows, H), us + "attn.qkv.weight", (None, offset))
            if cfg.attention_bias or cfg.qkv_bias:
                specs[hf + f"self_attn.{proj}_proj.bias"] = ((rows,), us + "attn.qkv.bias", (None, offset))
        specs[hf + "self_attn.o_proj.weight"] = ((H, Q), us + "attn.o_proj.weight", ())
        if cfg.attention_bias:
            specs[hf + "self_attn.o_proj.bias"] = ((H,), us + "attn.o_proj.bias", ())
        if cfg.use_qk_norm:
            specs[hf + "self_attn.q_norm.weight"] = ((cfg.head_dim,), us + "attn.q_norm.weight", ())
            specs[hf + "self_attn.k_norm.weight"] = ((cfg.head_dim,), us + "attn.k_norm.weight", ())
        if cfg.is_moe_layer(i):
            I = cfg.moe_intermediate_size
            specs[hf + "mlp.gate.weight"] = ((cfg.num_experts, H), us + "mlp.router.weight", ())
            for e in range(cfg.num_experts):
                ex = hf + f"mlp.experts.{e}."
                specs[ex + "gate_proj.weight"] = ((I, H), us + "mlp.w_gate_up", (e, 0))
                specs[ex + "up_proj.weight"] = ((I, H), us + "mlp.w_gate_up", (e, I))
                specs[ex + "down_proj.weight"] = ((H, I), us + "mlp.w_down", (e, 0))
            if cfg.shared_expert_intermediate_size:
                S = cfg.shared_expert_intermediate_size
                specs[hf + "mlp.shared_expert.gate_proj.weight"] = ((S, H), us + "mlp.shared.gate_up.weight", (None, 0))
                specs[hf + "mlp.shared_expert.up_proj.weight"] = ((S, H), us + "mlp.shared.gate_up.weight", (None, S))
                specs[hf + "mlp.shared_expert.down_proj.weight"] = ((H, S), us + "mlp.shared.down.weight", ())
                specs[hf + "mlp.shared_expert_gate.weight"] = ((1, H), us + "mlp.shared_gate.weight", ())
        else:
            I = cfg.intermediate_size
            specs[hf + "mlp.gate_proj.weight"] = ((I, H), us + "mlp.gate_up.weight", (None, 0))
            specs[hf + "mlp.up_proj.weight"] = ((I, H), us + "mlp.gate_up.weight", (None, I))
            specs[hf + "mlp.down_proj.weight"] = ((H, I), us + "mlp.down.weight", ())
    return specs


def checkpoint_bytes(cfg: BeamConfig, element_size: int) -> int:
    """The weight bytes of a checkpoint of this config, without listing its tensors (a layer count in the millions
    would not fit in memory as a list): the embedding and head, plus each layer's, measured on a 1-layer config of
    the same shape for each kind of layer it has (a larger one could pass the experts a config may have, and a dense
    one where it has no dense layer may lack their width)."""
    def split(dense: bool) -> tuple[int, int]:  # (elements outside the layer, elements of the layer)
        c = dataclasses.replace(cfg, num_hidden_layers=1, decoder_sparse_step=1, mlp_only_layers=(0,) if dense else ())
        specs = hf_tensor_specs(c)
        layer = sum(math.prod(shape) for name, (shape, _, _) in specs.items() if name.startswith("model.layers."))
        return sum(math.prod(shape) for shape, _, _ in specs.values()) - layer, layer

    n_moe = cfg.num_moe_layers
    counts = {False: n_moe, True: cfg.num_hidden_layers - n_moe}  # layers of each kind: MoE, dense
    probes = {dense: split(dense) for dense, n in counts.items() if n}
    outside = next(iter(probes.values()))[0]
    return element_size * (outside + sum(counts[dense] * layer for dense, (_, layer) in probes.items()))


def copy_state(model: nn.Module, specs: dict[str, tuple], tensors: Iterable[tuple[str, torch.Tensor]], kind: str = "",
               ignored: tuple[str, ...] = (), finite: bool = False) -> None:
    """Copy (checkpoint name, tensor) pairs into `model` through a name table {name: (shape, parameter, slice)}, the
    slice () for the whole parameter or (expert or None, row offset) into a fused one; every table entry must be
    supplied, and nothing else but the `ignored` names. kind ("drafter "): named in the errors; finite: a NaN or Inf
    in a floating-point tensor is an error."""
    params = dict(model.named_parameters())
    seen = set()
    with torch.no_grad():
        for name, tensor in tensors:
            if name not in specs:
                if name in ignored:
                    continue
                raise CheckpointError(f"unexpected tensor {name!r} for this {kind}config")
            shape, target, where = specs[name]
            if tuple(tensor.shape) != shape:
                raise CheckpointError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {shape}")
            if finite and tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                raise CheckpointError(f"tensor {name!r} contains NaN or Inf values")
            dest = params[target]
            if where:
                expert, offset = where
                dest = dest if expert is None else dest[expert]
                dest = dest[offset:offset + shape[0]]
            dest.copy_(tensor)
            seen.add(name)
    missing = [n for n in specs if n not in seen]
    if missing:
        raise CheckpointError(f"missing {kind}tensor(s) {', '.join(missing[:5])}" +
                              (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))


def load_state(model: BeamForCausalLM, tensors, only: str | None = None) -> None:
    """Copy (hf_name, tensor) pairs into `model` through the name table; every table entry must be supplied
    (only those whose name starts with `only`, when given: e.g. one layer's)."""
    specs = hf_tensor_specs(model.cfg)
    if only is not None:
        specs = {name: spec for name, spec in specs.items() if name.startswith(only)}
    # tied: HF's state_dict still lists the LM head (it is the embedding), as load_beam allows
    copy_state(model, specs, tensors, ignored=("lm_head.weight",) if model.cfg.tie_word_embeddings else ())


def load_beam(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
              cfg: BeamConfig | None = None, quiet: bool = False) -> BeamForCausalLM:
    """Load a Beam-layout Hugging Face checkpoint directory (config.json + safetensors), streaming tensor by tensor
    (a bar on a terminal unless `quiet`: a large model loads for minutes)."""
    from beamtrt.checkpoint.hf import CheckpointReader
    from beamtrt.cli_util import progress

    cfg = cfg or BeamConfig.from_file(Path(path) / "config.json")
    reader = CheckpointReader(path)
    specs = hf_tensor_specs(cfg)
    reader.validate({name: (shape, None) for name, (shape, _, _) in specs.items()},
                    allow_unexpected=("lm_head.weight",) if cfg.tie_word_embeddings else ())
    with torch.device("meta"):
        model = BeamForCausalLM(cfg)
    check_fits(path, model, dtype, torch.device(device))
    model = model.to_empty(device=device).to(dtype)
    with progress(len(specs), f"loading {Path(path).name or path}", "tensor", quiet) as bar:
        def tensors():
            for name in specs:
                yield name, reader.get(name)
                bar.update()
        load_state(model, tensors())
    return model.eval()


def check_fits(path: str | Path, model: nn.Module, dtype: torch.dtype, device: torch.device, dist=None) -> None:
    """Refuses a model (still on the meta device) whose weights in `dtype` exceed the memory `device` has free: on
    the host, allocating them would succeed (Linux overcommits) and loading them get the process killed without a
    word, by the kernel's out-of-memory killer; a CUDA device would fail partway through. Under mpirun (`dist`, each
    rank's `model` its shard on the host) the shards of the ranks on one host share its memory: their sum is checked,
    against the least any of them found free, on each of those ranks alike and before any of them loads."""
    from beamtrt.cli_util import size_text

    need = sum(t.numel() for t in (*model.parameters(), *model.buffers())) * dtype.itemsize
    free = free_memory(device)
    kind = str(dtype).removeprefix("torch.")
    if dist is None or dist.size == 1:
        if free is not None and need > free:
            raise CheckpointError(f"{path}: its weights take {size_text(need)} in {kind} and {device} has "
                                  f"{size_text(free)} free: this command holds the whole model on one device (a "
                                  "build's checkpoints run it sharded over mpirun ranks)")
        return
    host = dist.on_host((need, free))
    need, free = _host_total(host)
    if free is None or need <= free:
        return
    smaller = ", or run it in bfloat16 (--dtype bfloat16)" if dtype == torch.float32 else ""
    raise CheckpointError(f"{path}: the shards of the {len(host)} ranks on this host take {size_text(need)} in "
                          f"{kind} and it has {size_text(free)} free: spread the ranks over more hosts{smaller}")


def check_cache_fits(what: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                     shard: Shard | None = None) -> None:
    """Refuses a cache of K and V tensors of `shape` each (`what`: what it holds) beyond the memory `device` has free,
    for check_fits' reason, before it is allocated; on the host the ranks sharing it (`shard`'s on_host) together."""
    from beamtrt.cli_util import size_text

    on_host = shard.on_host if shard is not None and device.type == "cpu" else None
    if on_host is not None:  # a barrier: every rank has dropped its old cache (rank 0 runs the call first)
        on_host(None)
    need, free, ranks = 2 * math.prod(shape) * dtype.itemsize, free_memory(device), 1
    if on_host is not None:
        host = on_host((need, free))
        (need, free), ranks = _host_total(host), len(host)
    if free is not None and need > free:
        whose = f", on the {ranks} ranks of this host together," if ranks > 1 else ""
        raise ConfigError(f"the {what} takes {size_text(need)}{whose} and {device} has {size_text(free)} free: "
                          "decode fewer requests at once, or shorter ones")


def _host_total(host: list[tuple[int, int | None]]) -> tuple[int, int | None]:
    """(bytes, free bytes) of each rank on a host -> their sum and the least free (None: a rank could not tell)."""
    return sum(n for n, _ in host), None if any(f is None for _, f in host) else min(f for _, f in host)


def free_memory(device: torch.device) -> int | None:
    """Bytes `device` can still allocate (the host's MemAvailable, a CUDA device's free memory); None if unknown."""
    if device.type == "cuda":  # with the blocks torch's caching allocator holds unused (a dropped cache's)
        spare = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return torch.cuda.mem_get_info(device)[0] + spare
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None

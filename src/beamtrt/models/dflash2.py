"""Reference DFlash 2 block drafter in PyTorch: windowed tapped-context attention, two-tap convs, selector."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from beamtrt import native
from beamtrt.config import BeamConfig, DrafterConfig
from beamtrt.errors import CheckpointError, ConfigError
from beamtrt.models.beam import (MLP, ActHook, BeamForCausalLM, RMSNorm, Rotary, SlotCache, _hook, _rotate, copy_state,
                                linear)

CONV_SIDES = 2  # side 0 = before the sublayer ("prepare"), side 1 = after it ("finish")


# ---- two-tap grouped dynamic convolution (dflash.md §4.2) ------------------------------------------------------

class GroupedConv2Tap(nn.Module):
    """Per-token dynamic depthwise conv with taps [x_i, x_{i-1}] that never cross a block boundary.

    coef[i, side, t, c] = base_kernel[side, t, c] + δ_i[side, t, c // g],  δ_i = kernel_projection(x_i)
    where x is the sublayer input (after its RMSNorm); `prepare` convolves x with side 0, `finish` convolves the
    sublayer output z with side 1 using the same δ. Tokens are laid out as consecutive blocks of `block` rows;
    in-block position p reads x_{i-t} only when p >= t (zeros otherwise), so block 0 position 0 reads zeros.
    """

    def __init__(self, hidden: int, kernel_size: int = 2, group_size: int = 16):
        super().__init__()
        if hidden % group_size:
            raise ValueError(f"conv group size {group_size} does not divide hidden size {hidden}")
        self.kernel_size, self.group_size, self.groups = kernel_size, group_size, hidden // group_size
        self.base_kernel = nn.Parameter(torch.empty(CONV_SIDES, kernel_size, hidden))  # [2, T, H]
        self.kernel_projection = nn.Linear(hidden, CONV_SIDES * kernel_size * self.groups, bias=False)
        self.reset_identity()

    @torch.no_grad()
    def reset_identity(self) -> None:
        """base[:, 0] = 1, base[:, 1:] = 0, projection = 0: both sides return their input bit for bit."""
        self.base_kernel.zero_()
        self.base_kernel[:, 0] = 1.0
        self.kernel_projection.weight.zero_()

    def prepare(self, x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [N, L, H] (L a multiple of `block`) -> (y [N, L, H], δ [N, L, 2, T, G] for `finish`)."""
        N, L, _ = x.shape
        delta = linear(x, self.kernel_projection.weight).view(N, L, CONV_SIDES, self.kernel_size, self.groups)
        return self._conv(x, 0, delta, block), delta

    def finish(self, z: torch.Tensor, block: int, delta: torch.Tensor) -> torch.Tensor:
        """z: [N, L, H] sublayer output; delta: from `prepare` of the same tokens -> [N, L, H]."""
        return self._conv(z, 1, delta, block)

    def _conv(self, x: torch.Tensor, side: int, delta: torch.Tensor, block: int) -> torch.Tensor:
        N, L, H = x.shape
        if L % block:
            raise ValueError(f"conv input of {L} tokens is not a whole number of blocks of {block}")
        coef = self.base_kernel[side] + delta[:, :, side].repeat_interleave(self.group_size, dim=-1)  # [N, L, T, H]
        blocks = x.reshape(N, L // block, block, H)
        out = coef[:, :, 0] * x
        for t in range(1, self.kernel_size):  # tap t reads in-block position p - t; zeros where p < t
            shifted = F.pad(blocks, (0, 0, t, 0))[:, :, :block].reshape(N, L, H)
            out = out + coef[:, :, t] * shifted
        return out


# ---- one draft layer -----------------------------------------------------------------------------------------

@dataclass
class RingContext:
    """The context as the windowed-attention kernel reads it: the whole ring and each sequence's length."""

    ring_k: torch.Tensor  # [N, KV, W, D], keys already rotated
    ring_v: torch.Tensor  # [N, KV, W, D]
    start: torch.Tensor   # [N] context tokens appended so far (ring slots [0, min(start, W)) are visible)
    kernels: object       # beamtrt.native.kernels.HostKernels / CudaKernels

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [N, L, Hq, D], k / v [N, L, KV, D] (the block) -> [N, L, Hq, D]."""
        N, _, kv, D = k.shape
        none = k.new_empty(N, 0, kv, D)
        count = torch.zeros_like(self.start, dtype=torch.int32)
        return self.kernels.windowed_attention(q.contiguous(), k.contiguous(), v.contiguous(), none, none,
                                               self.start.to(torch.int32), count, self.ring_k.contiguous(),
                                               self.ring_v.contiguous())


class DraftAttention(nn.Module):
    """Qwen3 attention (per-head q/k RMSNorm, GQA, no bias) whose keys are [context K/V] + [the block's own K/V].

    Hooks (None = off) see the qkv GEMM's input (block rows and fused context features) and o_proj's input:
    emulated activation quantization, or calibration observers."""

    qkv_in: ActHook | None = None
    o_in: ActHook | None = None
    reduce: ActHook | None = None  # tensor parallel: sum o_proj's partial outputs over ranks

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.qkv = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=False)  # fused [q; k; v]
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def context_kv(self, c: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """c: [N, T, H] fused context features; rope: [N, T, D] at their positions -> k, v: [N, T, KV, D]."""
        N, T, _ = c.shape
        kv = linear(_hook(self.qkv_in, c), self.qkv.weight[self.q_size:]).view(N, T, 2 * self.n_kv, self.head_dim)
        k, v = self.k_norm(kv[:, :, :self.n_kv]), kv[:, :, self.n_kv:]
        return _rotate(k, rope[0].unsqueeze(2), rope[1].unsqueeze(2)), v

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], ctx_k: torch.Tensor,
                ctx_v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        # x: [N, L, H] block rows; rope: [N, L, D]; ctx_k, ctx_v: [N, KV, S, D] rotated context rows;
        # mask: [N, 1, L, S + L] bool, True = visible (context columns first, then the L block columns)
        N, L, _ = x.shape
        heads = linear(_hook(self.qkv_in, x), self.qkv.weight)  # [N, L, (n_heads + 2 * n_kv) * D]
        heads = heads.view(N, L, -1, self.head_dim)
        q = self.q_norm(heads[:, :, :self.n_heads])
        k = self.k_norm(heads[:, :, self.n_heads:self.n_heads + self.n_kv])
        v = heads[:, :, self.n_heads + self.n_kv:]
        cos, sin = rope[0].unsqueeze(2), rope[1].unsqueeze(2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        if isinstance(ctx_k, RingContext):  # the windowed-attention kernel over the ring (no append: count 0)
            out = ctx_k.attend(q, k, v)  # [N, L, n_heads, D]
            return _hook(self.reduce, linear(_hook(self.o_in, out.reshape(N, L, -1)), self.o_proj.weight))
        keys = torch.cat((ctx_k, k.transpose(1, 2)), dim=2)  # [N, KV, S + L, D]
        values = torch.cat((ctx_v, v.transpose(1, 2)), dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask,
                                             enable_gqa=self.n_heads != self.n_kv)  # [N, n_heads, L, D]
        out = out.transpose(1, 2).reshape(N, L, -1)  # [N, L, n_heads * D]
        return _hook(self.reduce, linear(_hook(self.o_in, out), self.o_proj.weight))


class DraftLayer(nn.Module):
    """input_layernorm → attention_conv.prepare → self_attn → attention_conv.finish → +residual, same for the MLP."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        H = cfg.hidden_size
        self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.self_attn = DraftAttention(cfg)
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.mlp = MLP(H, cfg.intermediate_size)
        self.attention_conv = GroupedConv2Tap(H, cfg.conv_kernel_size, cfg.conv_group_size)
        self.mlp_conv = GroupedConv2Tap(H, cfg.conv_kernel_size, cfg.conv_group_size)

    def forward(self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], ctx_k: torch.Tensor,
                ctx_v: torch.Tensor, mask: torch.Tensor, block: int, use_conv: bool = True) -> torch.Tensor:
        """h: [N, L, H], L = whole blocks of `block` rows (inference: L = block; training: many blocks + a
        block-diagonal mask). ctx_k/ctx_v/mask as in DraftAttention. Context rows are never convolved."""
        x = self.input_layernorm(h)
        if use_conv:
            y, delta = self.attention_conv.prepare(x, block)
            h = h + self.attention_conv.finish(self.self_attn(y, rope, ctx_k, ctx_v, mask), block, delta)
        else:
            h = h + self.self_attn(x, rope, ctx_k, ctx_v, mask)
        x = self.post_attention_layernorm(h)
        if use_conv:
            y, delta = self.mlp_conv.prepare(x, block)
            return h + self.mlp_conv.finish(self.mlp(y), block, delta)
        return h + self.mlp(x)


# ---- candidate selector (dflash.md §4.3) ---------------------------------------------------------------------

class CandidateSelector(nn.Module):
    """Top-K candidates per slot plus pairwise edge scores S_t(a, b) = U_t(b) + Σ_r A[a,r]·g_t[r]·B[b,r]."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        V, r = cfg.vocab_size, cfg.selector_rank
        self.predecessor_codebook = nn.Parameter(torch.zeros(V, r))  # A
        self.successor_codebook = nn.Parameter(torch.zeros(V, r))    # B
        self.hidden_projection = nn.Linear(cfg.hidden_size, r, bias=False)  # g_t = W_h h_t
        nn.init.zeros_(self.hidden_projection.weight)
        self.shard = None  # tensor parallel: the codebooks hold this rank's vocabulary rows

    def edge_scores(self, logits: torch.Tensor, hidden: torch.Tensor, anchor_ids: torch.Tensor, top_k: int,
                    vocab_ids: torch.Tensor | None = None, invariant: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """logits: [N, S, V] fp32 unary scores (vocab_ids [V]: the token id of each column when they cover a slice of
        the vocabulary); hidden: [N, S, H] final-normed; anchor_ids: [N]; invariant: row-invariant products ->
        (cand_ids [N, S, K] long, top-K of each slot in descending logit order;
         scores [N, S, K, K] fp32, scores[n, t, i, j] = S_t(pred_i, cand_j)),
        with pred_i = candidate i of slot t-1 for t >= 1 and the anchor for t = 0 (all K rows of slot 0 equal)."""
        N, S, _ = logits.shape
        unary, cand = torch.topk(logits, top_k, dim=-1)  # [N, S, K]
        if vocab_ids is not None:
            cand = vocab_ids[cand]
        pred = torch.cat((anchor_ids.view(N, 1, 1).expand(N, 1, top_k), cand[:, :-1]), dim=1)  # [N, S, K]
        g = linear(hidden, self.hidden_projection.weight, invariant=invariant).float()  # [N, S, r]
        lookup = (lambda table, ids: table[ids]) if self.shard is None else self.shard.lookup  # vocab-parallel
        a = lookup(self.predecessor_codebook, pred).float()  # [N, S, K, r]
        b = lookup(self.successor_codebook, cand).float()
        edge = torch.einsum("nsir,nsjr->nsij", a * g.unsqueeze(2), b)
        return cand, unary.float().unsqueeze(2) + edge

    def teacher_forced_scores(self, logits: torch.Tensor, hidden: torch.Tensor, prev_ids: torch.Tensor,
                              top_k: int, vocab_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Training form of `edge_scores` with known predecessors: logits [N, S, V]; hidden [N, S, H];
        prev_ids [N, S] the true token before each slot (the anchor for slot 0) ->
        (cand_ids [N, S, K], scores [N, S, K] fp32 = S_t(prev_t, cand_j)); gradients reach the logits too.
        vocab_ids [V]: the token id of each logit column when the logits cover a slice of the vocabulary."""
        unary, cand = torch.topk(logits, top_k, dim=-1)  # [N, S, K]
        if vocab_ids is not None:
            cand = vocab_ids[cand]
        g = linear(hidden, self.hidden_projection.weight).float()  # [N, S, r]
        a = self.predecessor_codebook[prev_ids].float()  # [N, S, r]
        b = self.successor_codebook[cand].float()  # [N, S, K, r]
        return cand, unary.float() + torch.einsum("nsr,nskr->nsk", a * g, b)


# ---- windowed context cache (dflash.md §1.2) -----------------------------------------------------------------

class DraftCache(SlotCache):
    """Context K/V of every draft layer for `batch` sequences, in a ring of W = sliding_window slots per sequence.

    Context position p lives in slot p mod W; `lengths[n]` = context tokens appended so far = the next anchor
    position s. A block anchored at s sees exactly context positions [max(0, s - W), s): when s >= W the ring
    holds precisely those W positions, otherwise slots [0, s). Only committed tokens are ever appended and the
    block's own K/V is never written, so the cache only grows (no crop); `reset` empties finished slots.
    """

    @staticmethod
    def shape(cfg: DrafterConfig, batch: int) -> tuple[int, ...]:
        return cfg.num_hidden_layers, batch, cfg.num_key_value_heads, cfg.sliding_window, cfg.head_dim

    def __init__(self, cfg: DrafterConfig, batch: int, dtype: torch.dtype, device: torch.device | str):
        self.window = cfg.sliding_window
        shape = self.shape(cfg, batch)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [L, N, KV, W, D], keys already rotated
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)  # [N]

    def visible(self) -> torch.Tensor:
        """[N, W] bool: which ring slots a block anchored at `lengths` may read."""
        slots = torch.arange(self.window, device=self.lengths.device)
        return slots < self.lengths.clamp(max=self.window)[:, None]


@dataclass
class DraftOutput:
    logits: torch.Tensor    # [N, B-1, V] fp32, block positions 1..B-1, the target's logit transform applied
    hidden: torch.Tensor    # [N, B-1, H] final-normed draft hidden (what the LM head and the selector read)
    cand_ids: torch.Tensor | None  # [N, B-1, K] long, top-K of each slot's logits (None: lattice=False)
    scores: torch.Tensor | None    # [N, B-1, K, K] fp32 selector edge scores (see CandidateSelector.edge_scores)


# ---- the drafter ---------------------------------------------------------------------------------------------

class DFlash2Drafter(nn.Module):
    """DFlash 2 drafter over a frozen Beam target (whose embedding and LM head it borrows, not owns)."""

    def __init__(self, cfg: DrafterConfig, target: BeamForCausalLM, shard=None):
        """shard: this rank's beamtrt.models.beam.Shard under tensor parallelism (cfg is then rank-local)."""
        super().__init__()
        cfg.check_target(target.cfg)
        self.source_version = cfg.version  # 1: loaded from a DFlash v1 checkpoint (identity convs, zero selector)
        self.cfg = cfg if cfg.version == 2 else dataclasses.replace(cfg, version=2)
        self.__dict__["target"] = target  # plain attribute: not a submodule, so not in parameters()/state_dict()
        H = cfg.hidden_size
        self.fc = nn.Linear(cfg.num_taps * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.candidate_selector = CandidateSelector(cfg)
        if shard is not None:
            self.candidate_selector.shard = shard
            for layer in self.layers:
                layer.self_attn.reduce = layer.mlp.reduce = shard.allreduce
        self.rotary = Rotary(cfg)  # DrafterConfig has the fields Rotary reads (head_dim, rope_theta, rope_scaling)
        self.use_conv = True  # False only to compare against a DFlash v1 forward in tests
        self.kernels = None  # the plugin kernels (beamtrt.native.kernels) when the runtime chose them
        self.draft_vocab: torch.Tensor | None = None  # [V'] sorted token ids the drafts come from (None: all)
        self._vocab_head: tuple | None = None  # (key, the LM head's rows of draft_vocab), built on first use

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def vocab_size(self) -> int:
        """The whole vocabulary (cfg.vocab_size is this rank's part under tensor parallelism)."""
        shard = self.target.shard
        return shard.vocab_size if shard is not None else self.cfg.vocab_size

    def set_draft_vocab(self, ids: torch.Tensor | Sequence[int] | None) -> None:
        """Draft only from these token ids (None: the whole vocabulary): every other token's logit is -inf, and the LM
        head reads only their rows. A drafter trained with `--head-vocab seen` was scored on exactly its training
        data's tokens and never learned to push the others down; `train_drafter.py` stores that set with it."""
        self._vocab_head = None
        self.draft_vocab = None if ids is None else check_draft_vocab(ids, self.vocab_size,
                                                                      self.cfg.selector_top_k).to(self.device)

    def new_cache(self, batch: int) -> DraftCache:
        return DraftCache(self.cfg, batch, self.dtype, self.device)

    def reset(self, cache: DraftCache, slots: Sequence[int]) -> None:
        cache.reset(slots)

    def fuse_context(self, taps: torch.Tensor) -> torch.Tensor:
        """taps: [..., n_taps * H_target] concatenated target residual streams -> c = hidden_norm(fc(taps)) [..., H]."""
        return self.hidden_norm(linear(taps.to(self.dtype), self.fc.weight))

    @torch.inference_mode()
    def append_context(self, cache: DraftCache, taps: torch.Tensor, num_tokens: torch.Tensor | None = None) -> None:
        """Append committed tokens' target features to every layer's context K/V.

        taps: [N, T, n_taps * H], right-padded; num_tokens: [N] valid rows (default T). Row n's token t sits at
        position cache.lengths[n] + t; lengths then grow by num_tokens[n]. Only the last W positions of each
        sequence are written (older ones would be overwritten in the ring anyway).
        """
        taps = taps.to(self.device)
        N, T, F_ = taps.shape
        if N != cache.batch:
            raise ValueError(f"taps batch {N} != cache batch {cache.batch}")
        if F_ != self.fc.in_features:
            raise ValueError(f"taps have {F_} features, expected {self.fc.in_features} "
                             f"({self.cfg.num_taps} taps x {self.cfg.hidden_size})")
        start = cache.lengths
        num_tokens = torch.full_like(start, T) if num_tokens is None else num_tokens.to(start.device, torch.long)
        if bool(((num_tokens < 0) | (num_tokens > T)).any()):
            raise ValueError(f"num_tokens {num_tokens.tolist()} must be within [0, {T}]")
        end = start + num_tokens
        positions = start[:, None] + torch.arange(T, device=start.device)  # [N, T]
        keep = (positions < end[:, None]) & (positions >= end[:, None] - cache.window)  # distinct ring slots
        rows, cols = keep.nonzero(as_tuple=True)
        slots = positions[rows, cols] % cache.window
        if rows.numel() and native.draft_usable(self, cache):  # the fused host append (native/draft_step.cpp)
            cos, sin = self.rotary(positions[rows, cols], torch.float32)
            native.draft_append(self, cache, taps[rows, cols], rows, slots, cos, sin)
        elif rows.numel():
            c = self.fuse_context(taps[rows, cols][None])  # [1, M, H] only the rows that are kept
            cos, sin = self.rotary(positions[rows, cols][None], self.dtype)
            for i, layer in enumerate(self.layers):
                k, v = layer.self_attn.context_kv(c, (cos, sin))  # [1, M, KV, D]
                cache.k[i][rows, :, slots] = k[0]  # advanced indices first: [M, KV, D]
                cache.v[i][rows, :, slots] = v[0]
        cache.lengths = end

    @torch.inference_mode()
    def draft(self, cache: DraftCache, anchor_ids: torch.Tensor, block_size: int,
              slots: torch.Tensor | None = None, lattice: bool = True) -> DraftOutput:
        """Run one block per sequence and return its drafts' logits, hidden states and selector lattice.

        anchor_ids: [N], the last committed token x_s of each sequence (of cache slot slots[n] when `slots` [N] is
        given, else of slot n), whose position s = the slot's length (the
        cache must already hold every token before it, and not the anchor itself: the anchor's target features
        are not known until the next verify). The block is [x_s, MASK × (block_size−1)] at positions
        s .. s+block_size−1, embedded with the target's embedding; its queries see context positions
        [max(0, s−W), s) and all block positions (bidirectional); its K/V are never written to the cache.

        Worked example (W = 4, block_size = 3): a 6-token prompt x0..x5 is prefilled by the target, which samples
        x6. append_context(taps of x0..x5) → lengths = 6, ring slots hold positions 4,5,2,3 (slot = p mod 4).
        draft(anchor x6) runs ids [x6, M, M] at positions 6, 7, 8; every block query attends to context
        positions 2..5 plus the 3 block rows; outputs are for positions 7 and 8 (logits[:, 0] drafts x7).
        If the target accepts x7 and emits bonus x8, the runtime appends the taps of x6, x7 (positions 6, 7;
        lengths → 8, the ring now holds 4..7) and drafts again with anchor x8 at position 8.
        """
        N, B = anchor_ids.shape[0], block_size
        if slots is None and N != cache.batch:
            raise ValueError(f"anchor batch {N} != cache batch {cache.batch}")
        if B < 2:
            raise ValueError(f"block_size must be >= 2 (anchor + at least one draft), got {B}")
        target = self.target
        start = cache.lengths if slots is None else cache.lengths[slots]  # [N]
        positions = start[:, None] + torch.arange(B, device=start.device)  # [N, B]
        ids = torch.full((N, B), self.cfg.mask_token_id, dtype=torch.long, device=self.device)
        anchor_ids = anchor_ids.to(self.device)
        ids[:, 0] = anchor_ids
        if native.draft_usable(self, cache):  # the fused host block (native/draft_step.cpp)
            cos, sin = self.rotary(positions, torch.float32)
            rings = torch.arange(N) if slots is None else slots
            z = native.draft_block(self, cache, ids, rings, start, cos, sin).to(self.dtype)
            return self.head(z, anchor_ids, lattice, invariant=True)
        h = target.embed_ids(ids).to(self.dtype)
        rope = self.rotary(positions, self.dtype)
        used = min(cache.window, int(start.max()))  # ring slots ever written: attend over those only
        visible = cache.visible() if slots is None else cache.visible()[slots]
        ctx = visible[:, None, :used].expand(N, B, used)  # [N, B, used]
        mask = torch.cat((ctx, ctx.new_ones(N, B, B)), dim=-1)[:, None]  # [N, 1, B, used + B]
        for i, layer in enumerate(self.layers):
            if self.kernels is not None:  # the plugin kernel reads the ring itself (plugins/windowed_attention)
                ring_k, ring_v = (cache.k[i], cache.v[i]) if slots is None else (cache.k[i][slots], cache.v[i][slots])
                h = layer(h, rope, RingContext(ring_k, ring_v, start, self.kernels), None, None, B, self.use_conv)
                continue
            k, v = cache.k[i][:, :, :used], cache.v[i][:, :, :used]  # [slots, KV, used, D]
            if slots is not None:  # only the requested sequences (gathered)
                k, v = k[slots], v[slots]
            h = layer(h, rope, k, v, mask, B, self.use_conv)
        return self.head(self.norm(h[:, 1:]), anchor_ids, lattice)

    def head(self, z: torch.Tensor, anchor_ids: torch.Tensor, lattice: bool, invariant: bool = False) -> DraftOutput:
        """z: [N, B-1, H] final-normed block hidden -> the drafts' logits (from the draft vocabulary only, when there
        is one) and, with `lattice`, the selector's.
        invariant: each row's products the same bits whatever the other rows (the fused host block's are, so a
        request's proposal then does not depend on the requests drafted beside it); else PyTorch's GEMMs past a few
        rows."""
        target = self.target
        vocab = None if self.draft_vocab is None else self.draft_vocab.to(z.device)
        if vocab is None:
            unary = logits = target.lm_logits(z.to(target.dtype), invariant=invariant)  # fp32 [N, B-1, V]
        else:
            unary = self._vocab_logits(z, invariant)  # fp32 [N, B-1, V'] the draft vocabulary's columns
            logits = unary.new_full((*unary.shape[:-1], self.vocab_size), float("-inf"))
            logits[..., vocab] = unary
        if not lattice:  # the caller selects with the plugin kernel, from the logits and z
            return DraftOutput(logits=logits, hidden=z, cand_ids=None, scores=None)
        top_k = min(self.cfg.selector_top_k, unary.shape[-1])
        cand, scores = self.candidate_selector.edge_scores(unary, z, anchor_ids, top_k, vocab_ids=vocab,
                                                            invariant=invariant)
        return DraftOutput(logits=logits, hidden=z, cand_ids=cand, scores=scores)

    def _vocab_logits(self, z: torch.Tensor, invariant: bool = False) -> torch.Tensor:
        """z: [N, S, H] -> fp32 [N, S, V'] logits of the draft vocabulary: only its LM-head rows are read (a copy
        made once), except under a vocabulary-parallel head, whose gathered rows are sliced."""
        target = self.target
        if target.shard is not None:
            return target.lm_logits(z.to(target.dtype))[..., self.draft_vocab]
        weight = target.head_weight
        key = (weight.data_ptr(), weight.dtype, weight.device)
        if self._vocab_head is None or self._vocab_head[0] != key:
            self._vocab_head = (key, weight.detach()[self.draft_vocab.to(weight.device)].contiguous())
        return target.logit_transform(linear(z.to(weight.dtype), self._vocab_head[1], torch.float32,
                                             invariant=invariant), invariant)


# ---- checkpoint name table -----------------------------------------------------------------------------------

V2_ONLY = ("attention_conv.", "mlp_conv.", "candidate_selector.")


def drafter_tensor_specs(cfg: DrafterConfig, v1: bool = False) -> dict[str, tuple[tuple[int, ...], str, int | None]]:
    """Checkpoint tensor name -> (shape, our parameter name, row offset into a fused parameter or None).

    v1=True: the DFlash v1 subset (no convs, no selector).
    """
    H, Q, KV, I, D = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size, cfg.head_dim
    T, G, V, r = cfg.conv_kernel_size, cfg.hidden_size // cfg.conv_group_size, cfg.vocab_size, cfg.selector_rank
    specs: dict[str, tuple[tuple[int, ...], str, int | None]] = {
        "fc.weight": ((H, cfg.num_taps * H), "fc.weight", None),
        "hidden_norm.weight": ((H,), "hidden_norm.weight", None),
        "norm.weight": ((H,), "norm.weight", None),
    }
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        for proj, rows, offset in (("q", Q, 0), ("k", KV, Q), ("v", KV, Q + KV)):
            specs[p + f"self_attn.{proj}_proj.weight"] = ((rows, H), p + "self_attn.qkv.weight", offset)
        specs[p + "self_attn.o_proj.weight"] = ((H, Q), p + "self_attn.o_proj.weight", None)
        specs[p + "self_attn.q_norm.weight"] = ((D,), p + "self_attn.q_norm.weight", None)
        specs[p + "self_attn.k_norm.weight"] = ((D,), p + "self_attn.k_norm.weight", None)
        specs[p + "mlp.gate_proj.weight"] = ((I, H), p + "mlp.gate_up.weight", 0)
        specs[p + "mlp.up_proj.weight"] = ((I, H), p + "mlp.gate_up.weight", I)
        specs[p + "mlp.down_proj.weight"] = ((H, I), p + "mlp.down.weight", None)
        specs[p + "input_layernorm.weight"] = ((H,), p + "input_layernorm.weight", None)
        specs[p + "post_attention_layernorm.weight"] = ((H,), p + "post_attention_layernorm.weight", None)
        for conv in ("attention_conv", "mlp_conv"):
            specs[p + f"{conv}.base_kernel"] = ((CONV_SIDES, T, H), p + f"{conv}.base_kernel", None)
            specs[p + f"{conv}.kernel_projection.weight"] = ((CONV_SIDES * T * G, H),
                                                             p + f"{conv}.kernel_projection.weight", None)
    specs["candidate_selector.predecessor_codebook"] = ((V, r), "candidate_selector.predecessor_codebook", None)
    specs["candidate_selector.successor_codebook"] = ((V, r), "candidate_selector.successor_codebook", None)
    specs["candidate_selector.hidden_projection.weight"] = ((r, H), "candidate_selector.hidden_projection.weight",
                                                            None)
    if v1:
        specs = {name: spec for name, spec in specs.items() if not any(part in name for part in V2_ONLY)}
    return specs


def load_state(model: DFlash2Drafter, tensors: Iterable[tuple[str, torch.Tensor]], v1: bool = False) -> None:
    """Copy (checkpoint name, tensor) pairs into `model`; every table entry must be supplied, nothing else.

    v1=True: only the v1 subset is expected; convs become identity and the selector zero (it then ranks by the
    unary logits alone), so the model computes exactly DFlash v1.
    """
    if v1:
        with torch.no_grad():
            for layer in model.layers:
                layer.attention_conv.reset_identity()
                layer.mlp_conv.reset_identity()
            for p in model.candidate_selector.parameters():
                p.zero_()
    specs = {name: (shape, target, () if offset is None else (None, offset))  # the slice form copy_state takes
             for name, (shape, target, offset) in drafter_tensor_specs(model.cfg, v1=v1).items()}
    copy_state(model, specs, tensors, "drafter ", finite=True)


def state_tensors(model: DFlash2Drafter, v1: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (checkpoint name, tensor) for every tensor of the name table (fused parameters split back)."""
    params = dict(model.named_parameters())
    for name, (shape, target, offset) in drafter_tensor_specs(model.cfg, v1=v1).items():
        t = params[target].detach()
        yield name, (t if offset is None else t[offset:offset + shape[0]])


def _build(cfg: DrafterConfig, target: BeamForCausalLM, dtype: torch.dtype, device: torch.device | str
           ) -> DFlash2Drafter:
    with torch.device("meta"):
        model = DFlash2Drafter(cfg, target)
    return model.to_empty(device=device).to(dtype)


def random_drafter(cfg: DrafterConfig, target: BeamForCausalLM, seed: int = 0, dtype: torch.dtype | None = None,
                   std: float = 0.02, conv_std: float | None = None, codebook_std: float = 0.02) -> DFlash2Drafter:
    """A deterministic random drafter (same seed → same fp32 draws on any device): linears N(0, std), norms 1,
    identity conv base + projection N(0, conv_std, default 0.1/√H: δ ≈ 0.1), codebooks N(0, codebook_std)."""
    conv_std = 0.1 / cfg.hidden_size ** 0.5 if conv_std is None else conv_std
    gen = torch.Generator().manual_seed(seed)
    model = _build(cfg, target, dtype or target.dtype, target.device)

    def draws() -> Iterator[tuple[str, torch.Tensor]]:
        for name, (shape, _, _) in drafter_tensor_specs(model.cfg).items():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                yield name, torch.ones(shape)
            elif name.endswith("base_kernel"):
                base = torch.zeros(shape)
                base[:, 0] = 1.0
                yield name, base
            elif name.endswith("kernel_projection.weight"):
                yield name, torch.randn(shape, generator=gen) * conv_std
            elif name.endswith("_codebook"):
                yield name, torch.randn(shape, generator=gen) * codebook_std
            else:
                yield name, torch.randn(shape, generator=gen) * std

    load_state(model, draws())
    return model.eval()


DRAFT_VOCAB_FILE = "draft_vocab.json"  # optional, beside config.json: the token ids the drafter drafts from


def check_draft_vocab(ids: torch.Tensor | Sequence[int], vocab_size: int, top_k: int) -> torch.Tensor:
    """-> ids as a long tensor, if they are at least `top_k` token ids in [0, vocab_size) in increasing order."""
    ids = (ids.to("cpu", torch.long) if torch.is_tensor(ids) else torch.tensor(list(ids), dtype=torch.long,
                                                                              device="cpu")).flatten()
    if ids.numel() < top_k or bool((ids < 0).any() | (ids >= vocab_size).any()) or not bool((ids[1:] > ids[:-1]).all()):
        raise ConfigError(f"a draft vocabulary must be at least {top_k} (selector_top_k) distinct token ids in "
                          f"[0, {vocab_size}), in increasing order")
    return ids


def read_draft_vocab(directory: str | Path, cfg: DrafterConfig) -> torch.Tensor | None:
    """The draft vocabulary stored in a drafter checkpoint directory (HF or TensorRT-LLM layout; cfg: the whole
    drafter's), checked, or None when there is none."""
    from beamtrt.checkpoint.hf import read_json

    path = Path(directory) / DRAFT_VOCAB_FILE
    if not path.exists():
        return None
    ids = read_json(path, DRAFT_VOCAB_FILE).get("token_ids")
    try:
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise ConfigError("token_ids must be a list of token ids")
        return check_draft_vocab(ids, cfg.vocab_size, cfg.selector_top_k)
    except ConfigError as err:
        raise CheckpointError(f"{path}: {err}") from None


def write_draft_vocab(directory: str | Path, ids: torch.Tensor) -> None:
    """Store a draft vocabulary (one line of JSON) in a checkpoint directory being written."""
    from beamtrt.checkpoint.hf import write_text

    text = json.dumps({"about": "the token ids this drafter drafts from (beamtrt: DFlash2Drafter.set_draft_vocab)",
                       "token_ids": [int(i) for i in ids.tolist()]})
    # whole or not at all: it may replace the one a served drafter drafts from
    write_text(Path(directory) / DRAFT_VOCAB_FILE, text + "\n", "a draft vocabulary")


def drafter_config_for(path: str | Path, target_cfg: BeamConfig) -> DrafterConfig:
    """A drafter checkpoint's config, checked against the target it is to run on (a mismatch names the file)."""
    cfg = DrafterConfig.from_file(Path(path) / "config.json")
    check_drafter_target(cfg, target_cfg, Path(path))
    return cfg


def check_drafter_target(cfg: DrafterConfig, target_cfg: BeamConfig, folder: Path) -> None:
    """cfg.check_target(target_cfg), its error naming the drafter checkpoint's config.json in `folder`."""
    try:
        cfg.check_target(target_cfg)
    except ConfigError as err:
        raise ConfigError(f"{folder / 'config.json'}: {err}") from None


def load_drafter(path: str | Path, target: BeamForCausalLM, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> DFlash2Drafter:
    """Load a DFlash 2 (or DFlash v1, upgraded with identity convs and a zero selector) checkpoint directory."""
    from beamtrt.checkpoint.hf import CheckpointReader

    cfg = drafter_config_for(path, target.cfg)
    v1 = cfg.version == 1
    specs = drafter_tensor_specs(cfg, v1=v1)
    with CheckpointReader(path) as reader:
        reader.validate({name: (shape, None) for name, (shape, _, _) in specs.items()})
        model = _build(cfg, target, dtype or target.dtype, device or target.device)
        load_state(model, ((name, reader.get(name)) for name in specs), v1=v1)
    model.set_draft_vocab(read_draft_vocab(path, cfg))
    return model.eval()


def save_drafter(model: DFlash2Drafter, path: str | Path, overwrite: bool = False,
                 also: Callable[[Path], None] | None = None) -> Path:
    """Write config.json (DFlash2DraftModel) + safetensors (+ draft_vocab.json when the drafter has one) to `path`
    atomically (temp dir, then rename); also(folder) writes the caller's own files into it before the rename."""
    from beamtrt.checkpoint.hf import save_checkpoint

    out = Path(path)
    if out.exists() and not overwrite:
        raise CheckpointError(f"{out} already exists: choose another output directory or pass overwrite=True")

    def extra(tmp: Path) -> None:
        if model.draft_vocab is not None:
            write_draft_vocab(tmp, model.draft_vocab)
        if also is not None:
            also(tmp)

    return save_checkpoint(out, state_tensors(model), model.cfg,
                           None if overwrite else "choose another output directory or pass overwrite=True", also=extra)

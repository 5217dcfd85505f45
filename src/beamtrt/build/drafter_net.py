"""The DFlash2 drafter as a TensorRT-LLM network: the reference drafter's math and checkpoint names, our plugins.

One engine step = `append_context` + `draft` of the reference (`beamtrt.models.dflash2`): new context taps are
fused (fc + hidden_norm) into each layer's context K/V and appended to that layer's ring inside the windowed-
attention plugin, then the block [anchor, MASK x (B-1)] runs through the draft layers and the selector plugin
walks its lattice. Parameter names are the drafter checkpoint's (`beamtrt.checkpoint.trtllm.drafter_units`) plus
the target's `transformer.vocab_embedding.weight` and `lm_head.weight`; `weight_table` lists every one with its
source, and tests/test_engines.py checks each exists in written checkpoints for every precision and TP size.

TensorRT / TensorRT-LLM are imported only when a network is made (`tensorrt_llm_api`, which `DFlash2Network`
calls) and in `prepare_inputs`; `NetConfig` and `weight_table` are plain Python (tested on CPU).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from beamtrt.errors import ConfigError

TARGET_WEIGHTS = ("transformer.vocab_embedding.weight", "lm_head.weight")  # borrowed from the target, frozen
GATHERED = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")  # all ranks' rows
DRAFT_VOCAB_MASK = "draft_vocab_mask"  # made from the drafter's draft_vocab.json (when it has one)


@dataclass(frozen=True)
class NetConfig:
    """Everything the drafter network and its runtime need (written as the drafter engine's config.json)."""

    dtype: str                 # "bfloat16" | "float16"
    tp_size: int
    hidden_size: int
    num_layers: int
    num_heads: int             # whole model (each rank runs num_heads / tp_size)
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    target_hidden_size: int
    num_taps: int
    vocab_size: int
    mask_token_id: int
    rms_norm_eps: float
    conv_group_size: int
    selector_rank: int
    top_k: int
    window: int
    block_size: int            # the served block B (the engine is built for exactly this B)
    max_batch_size: int
    draft_vocab: bool = False  # the drafter drafts from its draft_vocab.json only: -inf is added to other logits

    @property
    def local_heads(self) -> int:
        return self.num_heads // self.tp_size

    @property
    def local_kv_heads(self) -> int:
        return max(self.num_kv_heads // self.tp_size, 1)  # KV heads duplicated when fewer than ranks

    @classmethod
    def from_checkpoints(cls, drafter_dir: Path, target_dir: Path, settings) -> NetConfig:
        from beamtrt.config import DrafterConfig
        from beamtrt.models.dflash2 import read_draft_vocab

        d = json.loads((Path(drafter_dir) / "config.json").read_text())
        t = json.loads((Path(target_dir) / "config.json").read_text())
        c = DrafterConfig.from_dict(d["drafter_config"], source=str(Path(drafter_dir) / "config.json"))
        if c.version != 2:
            raise ConfigError("the drafter engine needs a DFlash2 drafter (v1 drafters run on the torch backend)")
        if t["dtype"] not in ("bfloat16", "float16"):
            raise ConfigError(f"the drafter engine runs in bf16 / fp16; the target is {t['dtype']}")
        if settings.block_size > c.sliding_window:
            raise ConfigError(f"--block-size {settings.block_size} exceeds the drafter's window {c.sliding_window}")
        return cls(dtype=t["dtype"], tp_size=d["mapping"]["tp_size"], hidden_size=c.hidden_size,
                   num_layers=c.num_hidden_layers, num_heads=c.num_attention_heads,
                   num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim, intermediate_size=c.intermediate_size,
                   target_hidden_size=t["hidden_size"], num_taps=c.num_taps, vocab_size=c.vocab_size,
                   mask_token_id=c.mask_token_id, rms_norm_eps=c.rms_norm_eps, conv_group_size=c.conv_group_size,
                   selector_rank=c.selector_rank, top_k=c.selector_top_k, window=c.sliding_window,
                   block_size=settings.block_size, max_batch_size=settings.max_batch_size,
                   draft_vocab=read_draft_vocab(drafter_dir, c) is not None)


def weight_table(cfg: NetConfig) -> list[tuple[str, str]]:
    """(network parameter = checkpoint tensor name, source "drafter" | "target" | "derived") for every parameter
    ("derived": made by rank_weights from other files)."""
    names = [("transformer.fc.weight", "drafter"), ("transformer.hidden_norm.weight", "drafter"),
             ("transformer.ln_f.weight", "drafter"), ("candidate_selector.hidden_projection.weight", "drafter")]
    names += [(name, "drafter") for name in GATHERED]
    for i in range(cfg.num_layers):
        p = f"transformer.layers.{i}."
        names += [(p + n, "drafter") for n in (
            "input_layernorm.weight", "post_layernorm.weight", "attention.qkv.weight", "attention.dense.weight",
            "attention.q_layernorm.weight", "attention.k_layernorm.weight", "mlp.fc.weight", "mlp.gate.weight",
            "mlp.proj.weight", "attention_conv.base_kernel", "attention_conv.kernel_projection.weight",
            "mlp_conv.base_kernel", "mlp_conv.kernel_projection.weight")]
    names += [(DRAFT_VOCAB_MASK, "derived")] if cfg.draft_vocab else []
    return names + [(name, "target") for name in TARGET_WEIGHTS]


def rank_weights(drafter_dir: Path, target_dir: Path, rank: int, cfg: NetConfig, dtype=None) -> dict:
    """name -> torch tensor in `dtype` (default cfg.dtype) for one rank: drafter weights dequantized (an FP8 drafter
    checkpoint runs with its weights dequantized), the codebooks of every rank concatenated, the target's embedding
    and LM head shards."""
    import torch

    from beamtrt.checkpoint.trtllm import padded_vocab
    from beamtrt.checkpoint.trtllm_files import TrtllmCheckpoint
    from beamtrt.models.dflash2 import read_draft_vocab
    from beamtrt.runtime.tp import rank_tensors

    dtype = dtype or {"bfloat16": torch.bfloat16, "float16": torch.float16}[cfg.dtype]
    drafter, target = TrtllmCheckpoint(drafter_dir), TrtllmCheckpoint(target_dir)
    own = dict(rank_tensors(drafter, rank))
    for name in GATHERED:
        own[name] = torch.cat([drafter.get(r, name) for r in range(cfg.tp_size)])
    for name in TARGET_WEIGHTS:
        own[name] = target.get(rank, name)
    if cfg.draft_vocab:  # [1, 1, gathered LM-head width]: 0 for the draft vocabulary, -inf elsewhere (padding too)
        vocab = read_draft_vocab(drafter_dir, drafter.drafter_config())
        mask = torch.full((padded_vocab(cfg.vocab_size, cfg.tp_size),), float("-inf"))
        mask[vocab] = 0.0
        own[DRAFT_VOCAB_MASK] = mask.view(1, 1, -1)
    wanted = [name for name, _ in weight_table(cfg)]
    missing = [name for name in wanted if name not in own]
    if missing:
        raise ConfigError(f"{drafter_dir} / {target_dir}: rank {rank} has no {missing[0]}")
    return {name: own[name].to(dtype) for name in wanted}


class DFlash2Network:
    """Factory: DFlash2Network(cfg, rank, weights) -> a tensorrt_llm Module whose forward adds the drafter step to
    the current network (the class is made on first use: its base class needs TensorRT-LLM).

    `api` replaces the TensorRT-LLM names the network uses (F, Module, default_trtnet, torch_to_numpy, plugins,
    trt): tests/drafter_net_torch.py passes PyTorch stand-ins and the plugins' host build, to run this very code on
    CPU against the reference drafter."""

    _cls = None

    def __new__(cls, cfg: NetConfig, rank: int, weights: dict, api=None):
        if api is not None:
            return _build_class(api)(cfg, rank, weights)
        if cls._cls is None:
            cls._cls = _build_class(tensorrt_llm_api())
        return cls._cls(cfg, rank, weights)


def tensorrt_llm_api():
    """The TensorRT-LLM names the network is written with."""
    from types import SimpleNamespace

    import tensorrt as trt
    from tensorrt_llm import functional as F
    from tensorrt_llm._common import default_trtnet
    from tensorrt_llm._utils import torch_to_numpy
    from tensorrt_llm.module import Module

    from beamtrt.build import plugins

    return SimpleNamespace(F=F, Module=Module, default_trtnet=default_trtnet, torch_to_numpy=torch_to_numpy,
                           plugins=plugins, trt=trt)


def _build_class(api):  # noqa: C901 (one network, read top to bottom)
    from collections import OrderedDict

    import torch

    F, Module, default_trtnet, torch_to_numpy, plugins, trt = (
        api.F, api.Module, api.default_trtnet, api.torch_to_numpy, api.plugins, api.trt)

    def const(t: torch.Tensor):
        return F.constant(torch_to_numpy(t.contiguous()))

    def take(x, ndim: int, dim: int, start: int, length):
        """x[..., start:start + length, ...] along `dim` (length an int or a shape tensor)."""
        starts = [0] * ndim
        starts[dim] = start
        return F.slice(x, starts, F.concat([length if j == dim else F.shape(x, j) for j in range(ndim)]))

    def wrap(layer, count: int):
        return [F._create_tensor(layer.get_output(i), layer) for i in range(count)]

    class Net(Module):
        def __init__(self, cfg: NetConfig, rank: int, weights: dict):
            super().__init__()
            self.cfg, self.rank, self.weights = cfg, rank, weights
            self.tp_group = list(range(cfg.tp_size))
            self.dt = trt.bfloat16 if cfg.dtype == "bfloat16" else trt.float16
            self.consts: dict = {}

        def w(self, name: str):  # every weight is one build-time constant of the network, however often it is used
            if name not in self.consts:
                self.consts[name] = const(self.weights[name])
            return self.consts[name]

        # ---- inputs: N requests, C new context rows, B block rows, S = B - 1 draft slots ---------------------
        def prepare_inputs(self) -> dict:
            c = self.cfg
            n, rows = [1, max(1, c.max_batch_size // 2), c.max_batch_size], [1, c.block_size, c.window]
            B, S, D, KV = c.block_size, c.block_size - 1, c.head_dim, c.local_kv_heads

            def tensor(name, dtype, *dims):  # dims: (name, [min, opt, max]) for a dynamic axis, or (name, size)
                shape = [-1 if isinstance(r, list) else r for _, r in dims]
                ranges = OrderedDict((k, [r if isinstance(r, list) else [r, r, r]]) for k, r in dims)
                return F.Tensor(name=name, dtype=dtype, shape=shape, dim_range=ranges)

            if c.tp_size > 1:
                from tensorrt_llm.mapping import Mapping
                from tensorrt_llm.plugin import current_all_reduce_helper

                current_all_reduce_helper().set_workspace_tensor(
                    Mapping(world_size=c.tp_size, rank=self.rank, tp_size=c.tp_size), 1)
            return {
                "anchor_ids": tensor("anchor_ids", trt.int32, ("batch", n)),
                "ctx_taps": tensor("ctx_taps", self.dt, ("batch", n), ("ctx", rows),
                                   ("taps", c.num_taps * c.target_hidden_size)),
                "ctx_start": tensor("ctx_start", trt.int32, ("batch", n)),
                "ctx_count": tensor("ctx_count", trt.int32, ("batch", n)),
                "ctx_rope": [tensor(f"ctx_{k}", self.dt, ("batch", n), ("ctx", rows), ("head", D)) for k in ("cos", "sin")],
                "block_rope": [tensor(f"block_{k}", self.dt, ("batch", n), ("block", B), ("head", D))
                               for k in ("cos", "sin")],
                "temperature": tensor("temperature", trt.float32, ("batch", n)),
                "top_p": tensor("top_p", trt.float32, ("batch", n)),
                "uniforms": tensor("uniforms", trt.float32, ("batch", n), ("slots", S)),
                "rings": [[tensor(f"ring_{k}_{i}", self.dt, ("batch", n), ("kv", KV), ("window", c.window),
                                  ("head", D)) for k in ("k", "v")] for i in range(c.num_layers)],
            }

        # ---- the reference math (beamtrt.models.dflash2), block rows [N, B, H] -------------------------------
        def linear(self, x, name: str, reduce: bool = False):
            y = F.matmul(x, self.w(name), transb=True)
            return F.allreduce(y, self.tp_group) if reduce and self.cfg.tp_size > 1 else y

        def norm(self, x, name: str, size: int):
            return F.rms_norm(x, size, weight=self.w(name), eps=self.cfg.rms_norm_eps)

        def rotate(self, x, rope):
            """x [N, T, h, D]; rope = (cos, sin) [N, T, D], sin signed as beamtrt's Rotary: x cos + roll(x) sin."""
            half = self.cfg.head_dim // 2
            rolled = F.concat([take(x, 4, 3, half, half), take(x, 4, 3, 0, half)], dim=3)
            return x * F.unsqueeze(rope[0], 2) + rolled * F.unsqueeze(rope[1], 2)

        def conv(self, x, prefix: str, side: int, delta):
            """GroupedConv2Tap side `side`: x [N, B, H], delta [N, B, 2 sides, 2 taps, G]; the second tap reads
            in-block position p - 1 (zeros at p = 0)."""
            c = self.cfg
            N, B, H, G, g = F.shape(x, 0), c.block_size, c.hidden_size, c.hidden_size // c.conv_group_size, \
                c.conv_group_size
            base = self.weights[prefix + ".base_kernel"]  # [2, 2, H]
            coef = []
            for tap in range(2):
                d = take(take(delta, 5, 2, side, 1), 5, 3, tap, 1).view(F.concat([N, B, G, 1]))
                d = F.expand(d, F.concat([N, B, G, g])).view(F.concat([N, B, H]))
                coef.append(d + const(base[side, tap].view(1, 1, H)))
            zero = F.expand(const(torch.zeros(1, 1, H, dtype=base.dtype)), F.concat([N, 1, H]))
            shifted = F.concat([zero, take(x, 3, 1, 0, B - 1)], dim=1)
            return coef[0] * x + coef[1] * shifted

        def layer(self, i: int, h, block_rope, ctx, ctx_rope, ctx_start, ctx_count, ring):
            c, p = self.cfg, f"transformer.layers.{i}."
            N, B, D, Hq, KV = F.shape(h, 0), c.block_size, c.head_dim, c.local_heads, c.local_kv_heads

            def delta(x, conv):
                return self.linear(x, p + conv + ".kernel_projection.weight").view(
                    F.concat([N, B, 2, 2, c.hidden_size // c.conv_group_size]))

            def heads(x, rows):  # fused qkv -> q, k (per-head RMSNorm), v: [N, rows, heads, D]
                qkv = self.linear(x, p + "attention.qkv.weight").view(F.concat([N, rows, Hq + 2 * KV, D]))
                q = self.norm(take(qkv, 4, 2, 0, Hq), p + "attention.q_layernorm.weight", D)
                k = self.norm(take(qkv, 4, 2, Hq, KV), p + "attention.k_layernorm.weight", D)
                return q, k, take(qkv, 4, 2, Hq + KV, KV)

            x = self.norm(h, p + "input_layernorm.weight", c.hidden_size)
            d = delta(x, "attention_conv")
            q, k, v = heads(self.conv(x, p + "attention_conv", 0, d), B)
            _, ck, cv = heads(ctx, F.shape(ctx, 1))  # the new context rows' K/V (their q is unused)
            layer = plugins.add_windowed_attention(
                default_trtnet(), *(t.trt_tensor for t in (self.rotate(q, block_rope), self.rotate(k, block_rope), v,
                                                           self.rotate(ck, ctx_rope), cv, ctx_start, ctx_count,
                                                           *ring)), window=c.window)
            out, ring_k, ring_v = wrap(layer, 3)
            attn = self.linear(out.view(F.concat([N, B, Hq * D])), p + "attention.dense.weight", reduce=True)
            h = h + self.conv(attn, p + "attention_conv", 1, d)
            x = self.norm(h, p + "post_layernorm.weight", c.hidden_size)
            d = delta(x, "mlp_conv")
            y = self.conv(x, p + "mlp_conv", 0, d)
            m = F.silu(self.linear(y, p + "mlp.fc.weight")) * self.linear(y, p + "mlp.gate.weight")
            h = h + self.conv(self.linear(m, p + "mlp.proj.weight", reduce=True), p + "mlp_conv", 1, d)
            return h, ring_k, ring_v

        def forward(self, anchor_ids, ctx_taps, ctx_start, ctx_count, ctx_rope, block_rope, temperature, top_p,
                    uniforms, rings):
            c = self.cfg
            N, S = F.shape(anchor_ids, 0), c.block_size - 1
            masks = F.expand(const(torch.full((1, S), c.mask_token_id, dtype=torch.int32)), F.concat([N, S]))
            ids = F.concat([anchor_ids.view(F.concat([N, 1])), masks], dim=1)  # [N, B]: anchor, MASK x S
            h = F.embedding(ids, self.w("transformer.vocab_embedding.weight"), tp_size=c.tp_size,
                            tp_group=self.tp_group if c.tp_size > 1 else None, sharding_dim=0, tp_rank=self.rank)
            ctx = self.norm(self.linear(ctx_taps, "transformer.fc.weight"), "transformer.hidden_norm.weight",
                            c.hidden_size)  # [N, C, H] fused context features
            for i in range(c.num_layers):
                h, ring_k, ring_v = self.layer(i, h, block_rope, ctx, ctx_rope, ctx_start, ctx_count, rings[i])
                ring_k.mark_output(f"ring_k_{i}_out")  # aliases input ring_k_<i> (updated in place)
                ring_v.mark_output(f"ring_v_{i}_out")
            z = self.norm(take(h, 3, 1, 1, S), "transformer.ln_f.weight", c.hidden_size)  # [N, S, H]
            logits = self.linear(z, "lm_head.weight")  # [N, S, V / tp]
            if c.tp_size > 1:
                logits = F.allgather(logits, self.tp_group, gather_dim=-1)
            if c.draft_vocab:  # -inf outside the draft vocabulary (models/dflash2.py set_draft_vocab)
                logits = logits + self.w(DRAFT_VOCAB_MASK)
            projected = F.cast(self.linear(z, "candidate_selector.hidden_projection.weight"), trt.float32)
            layer = plugins.add_block_selector(
                default_trtnet(), *(t.trt_tensor for t in (logits, projected, anchor_ids, self.w(GATHERED[0]),
                                                           self.w(GATHERED[1]), temperature, top_p, uniforms)),
                top_k=c.top_k)
            for name, t in zip(("draft_ids", "cand_ids", "q"), wrap(layer, 3)):
                t.mark_output(name)

    return Net

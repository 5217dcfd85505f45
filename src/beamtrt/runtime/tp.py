"""Tensor-parallel torch backend: each rank loads only its own rank files and runs its shard; rank 0 drives.

Rank 0 runs the speculative loop and makes every decision; each backend call it makes is broadcast to the other
ranks (`RankZero`), which replay it on their shards (`serve`), so the collectives inside the models line up and
every rank commits exactly the tokens rank 0 chose. The target's taps, which rank 0 passes on to the drafter, are
replicated on every rank, so they go as `OwnTaps`: each rank uses its own.
"""

from __future__ import annotations

import dataclasses
import os
import re
from functools import partial
from pathlib import Path

import torch

from beamtrt.checkpoint import trtllm
from beamtrt.checkpoint.trtllm_files import TrtllmCheckpoint, install_emulation
from beamtrt.config import BeamConfig, DrafterConfig
from beamtrt.errors import CheckpointError, ConfigError
from beamtrt.runtime.dist import Dist


# ---- rank-local configs --------------------------------------------------------------------------------------

def _local_heads(n_q: int, n_kv: int, tp: int) -> dict:
    return {"num_attention_heads": n_q // tp, "num_key_value_heads": max(n_kv // tp, 1)}


def target_shard_config(cfg: BeamConfig, mapping: trtllm.Mapping) -> BeamConfig:
    """The config one rank's shard computes: its heads, its slice of every intermediate dim, its vocab rows."""
    tp, mt = mapping.tp_size, mapping.moe_tp_size
    return dataclasses.replace(
        cfg, **_local_heads(cfg.num_attention_heads, cfg.num_key_value_heads, tp),
        intermediate_size=cfg.intermediate_size // tp, moe_intermediate_size=cfg.moe_intermediate_size // mt,
        shared_expert_intermediate_size=cfg.shared_expert_intermediate_size // tp,
        vocab_size=trtllm.padded_vocab(cfg.vocab_size, tp) // tp, tie_word_embeddings=False)


def drafter_shard_config(cfg: DrafterConfig, mapping: trtllm.Mapping) -> DrafterConfig:
    """The config one rank's drafter shard computes: its heads, its MLP slice, its vocab rows (LM head, codebooks).
    The mask token stays a whole-vocabulary id (the target's vocab-parallel embedding looks it up), so it is set after
    the rank-local config is checked, where it may lie beyond this rank's rows."""
    tp = mapping.tp_size
    local = dataclasses.replace(cfg, **_local_heads(cfg.num_attention_heads, cfg.num_key_value_heads, tp),
                                intermediate_size=cfg.intermediate_size // tp,
                                vocab_size=trtllm.padded_vocab(cfg.vocab_size, tp) // tp,
                                selector_top_k=min(cfg.selector_top_k, cfg.vocab_size), mask_token_id=0)
    object.__setattr__(local, "mask_token_id", cfg.mask_token_id)
    return local


def make_shard(cfg: BeamConfig, mapping: trtllm.Mapping, rank: int, dist: Dist):
    from beamtrt.models.beam import Shard

    local_v = trtllm.padded_vocab(cfg.vocab_size, mapping.tp_size) // mapping.tp_size
    e_local = cfg.num_experts // mapping.moe_ep_size
    return Shard(vocab_start=rank * local_v, vocab_size=cfg.vocab_size,
                 expert_start=mapping.moe_ranks(rank)[1] * e_local, num_local_experts=e_local,
                 allreduce=dist.allreduce, allgather=dist.allgather_last, on_host=dist.on_host)


# ---- one rank's tensors -> the shard's parameters (name tables) ---------------------------------------------

def _layer_table(attn: str, input_norm: str, post_norm: str) -> list[tuple[str, str, str]]:
    """A decoder layer's norms and attention (the target and the drafter name their modules differently)."""
    layer = r"transformer\.layers\.(\d+)\."
    return [(layer + trt, "layers.{}." + ours, how) for trt, ours, how in (
        (r"input_layernorm\.weight", input_norm + ".weight", "copy"),
        (r"post_layernorm\.weight", post_norm + ".weight", "copy"),
        (r"attention\.qkv\.weight", attn + ".qkv.weight", "copy"),
        (r"attention\.qkv\.bias", attn + ".qkv.bias", "copy"),
        (r"attention\.dense\.weight", attn + ".o_proj.weight", "copy"),
        (r"attention\.dense\.bias", attn + ".o_proj.bias", "bias0"),
        (r"attention\.q_layernorm\.weight", attn + ".q_norm.weight", "copy"),
        (r"attention\.k_layernorm\.weight", attn + ".k_norm.weight", "copy"),
    )]


# (TensorRT-LLM name, our parameter, how): how = "copy" | "gate" / "up" (a half of a fused [gate; up]) |
# "up_gate" (TensorRT-LLM's [up; gate] -> our [gate; up]) | "bias0" (added once: rank 0 keeps it)
_TARGET_TABLE = [
    (r"transformer\.vocab_embedding\.weight", "embed.weight", "copy"),
    (r"transformer\.ln_f\.weight", "norm.weight", "copy"),
    (r"lm_head\.weight", "lm_head.weight", "copy"),
    *_layer_table("attn", "input_norm", "post_attn_norm"),
    (r"transformer\.layers\.(\d+)\.mlp\.router\.weight", "layers.{}.mlp.router.weight", "copy"),
    (r"transformer\.layers\.(\d+)\.mlp\.shared_expert\.fc\.weight", "layers.{}.mlp.shared.gate_up.weight", "up_gate"),
    (r"transformer\.layers\.(\d+)\.mlp\.shared_expert\.proj\.weight", "layers.{}.mlp.shared.down.weight", "copy"),
    (r"transformer\.layers\.(\d+)\.mlp\.shared_expert_gate\.weight", "layers.{}.mlp.shared_gate.weight", "copy"),
]
_MOE_TABLE = [  # MoE layers: stacked experts
    (r"transformer\.layers\.(\d+)\.mlp\.fc\.weight", "layers.{}.mlp.w_gate_up", "up_gate"),
    (r"transformer\.layers\.(\d+)\.mlp\.proj\.weight", "layers.{}.mlp.w_down", "copy"),
]
_DENSE_TABLE = [  # dense layers (and the drafter's MLP): fc = gate_proj, gate = up_proj
    (r"transformer\.layers\.(\d+)\.mlp\.fc\.weight", "layers.{}.mlp.gate_up.weight", "gate"),
    (r"transformer\.layers\.(\d+)\.mlp\.gate\.weight", "layers.{}.mlp.gate_up.weight", "up"),
    (r"transformer\.layers\.(\d+)\.mlp\.proj\.weight", "layers.{}.mlp.down.weight", "copy"),
]
_DRAFTER_TABLE = [
    (r"transformer\.fc\.weight", "fc.weight", "copy"),
    (r"transformer\.hidden_norm\.weight", "hidden_norm.weight", "copy"),
    (r"transformer\.ln_f\.weight", "norm.weight", "copy"),
    (r"candidate_selector\.(.+)", "candidate_selector.{}", "copy"),
    *_layer_table("self_attn", "input_layernorm", "post_attention_layernorm"),
    *_DENSE_TABLE,
    (r"transformer\.layers\.(\d+)\.(attention_conv|mlp_conv)\.(.+)", "layers.{}.{}.{}", "copy"),
]


def rank_tensors(ckpt: TrtllmCheckpoint, rank: int):
    """(name, tensor) of one rank: weights dequantized (fp32), scale tensors skipped."""
    get = lambda name: ckpt.get(rank, name)  # noqa: E731
    for unit in ckpt.units():
        if isinstance(unit, trtllm.Plain):
            yield unit.name, get(unit.name)
            continue
        if unit.expert_slots:
            yield f"{unit.name}.weight", torch.stack([trtllm.dequantize_unit(ckpt.precision, get, unit.name, s)
                                                      for s in range(unit.expert_slots)])
        else:
            yield f"{unit.name}.weight", trtllm.dequantize_unit(ckpt.precision, get, unit.name, None)
            if unit.bias:
                yield f"{unit.name}.bias", get(f"{unit.name}.bias")


def _load(model, tables: list, tensors, rank: int) -> None:
    params = dict(model.named_parameters())
    seen: set[str] = set()  # parameters filled (a fused [gate; up] counts once per half)
    compiled = [(re.compile(p + r"$"), ours, how) for p, ours, how in tables]
    with torch.no_grad():
        for name, t in tensors:
            for pattern, ours, how in compiled:
                m = pattern.match(name)
                if m:
                    break
            else:
                raise CheckpointError(f"unexpected tensor {name!r} in rank {rank}'s file")
            target = ours.format(*m.groups())
            dest = params[target]
            if how == "up_gate":
                up, gate = t.chunk(2, dim=-2)
                t = torch.cat((gate, up), dim=-2)
            elif how in ("gate", "up"):
                dest = dest.chunk(2, dim=0)[0 if how == "gate" else 1]
            elif how == "bias0" and rank != 0:
                t = torch.zeros_like(t)
            if tuple(dest.shape) != tuple(t.shape):
                raise CheckpointError(f"rank {rank}: {name} has shape {tuple(t.shape)}, the shard expects "
                                      f"{tuple(dest.shape)}")
            dest.copy_(t)
            seen.add(target + (f":{how}" if how in ("gate", "up") else ""))
    halves = {n.rsplit(":", 1)[0] for n in seen if n.endswith((":gate", ":up"))}
    missing = [n for n in params if n not in seen and not (n in halves and {f"{n}:gate", f"{n}:up"} <= seen)]
    if missing:
        raise CheckpointError(f"rank {rank}'s file lacks what the shard needs, first {missing[0]!r}")


def _check_world(ckpt: TrtllmCheckpoint, dist: Dist) -> None:
    if ckpt.mapping.tp_size != dist.size:
        raise ConfigError(f"{ckpt.path} was built for tp {ckpt.mapping.tp_size} but {dist.size} rank(s) are running: "
                          f"start it with mpirun -n {ckpt.mapping.tp_size}")


def load_target_shard(path: str | Path, dist: Dist, dtype: torch.dtype = torch.float32):
    """This rank's shard of a TensorRT-LLM target checkpoint, reading only rank{r}.safetensors."""
    from beamtrt.models.beam import BeamForCausalLM, check_fits

    ckpt = TrtllmCheckpoint(path)
    _check_world(ckpt, dist)
    cfg = ckpt.beam_config()
    shard = make_shard(cfg, ckpt.mapping, dist.rank, dist)
    with torch.device("meta"):
        model = BeamForCausalLM(target_shard_config(cfg, ckpt.mapping), shard=shard)
    check_fits(ckpt.path, model, dtype, torch.device("cpu"), dist)  # the ranks on this host together
    model = model.to_empty(device="cpu").to(dtype)
    layers = {i: _MOE_TABLE if cfg.is_moe_layer(i) else _DENSE_TABLE for i in range(cfg.num_hidden_layers)}
    tables = _TARGET_TABLE + [(p.replace(r"(\d+)", str(i)), o.replace("{}", str(i)), h)
                              for i, table in layers.items() for p, o, h in table]
    _load(model, tables, rank_tensors(ckpt, dist.rank), dist.rank)
    install_emulation(model, ckpt, rank=dist.rank)
    model.full_cfg = cfg
    return model.eval()


def load_drafter_shard(path: str | Path, target, dist: Dist):
    """This rank's shard of a TensorRT-LLM drafter checkpoint over the target's shard (its embedding / LM head)."""
    from beamtrt.models.dflash2 import DFlash2Drafter, check_drafter_target, read_draft_vocab

    ckpt = TrtllmCheckpoint(path)
    _check_world(ckpt, dist)
    cfg = ckpt.drafter_config()
    check_drafter_target(cfg, target.full_cfg, ckpt.path)
    if cfg.version == 1:
        raise CheckpointError(f"{ckpt.path}: DFlash v1 drafters are not supported by the tensor-parallel runtime")
    local = drafter_shard_config(cfg, ckpt.mapping)
    with torch.device("meta"):
        model = DFlash2Drafter(local, target, shard=target.shard)
    model = model.to_empty(device="cpu").to(target.dtype)
    _load(model, _DRAFTER_TABLE, rank_tensors(ckpt, dist.rank), dist.rank)
    model.set_draft_vocab(read_draft_vocab(ckpt.path, cfg))
    install_emulation(model, ckpt, rank=dist.rank)
    return model.eval()


# ---- rank 0 drives, the others replay ------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class OwnTaps:
    """Sent in place of the taps of the target's last pass when rank 0 passes them to a call (the drafter's context):
    every rank's pass computed the same ones (the residual stream is replicated bit for bit), so each rank uses its
    own instead of receiving rank 0's. Every rank holds its last taps until a call uses them or a pass replaces them."""


def _each(args: tuple, kwargs: dict, f) -> tuple[tuple, dict]:
    return tuple(map(f, args)), {k: f(v) for k, v in kwargs.items()}


def _uses_taps(args: tuple, kwargs: dict) -> bool:
    return any(isinstance(a, OwnTaps) for a in (*args, *kwargs.values()))


def _portable(arg):
    """A CUDA tensor goes as a host copy (pickling copies it to the host anyway): unpickled as it is, it would come back
    on rank 0's GPU in every rank, each then opening a context there; the backends take their inputs from the host."""
    return arg.cpu() if isinstance(arg, torch.Tensor) and arg.is_cuda else arg


def _own(taps: torch.Tensor, arg):
    return taps if isinstance(arg, OwnTaps) else arg


def _hold_taps(held: dict, result) -> None:
    if isinstance(taps := getattr(result, "taps", None), torch.Tensor):
        held["taps"] = taps


class RankZero:
    """On rank 0: a backend whose every method call is first broadcast to the other ranks (which replay it); the
    target's taps passed to a call go as `OwnTaps` (`held`: rank 0's last taps, shared by the backends)."""

    def __init__(self, name: str, backend, dist: Dist, held: dict):
        self._name, self._backend, self._dist, self._held = name, backend, dist, held
        self.comm_s = 0.0  # seconds this backend's calls spent in collectives (the broadcast included)

    def __getattr__(self, attr: str):
        value = getattr(self._backend, attr)
        if not callable(value):
            return value

        def call(*args, **kwargs):
            taps = self._held.get("taps")
            sent = _each(args, kwargs, lambda a: OwnTaps() if taps is not None and a is taps else _portable(a))
            if _uses_taps(*sent):
                del self._held["taps"]  # used: every rank lets go of its own
            before = self._dist.comm_s
            self._dist.bcast((self._name, attr, *sent))
            try:
                result = value(*args, **kwargs)
            finally:
                self.comm_s += self._dist.comm_s - before
            _hold_taps(self._held, result)
            return result
        return call


def rank_zero(dist: Dist, target, drafter) -> tuple:
    """On rank 0 of several: (target, drafter) whose calls the other ranks replay (`serve`); drafter may be None."""
    held: dict = {}
    return RankZero("target", target, dist, held), drafter and RankZero("drafter", drafter, dist, held)


FAIL_RANK_ENV = "BEAMTRT_FAIL_RANK"  # fault injection (tests): this rank raises on its first replayed call


def serve(dist: Dist, backends: dict) -> None:
    """On ranks > 0: replay rank 0's backend calls until it says stop."""
    fail = os.environ.get(FAIL_RANK_ENV) == str(dist.rank)
    held: dict = {}  # this rank's last taps, as rank 0's `RankZero`s hold theirs
    while True:
        name, method, args, kwargs = dist.bcast(None)
        if name == "stop":
            return
        if fail:
            raise RuntimeError(f"injected failure ({FAIL_RANK_ENV}={dist.rank})")
        if _uses_taps(args, kwargs):
            args, kwargs = _each(args, kwargs, partial(_own, held.pop("taps")))
        _hold_taps(held, getattr(backends[name], method)(*args, **kwargs))


def drive(dist: Dist, target, drafter) -> tuple | None:
    """Once every rank has loaded its backends (a barrier: rank 0 printed its first output before a rank that then
    failed to load aborted the job): on rank 0, (target, drafter) whose calls every other rank replays (as they are in
    one process); on the other ranks, replay rank 0's calls until it stops, then None."""
    if dist.size > 1:
        dist.comm.Barrier()
    if dist.rank != 0:
        serve(dist, {"target": target, "drafter": drafter})
        return None
    if dist.size == 1:
        return target, drafter
    return rank_zero(dist, target, drafter)


def stop(dist: Dist) -> None:
    if dist.rank == 0:
        dist.bcast(("stop", "", (), {}))

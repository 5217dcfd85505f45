"""Layer-by-layer max calibration: activation ranges (amax) at every GEMM input and of the cached K / V.

Only one decoder layer is in memory at a time (loaded from the checkpoint, run on every calibration sequence,
freed), so the model may be larger than RAM. Ranges are max |x| over all calibration tokens, as nvidia-modelopt's
default max calibration records them: experts see the tokens routed to them, and a layer's experts share one input
range (the max over them), as modelopt syncs expert input ranges and TensorRT-LLM stores one activation scale per
MoE GEMM.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import torch

from beamtrt.checkpoint.hf import CheckpointReader
from beamtrt.config import BeamConfig
from beamtrt.errors import CheckpointError
from beamtrt.prompts import render_chat

DEFAULT_PROMPTS = "calib_prompts.jsonl"


def default_prompts_path() -> Path:
    return Path(str(resources.files("beamtrt") / "data" / DEFAULT_PROMPTS))


def tokenize(model_dir: str | Path, chats: list[list[dict]], samples: int, vocab_size: int,
             max_len: int = 256) -> list[torch.Tensor]:
    """Chat-formatted token ids of the first `samples` chats (cycled if fewer), each at most max_len tokens; a
    tokenizer that cannot be loaded or gives ids outside the model's vocabulary is a one-line CheckpointError."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(model_dir))
        out = []
        for i in range(samples):
            chat = chats[i % len(chats)]
            ids = render_chat(tok, chat) if tok.chat_template else tok.encode(
                "\n".join(m["content"] for m in chat))
            out.append(torch.tensor(ids[:max_len], dtype=torch.long))
    except Exception as e:  # transformers raises anything at all on a broken tokenizer file
        why = (str(e).strip().splitlines() or [""])[0][:160]
        raise CheckpointError(f"{model_dir}: its tokenizer cannot tokenize the calibration prompts "
                              f"({type(e).__name__}: {why}): decoding would fail on prompts too") from None
    top = max((int(ids.max()) for ids in out if ids.numel()), default=-1)
    if top >= vocab_size:
        raise CheckpointError(f"{model_dir}: its tokenizer gives token id {top}, outside the model's vocab_size "
                              f"{vocab_size}")
    return out


def random_tokens(vocab: int, samples: int, length: int = 64, seed: int = 0) -> list[torch.Tensor]:
    """Calibration ids for a checkpoint without a tokenizer (random Beam-architecture models)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=gen) for _ in range(samples)]


class _Observer:
    """A hook that records max |x| and passes x through."""

    def __init__(self):
        self.amax = 0.0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel():
            amax = float(x.detach().abs().amax())
            if not math.isnan(self.amax) and not amax <= self.amax:  # a NaN, once seen, stays (max() dropped it)
                self.amax = amax
        return x


@dataclass
class Calibration:
    amax: dict[str, float]                                   # calibration site -> max |x|
    taps: list[torch.Tensor] = field(default_factory=list)   # per sequence [1, T, n_taps * H], when asked for


@torch.inference_mode()
def calibrate(model_dir: str | Path, cfg: BeamConfig, sequences: list[torch.Tensor], progress: bool = False,
              taps: tuple[int, ...] = ()) -> Calibration:
    """amax per calibration site (TensorRT-LLM module names, see trtllm_files.act_hooks) over `sequences`, and the
    residual stream after the `taps` layers (the drafter's inputs) per sequence."""
    from beamtrt.checkpoint.trtllm_files import act_hooks
    from beamtrt.models.beam import BeamForCausalLM, load_state

    reader = CheckpointReader(model_dir)
    with torch.device("meta"):
        model = BeamForCausalLM(cfg)
    embed = reader.get("model.embed_tokens.weight", dtype=torch.float32)
    hidden = [embed[ids][None] for ids in sequences]  # [1, T, H] each
    del embed
    sites = act_hooks(model)
    amax: dict[str, float] = {}
    captured: list[dict[int, torch.Tensor]] = [{} for _ in sequences]
    layers = range(cfg.num_hidden_layers)
    if progress:
        from tqdm import tqdm
        layers = tqdm(layers, desc="calibrate", unit="layer")
    for i in layers:
        layer = model.layers[i].to_empty(device="cpu").float()
        prefix = f"model.layers.{i}."
        load_state(model, ((n, reader.get(n)) for n in reader.names() if n.startswith(prefix)), only=prefix)
        observers = {name: _Observer() for name in sites if name.startswith(f"transformer.layers.{i}.")}
        for name, obs in observers.items():
            setattr(*sites[name], obs)
        for j, h in enumerate(hidden):
            T = h.shape[1]
            kv = torch.zeros(1, cfg.num_key_value_heads, T, cfg.head_dim)
            hidden[j] = layer(h, model.step_layout(torch.zeros(1, dtype=torch.long), T), kv, kv.clone())
            if i in taps:
                captured[j][i] = hidden[j]
        for name, obs in observers.items():
            amax[name] = obs.amax
            setattr(*sites[name], None)
        layer.to("meta")  # free it
    return Calibration(amax, [torch.cat([c[t] for t in taps], dim=-1) for c in captured] if taps else [])


@torch.inference_mode()
def calibrate_drafter(drafter_dir: str | Path, target_dir: str | Path, target_cfg: BeamConfig,
                      sequences: list[torch.Tensor], taps: list[torch.Tensor], block_size: int) -> dict[str, float]:
    """amax per drafter site: each sequence's taps but the last token's become the drafter's context, and one block
    is drafted after its last token. Only the target's embedding, final norm and LM head are loaded."""
    from beamtrt.checkpoint.trtllm_files import act_hooks
    from beamtrt.models.beam import BeamForCausalLM, load_state
    from beamtrt.models.dflash2 import load_drafter

    reader = CheckpointReader(target_dir)
    with torch.device("meta"):
        target = BeamForCausalLM(target_cfg)
    for prefix, module in (("model.embed_tokens.", target.embed), ("model.norm.", target.norm),
                           ("lm_head.", target.lm_head)):
        if module is not None:
            module.to_empty(device="cpu").float()
            load_state(target, ((n, reader.get(n)) for n in reader.names() if n.startswith(prefix)), only=prefix)
    drafter = load_drafter(drafter_dir, target, dtype=torch.float32, device="cpu")
    sites = act_hooks(drafter)
    observers = {name: _Observer() for name in sites}
    for name, obs in observers.items():
        setattr(*sites[name], obs)
    for ids, tapped in zip(sequences, taps):
        cache = drafter.new_cache(1)
        drafter.append_context(cache, tapped[:, :-1])
        drafter.draft(cache, ids[-1:], block_size)
    return {name: obs.amax for name, obs in observers.items()}

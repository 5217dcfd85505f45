"""DFlash 2 drafter training (dflash.md §3): random anchors, blocks over tapped context, decayed CE + selector loss.

One step draws `seqs_per_step` training sequences and up to `anchors_per_seq` anchors in each (positions whose
next token is also answer text). Block n is [x_p, MASK × (B−1)] at positions p .. p+B−1; it runs through the
drafter's own layers (`DraftLayer`, the serving code) against the context K/V of the positions before p, inside
the window, and its own block bidirectionally. Slot k (k = 1..B−1) predicts x_{p+k} through the target's frozen
LM head with weight exp(−(k−1)/γ); the selector scores the slot's top-K with the true predecessor x_{p+k−1}.
With `distill` > 0 a slot also learns the target's whole distribution there (soft labels, same weights).
Every random draw comes from a generator seeded by (seed, step), so a resumed run repeats an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from beamtrt.checkpoint.hf import write_text
from beamtrt.cli_util import error_line
from beamtrt.errors import BeamtrtError
from beamtrt.models.dflash2 import DFlash2Drafter
from beamtrt.spec.selector import walk_greedy
from beamtrt.train.features import FeatureSet

IGNORE = -100


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 1000
    seqs_per_step: int = 4
    anchors_per_seq: int = 16
    block_size: int = 16            # training block (serving uses a smaller one)
    eval_block_size: int = 8
    lr: float = 1e-3                # the 8B-scale recipe uses 6e-4; a 12M drafter on a 1000-step schedule takes 1e-3
    warmup: float = 0.04            # fraction of steps with a linear ramp, then cosine down to min_lr_ratio · lr
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    gamma: float = 7.0              # loss decay: w_k = exp(−(k−1)/γ)
    selector_weight: float = 1.0
    seed: int = 0
    eval_every: int = 100
    checkpoint_every: int = 25
    eval_sequences: int = 32        # the last greedy sequences of the data: held out, never trained on
    init_from: str = ""             # a drafter checkpoint to start from ("" = the recipe's initialization)
    head_vocab: str = "full"        # LM head rows the loss scores: "full", or "seen" = the training data's tokens
    distill: float = 0.0            # weight of KL(target ‖ drafter) per slot, beside the CE on its token (0 = recipe)

    def __post_init__(self) -> None:
        for name, flag in (("steps", "--steps"), ("seqs_per_step", "--seqs-per-step"), ("anchors_per_seq", "--anchors"),
                           ("eval_every", "--eval-every"), ("checkpoint_every", "--checkpoint-every")):
            if getattr(self, name) < 1:
                raise ValueError(f"{flag} must be >= 1, got {getattr(self, name)}")
        if not 2 <= self.eval_block_size <= self.block_size:
            raise ValueError(f"--eval-block-size {self.eval_block_size} must be within [2, --block-size "
                             f"{self.block_size}]")
        if not 0 < self.lr < math.inf or not self.gamma >= 0.01:  # γ = inf: no decay over the slots
            raise ValueError(f"--lr must be positive (finite) and --gamma at least 0.01, got {self.lr} and "
                             f"{self.gamma}")  # a smaller γ is 0 in fp32: the decay weights were NaN
        for name, flag in (("distill", "--distill"), ("selector_weight", "--selector-weight")):
            if not 0 <= getattr(self, name) < math.inf:
                raise ValueError(f"{flag} must be a finite number >= 0, got {getattr(self, name)}")
        if self.head_vocab not in HEAD_VOCABS:
            raise ValueError(f"head vocabulary {self.head_vocab!r} is not one of {', '.join(HEAD_VOCABS)}")


HEAD_VOCABS = ("full", "seen")


@dataclass(frozen=True)
class HeadSlice:
    """The frozen LM head's rows that the training loss scores (dflash.md §3: the head is frozen, so only the
    drafter's hidden z learns). Scoring only the tokens the training data contains makes the head 4x cheaper on
    beam-mini's caches; tokens never seen as a label are then no longer pushed down (the eval, on the full head,
    drafts from the slice only: train() makes it the drafter's draft vocabulary)."""

    ids: torch.Tensor     # [V'] sorted token ids
    weight: torch.Tensor  # [V', H] their head rows
    index: torch.Tensor   # [V] token id -> row of the slice, −1 outside it

    @classmethod
    def of(cls, target, ids: torch.Tensor) -> "HeadSlice":
        weight = target.head_weight
        ids = ids.to(weight.device).unique()
        index = torch.full((weight.shape[0],), -1, dtype=torch.long, device=weight.device)
        index[ids] = torch.arange(ids.shape[0], device=weight.device)
        return cls(ids, weight[ids].detach().contiguous(), index)

    def logits(self, target, z: torch.Tensor) -> torch.Tensor:
        """z [..., H] -> fp32 [..., V'] (the target's logit transform included)."""
        return target.logit_transform(F.linear(z, self.weight).float())


# ---- one forward over a sequence's blocks ---------------------------------------------------------------------

def block_forward(drafter: DFlash2Drafter, ids: torch.Tensor, taps: torch.Tensor, anchors: torch.Tensor,
                  block: int, head: HeadSlice | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """block_hidden's z [N, B−1, H] through the LM head -> (logits [N, B−1, V] fp32, z); with a head slice the logits
    are over its V' tokens only."""
    target = drafter.target
    z = block_hidden(drafter, ids, taps, anchors, block)
    return (target.lm_logits(z) if head is None else head.logits(target, z)), z


def block_hidden(drafter: DFlash2Drafter, ids: torch.Tensor, taps: torch.Tensor, anchors: torch.Tensor,
                 block: int) -> torch.Tensor:
    """ids [T], taps [T, F] of one sequence; anchors [N] -> the final-normed hidden [N, B−1, H] of the N blocks (in
    the target's dtype), what the LM head and the selector read.

    The same computation as DFlash2Drafter.draft for N requests whose context is this sequence's prefix: context
    features are fused and projected once, and block n sees context positions [max(0, p_n − W), p_n). The inputs may
    live on another device than the drafter (a feature cache stays in host memory): they are moved to its device.
    """
    target, dtype, dev = drafter.target, drafter.dtype, drafter.device
    ids, taps, anchors = ids.to(dev), taps.to(dev), anchors.to(dev)
    N, S = anchors.shape[0], int(anchors.max())
    c = drafter.fuse_context(taps[None, :S])  # [1, S, H]
    ctx_pos = torch.arange(S, device=dev)
    ctx_rope = drafter.rotary(ctx_pos[None], dtype)
    positions = anchors[:, None] + torch.arange(block, device=dev)  # [N, B]
    block_ids = torch.full((N, block), drafter.cfg.mask_token_id, dtype=torch.long, device=dev)
    block_ids[:, 0] = ids[anchors]
    h = target.embed_ids(block_ids).to(dtype)
    rope = drafter.rotary(positions, dtype)
    visible = (ctx_pos < anchors[:, None]) & (ctx_pos >= anchors[:, None] - drafter.cfg.sliding_window)  # [N, S]
    mask = torch.cat((visible[:, None].expand(N, block, S), visible.new_ones(N, block, block)), dim=-1)[:, None]
    for layer in drafter.layers:
        k, v = layer.self_attn.context_kv(c, ctx_rope)  # [1, S, KV, D]
        k, v = (t.transpose(1, 2).expand(N, -1, -1, -1) for t in (k, v))  # [N, KV, S, D]
        h = layer(h, rope, k, v, mask, block, drafter.use_conv)
    return drafter.norm(h[:, 1:]).to(target.dtype)


@torch.no_grad()
def teacher_logits(drafter: DFlash2Drafter, taps: torch.Tensor, positions: torch.Tensor,
                   head: HeadSlice | None = None) -> torch.Tensor:
    """taps [T, F] of one sequence, positions [...] -> the target's fp32 logits there, [..., V] (or [..., V'] over a
    head slice): the stored residual stream of the last tapped layer through the target's remaining layers (causal,
    over the whole sequence), final norm and head. From bf16 taps, beam-mini's argmax is its own greedy token at
    99.9% of answer positions."""
    target = drafter.target
    last, hidden = drafter.cfg.target_layer_ids[-1], target.cfg.hidden_size
    h = taps[:, -hidden:].to(drafter.device, target.dtype)[None]  # [1, T, H]: the taps are in target_layer_ids order
    cache = target.new_cache(1, h.shape[1])
    step = target.step_layout(cache.lengths, h.shape[1])
    for i in range(last + 1, target.cfg.num_hidden_layers):
        h = target.layers[i](h, step, cache.k[i], cache.v[i])
    z = target.norm(h[0, positions.to(drafter.device)])
    return target.lm_logits(z) if head is None else head.logits(target, z)


def block_labels(ids: torch.Tensor, anchors: torch.Tensor, block: int) -> torch.Tensor:
    """[N, B−1]: slot k−1 holds x_{p+k}, IGNORE past the sequence's end."""
    pos = anchors[:, None] + torch.arange(1, block, device=anchors.device)
    return torch.where(pos < ids.shape[0], ids[pos.clamp(max=ids.shape[0] - 1)], IGNORE)


def decay_weights(block: int, gamma: float, device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.exp(-torch.arange(block - 1, dtype=torch.float32, device=device) / gamma)  # slot k−1: exp(−(k−1)/γ)


def accept_lengths(drafts: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """drafts, labels [N, S] -> [N] float: 1 + leading matches (the target's bonus token counts as one)."""
    return 1.0 + (drafts == labels).long().cumprod(-1).sum(-1).float()


def block_losses(drafter: DFlash2Drafter, ids: torch.Tensor, taps: torch.Tensor, anchors: torch.Tensor,
                 cfg: TrainConfig, head: HeadSlice | None = None) -> dict[str, torch.Tensor]:
    """Weighted sums and weights for one sequence's blocks (summed over sequences, divided once per step).
    With a head slice, every label must be one of its tokens. Inputs on any device, results on the drafter's."""
    ids, anchors = ids.to(drafter.device), anchors.to(drafter.device)
    logits, z = block_forward(drafter, ids, taps, anchors, cfg.block_size, head)
    labels = block_labels(ids, anchors, cfg.block_size)  # [N, S] token ids
    valid = labels != IGNORE
    rows = labels if head is None else torch.where(valid, head.index[labels.clamp(min=0)], IGNORE)  # in the logits
    w = decay_weights(cfg.block_size, cfg.gamma, labels.device)[None].expand_as(labels) * valid
    ce = F.cross_entropy(logits.flatten(0, 1), rows.flatten(), ignore_index=IGNORE, reduction="none")
    prev = torch.cat((ids[anchors][:, None], labels[:, :-1].clamp(min=0)), dim=1)  # teacher-forced predecessors
    top_k = min(drafter.cfg.selector_top_k, logits.shape[-1])
    cand, scores = drafter.candidate_selector.teacher_forced_scores(logits, z, prev, top_k,
                                                                     None if head is None else head.ids)
    hit = cand == labels[..., None]  # [N, S, K]
    recalled = hit.any(-1) & valid
    sel_ce = F.cross_entropy(scores.flatten(0, 1), hit.float().argmax(-1).flatten(), reduction="none")
    sel_w = w * recalled
    top1 = logits.argmax(-1) if head is None else head.ids[logits.argmax(-1)]
    eval_slots = cfg.eval_block_size - 1
    soft = {}
    if cfg.distill > 0:  # slot k's teacher is the target's distribution at p+k−1, the position that predicts x_{p+k}
        pos = (anchors[:, None] + torch.arange(cfg.block_size - 1, device=anchors.device)).clamp(max=ids.shape[0] - 1)
        p_t = teacher_logits(drafter, taps, pos, head).log_softmax(-1)  # [N, S, V]
        kl = (p_t.exp() * (p_t - logits.log_softmax(-1))).sum(-1)  # [N, S]
        soft = {"kd": (kl * w).sum()}
    return soft | {
        "base": (ce.view_as(w) * w).sum(), "base_w": w.sum(),
        "sel": (sel_ce.view_as(w) * sel_w).sum(), "sel_w": sel_w.sum(),
        "correct": ((top1 == labels) & valid).sum().float(), "count": valid.sum().float(),
        "recalled": recalled.sum().float(),
        "tau": accept_lengths(top1[:, :eval_slots], labels[:, :eval_slots]).sum(),
        "blocks": torch.tensor(float(len(anchors)), device=labels.device),
    }


# ---- data split and anchor draws ------------------------------------------------------------------------------

def fingerprint(data: FeatureSet) -> dict:
    """The training data's identity in a training state: its size and a digest of every sequence, in order (their
    ids, not their taps: a cache's answers files give it)."""
    h = hashlib.sha256()
    for t in (data.ids, data.seq_start, data.prompt_len, data.greedy):
        h.update(t.to(torch.int64).contiguous().numpy())
    return {"sequences": len(data), "tokens": int(data.ids.shape[0]), "sha256": h.hexdigest()[:16]}


def _in_words(fingerprint: dict) -> str:
    return (f"{fingerprint['sequences']:,} sequences, {fingerprint['tokens']:,} tokens, digest "
            f"{fingerprint['sha256']}")


def split(data: FeatureSet, cfg: TrainConfig) -> tuple[list[int], list[int]]:
    """(train, held-out) sequence indices: the last `eval_sequences` greedy answers are held out, and no sequence of
    the same prompt is trained on (caches drawn from the same templates repeat prompts, and a repeated prompt's
    greedy answer is the same text: 5 of the 32 held-out answers of caches 6-13 were also training answers)."""
    greedy = [i for i in range(len(data)) if bool(data.greedy[i])]
    held = greedy[len(greedy) - cfg.eval_sequences:] if len(greedy) > cfg.eval_sequences else []  # 0: none
    held_prompts = {data.prompt(i) for i in held}
    train = [i for i in range(len(data)) if _anchor_range(data, i)[1] > _anchor_range(data, i)[0]
             and data.prompt(i) not in held_prompts]
    if not train:
        raise BeamtrtError("the training data has no sequence with at least two answer tokens")
    return train, held


def _anchor_range(data: FeatureSet, i: int) -> tuple[int, int]:
    """Valid anchors of sequence i: [P, T−1): an answer token followed by another answer token."""
    length = int(data.seq_start[i + 1] - data.seq_start[i])
    return int(data.prompt_len[i]), length - 1


def draw(data: FeatureSet, train: list[int], cfg: TrainConfig, step: int) -> list[tuple[int, torch.Tensor]]:
    """The step's (sequence, sorted anchors) pairs, a pure function of (seed, step): drawn on the host whatever the
    training device, so a run draws the same anchors on any device."""
    gen = torch.Generator("cpu").manual_seed(cfg.seed * 1_000_003 + step)
    picks = []
    for j in torch.randint(len(train), (cfg.seqs_per_step,), generator=gen, device="cpu").tolist():
        lo, hi = _anchor_range(data, train[j])
        perm = torch.randperm(hi - lo, generator=gen, device="cpu")[:cfg.anchors_per_seq]
        picks.append((train[j], (perm + lo).sort().values))
    return picks


def lr_at(cfg: TrainConfig, step: int) -> float:
    warm = max(1, round(cfg.warmup * cfg.steps))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    t = (step - warm) / max(1, cfg.steps - warm)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


# ---- evaluation -----------------------------------------------------------------------------------------------

def decode_steps(accepted: torch.Tensor) -> int:
    """accepted [A]: the accept length at every anchor of one answer (anchor j = answer token j, labels ending at
    its last token) -> the steps speculative decoding takes to commit the A tokens after the first: from the first
    answer token, each step commits its accept length (the last one what is left) and the token it ends on anchors
    the next."""
    lengths, pos, steps = accepted.long().tolist(), 0, 0
    while pos < len(lengths):
        pos, steps = pos + lengths[pos], steps + 1
    return steps


@torch.no_grad()
def evaluate(drafter: DFlash2Drafter, data: FeatureSet, held: list[int], cfg: TrainConfig,
             chunk: int = 64) -> dict[str, float]:
    """Greedy acceptance length at the serving block on held-out greedy answers. The labels are the target's own
    argmax path, so the accept length at every anchor is what speculative decoding would see there, and walking
    them as the decoder does (the next anchor is where a step ends) gives its τ exactly: eval_tau for the selector
    walk, eval_tau_top1 for the slots' argmax. eval_tau_every_anchor averages over every position instead; it is
    higher, because the decoder crosses easy stretches in few steps and spends a step on each hard token.
    The blocks are drafted through the drafter's own head (DFlash2Drafter.head), as the decoder drafts them: from its
    draft vocabulary alone when it has one."""
    return eval_ratios(eval_sums(drafter, data, held, cfg, chunk))


@torch.no_grad()
def eval_sums(drafter: DFlash2Drafter, data: FeatureSet, held: list[int], cfg: TrainConfig,
              chunk: int = 64) -> dict[str, float]:
    """evaluate's counts (tokens, steps, ...), which add up over sets of answers."""
    block = cfg.eval_block_size
    sums = dict.fromkeys(("tokens", "steps", "steps_top1", "every", "recall", "count"), 0.0)
    for i in held:
        ids, taps, _ = data.sequence(i)
        lo, hi = _anchor_range(data, i)
        if hi <= lo:
            continue
        ids, taps, accepted, accepted_top1 = ids.to(drafter.device), taps.to(drafter.device).float(), [], []
        for start in range(lo, hi, chunk):
            anchors = torch.arange(start, min(start + chunk, hi), device=drafter.device)
            out = drafter.head(block_hidden(drafter, ids, taps, anchors, block), ids[anchors], lattice=True)
            labels = block_labels(ids, anchors, block)
            drafts, _ = walk_greedy(out.cand_ids, out.scores)
            accepted.append(accept_lengths(drafts, labels))
            accepted_top1.append(accept_lengths(out.logits.argmax(-1), labels))
            valid = labels != IGNORE
            sums["recall"] += float(((out.cand_ids == labels[..., None]).any(-1) & valid).sum())
            sums["count"] += float(valid.sum())
        accepted, accepted_top1 = torch.cat(accepted), torch.cat(accepted_top1)
        sums["steps"] += decode_steps(accepted)
        sums["steps_top1"] += decode_steps(accepted_top1)
        sums["tokens"] += len(accepted)
        sums["every"] += float(accepted.sum())
    return sums


def eval_ratios(sums: dict[str, float]) -> dict[str, float]:
    """eval_sums -> evaluate's metrics ({} when nothing was scored)."""
    if not sums["steps"]:
        return {}
    return {"eval_tau": round(sums["tokens"] / sums["steps"], 4),
            "eval_tau_top1": round(sums["tokens"] / sums["steps_top1"], 4),
            "eval_tau_every_anchor": round(sums["every"] / sums["tokens"], 4),
            "eval_recall": round(sums["recall"] / max(sums["count"], 1.0), 4)}


# ---- the loop -------------------------------------------------------------------------------------------------

def _save_state(path: Path, drafter: DFlash2Drafter, opt: torch.optim.Optimizer, step: int, cfg: TrainConfig,
                log: list[dict], data: dict, target: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        # into a file object: a failed write is an OSError (No space left on device); given a path, torch.save said
        # "[enforce fail at inline_container.cc:672] . unexpected pos ..."
        with open(tmp, "wb") as f:
            torch.save({"step": step, "config": dataclasses.asdict(cfg), "data": data, "target": target,
                        "drafter": dataclasses.asdict(drafter.cfg), "model": drafter.state_dict(),
                        "optimizer": opt.state_dict(), "log": log}, f)
        os.replace(tmp, path)
    except BaseException as e:  # the last complete state stays; no partial file beside it
        tmp.unlink(missing_ok=True)
        if isinstance(e, (OSError, RuntimeError)):
            raise BeamtrtError(f"{path}: cannot write the training state ({error_line(e)})") from None
        raise


_FLAGS = {"anchors_per_seq": "--anchors", "init_from": "--init"}  # TrainConfig fields named unlike their flags
_NO_FLAG = ("warmup", "min_lr_ratio", "grad_clip", "eval_sequences")  # fixed by the code's version
_STATE = {"step": int, "config": dict, "data": dict, "target": str, "drafter": dict, "model": dict, "optimizer": dict,
          "log": list}  # a training state's fields
_FINGERPRINT = {"sequences": int, "tokens": int, "sha256": str}  # its data's (_fingerprint)
_PERIODS = ("eval_every", "checkpoint_every")  # change no weight (the eval draws nothing): a resume may change them


def check_state(state_path: Path, cfg: TrainConfig, drafter_cfg, target: str) -> dict:
    """A training state to resume (what train() saves), checked against this run's settings, drafter layout and
    target digest: one line when it is not this run's. Its data: check_data."""
    try:
        state = torch.load(state_path, map_location="cpu", weights_only=False)  # any device's state
    except Exception as e:
        raise BeamtrtError(f"{state_path}: cannot resume, the training state is corrupt ({e.__class__.__name__}); "
                           "remove it to start over") from None
    if not isinstance(state, dict) or not all(k in state for k in _STATE):
        raise BeamtrtError(f"{state_path}: not a training state of this version (no {', '.join(_STATE)}); remove it, "
                           "or use another --work directory, to start over")
    fields = [(k, state[k], kind) for k, kind in _STATE.items()]
    if isinstance(state["data"], dict):
        fields += [(f"data.{k}", state["data"].get(k), kind) for k, kind in _FINGERPRINT.items()]
    for name, value, kind in fields:  # a hand-edited state was a TypeError traceback
        if not isinstance(value, kind) or isinstance(value, bool):
            raise BeamtrtError(f"{state_path}: cannot resume, the training state is damaged (its {name} is "
                               f"{type(value).__name__}, not {kind.__name__}); remove it to start over")
    if state["target"] != target:
        raise BeamtrtError(f"{state_path} was trained against another target (digest {state['target']}, this "
                           f"one's {target}): use the same --target, or another --work directory")
    had, now = state["drafter"], dataclasses.asdict(drafter_cfg)
    diff = [k for k, v in now.items() if had.get(k) != v]
    if diff:  # before drafters recorded the block they trained at, their config (and a state's) said 16 whatever it was
        unrecorded = "block_size" in diff and had.get("block_size") == 16 != state["config"].get("block_size")
        raise BeamtrtError(f"{state_path} holds a drafter of another layout ("
                           + ", ".join(f"{k} {had.get(k)!r} (now {now[k]!r})" for k in diff)
                           + ("; a state written before drafters recorded the block they trained at says 16"
                              if unrecorded else "")
                           + "): pass the same --layers, --selector-rank and --block-size (and --init), or another "
                           "--work directory")
    was = state["config"]
    diff = [f"{k if k in _NO_FLAG else _FLAGS.get(k, '--' + k.replace('_', '-'))} {was.get(k)!r} (now {v!r})"
            for k, v in dataclasses.asdict(cfg).items() if was.get(k) != v and k not in _PERIODS]
    if diff:
        raise BeamtrtError(f"{state_path} was written with other training settings ({', '.join(diff)}): pass the "
                           "same flags, or remove it (or use another --work directory) to start over")
    return state


def check_data(state_path: Path, trained_on: dict, data: dict) -> None:
    """A training state's data (`trained_on`, its fingerprint) is this run's (`data`): one line when it is not."""
    if trained_on != data:
        raise BeamtrtError(f"{state_path} was trained on other data ({_in_words(trained_on)}; now {_in_words(data)}): "
                           "use the same feature caches in the same order, or another --work directory")


def _resume(state_path: Path, drafter: DFlash2Drafter, opt: torch.optim.Optimizer, cfg: TrainConfig, data: dict,
            target: str) -> tuple[int, list[dict]]:
    """Load a training state into drafter and opt -> (step, log); one line when it is not one of this run's."""
    state = check_state(state_path, cfg, drafter.cfg, target)
    check_data(state_path, state["data"], data)
    try:
        drafter.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
    except (RuntimeError, ValueError, KeyError, TypeError) as e:
        raise BeamtrtError(f"{state_path}: cannot resume, its tensors do not fit this drafter ({e.__class__.__name__})"
                           "; remove it to start over") from None
    return state["step"], state["log"]


def train(drafter: DFlash2Drafter, data: FeatureSet, cfg: TrainConfig, work: Path, quiet: bool = False,
          stop_after: int | None = None, digest: str | None = None) -> list[dict]:
    """Train `drafter` (fp32, in place) for cfg.steps, resuming from work/train_state.pt when it exists; its draft
    vocabulary becomes the head slice's tokens (`head_vocab` "seen") or the whole vocabulary ("full") before the first
    step (after an --init drafter's baseline eval, which drafts from its own), so that every eval drafts as it will.

    Returns the log: one row per step (losses, accuracy, τ proxy at the eval block, lr) plus eval rows.
    stop_after: end (after checkpointing) once this many steps are done in total (simulates an interruption).
    digest: the target's `target_digest` (computed when not given), kept in the training state.
    """
    from tqdm import tqdm

    from beamtrt.train.features import target_digest

    work.mkdir(parents=True, exist_ok=True)
    state_path = work / "train_state.pt"
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    step, log = 0, []
    identity, target = fingerprint(data), digest or target_digest(drafter.target)
    if state_path.exists():
        step, log = _resume(state_path, drafter, opt, cfg, identity, target)
    train_ids, held = split(data, cfg)
    head = None
    if cfg.head_vocab == "seen":
        head = HeadSlice.of(drafter.target, torch.cat([data.sequence(i)[0] for i in train_ids]))
    if held and step == 0 and cfg.init_from:  # the starting drafter's score on this held-out set: the baseline
        if not quiet:
            print(f"step 0: scoring the --init drafter on {len(held)} held-out answers", file=sys.stderr, flush=True)
        drafter.eval()
        log.append({"step": 0, "seconds": 0.0} | evaluate(drafter, data, held, cfg))
    drafter.set_draft_vocab(None if head is None else head.ids)  # it drafts from the tokens its loss scores: evals too
    bar = tqdm(total=cfg.steps, initial=step, desc="train drafter", unit="step", disable=quiet, dynamic_ncols=True)
    drafter.train()
    while step < cfg.steps:
        t0 = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = lr_at(cfg, step)
        opt.zero_grad(set_to_none=True)
        parts = [block_losses(drafter, *data.sequence(i)[:2], anchors, cfg, head)
                 for i, anchors in draw(data, train_ids, cfg, step)]
        total = {k: sum(p[k] for p in parts) for k in parts[0]}
        base = total["base"] / total["base_w"].clamp(min=1e-9)
        sel = total["sel"] / total["sel_w"].clamp(min=1e-9)
        kd = total["kd"] / total["base_w"].clamp(min=1e-9) if cfg.distill > 0 else None
        loss = base + cfg.selector_weight * sel + (cfg.distill * kd if kd is not None else 0.0)
        loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip))
        if not (math.isfinite(float(loss.detach())) and math.isfinite(grad_norm)):  # before the step: state sound
            saved = (f"the last training state in {work} is from before it: lower --lr and start over in another "
                     "--work directory") if state_path.exists() else "no training state was saved: lower --lr"
            raise BeamtrtError(f"training diverged at step {step + 1} (loss {float(loss.detach())}, gradient norm "
                               f"{grad_norm}); {saved}")
        opt.step()
        step += 1
        loss, base, sel = loss.detach(), base.detach(), sel.detach()
        kd = kd.detach() if kd is not None else None
        row = {"step": step, "loss": round(float(loss), 5), "base": round(float(base), 5),
               "selector": round(float(sel), 5)} | ({"kd": round(float(kd), 5)} if kd is not None else {}) | {
               "acc": round(float(total["correct"] / total["count"]), 4),
               "recall": round(float(total["recalled"] / total["count"]), 4),
               "tau_proxy": round(float(total["tau"] / total["blocks"]), 4), "grad_norm": round(grad_norm, 4),
               "lr": lr_at(cfg, step - 1), "seconds": round(time.perf_counter() - t0, 3)}
        if held and (step % cfg.eval_every == 0 or step == cfg.steps):
            bar.set_postfix_str(f"step {step}: scoring {len(held)} held-out answers")  # the bar stands meanwhile
            drafter.eval()
            row.update(evaluate(drafter, data, held, cfg))
            drafter.train()
        log.append(row)
        bar.update(1)
        bar.set_postfix({k: row[k] for k in ("loss", "acc", "tau_proxy") if k in row} |
                        ({"eval_tau": row["eval_tau"]} if "eval_tau" in row else {}))
        if step % cfg.checkpoint_every == 0 or step == cfg.steps or step == stop_after:
            _save_state(state_path, drafter, opt, step, cfg, log, identity, target)
        if stop_after is not None and step >= stop_after:
            break
    bar.close()
    drafter.eval()
    return log


def write_log(path: Path, log: list[dict]) -> None:
    write_text(path, "".join(json.dumps(row) + "\n" for row in log), "the training log")

"""Drafter training data: the target's own answers to prompts plus its tapped hidden states, in resumable shards.

A shard `features-NNNNN.safetensors` holds a run of sequences back to back:
    ids        [T] int64            every token (prompt, then the target's answer, EOS included when reached)
    taps       [T, n_taps * H] bf16 the target's residual stream after each drafter tap layer, per token
    seq_start  [n + 1] int64        sequence i is rows seq_start[i] : seq_start[i + 1]
    prompt_len [n] int64            the first prompt_len[i] rows of sequence i are prompt (no loss on them)
    greedy     [n] bool             the answer was decoded greedily (so it is the target's argmax path)
Shards are written whole (temporary file, then rename), so an interrupted run resumes at the first missing shard.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from safetensors.torch import load_file, save_file

from beamtrt.errors import BeamtrtError
from beamtrt.models.beam import BeamForCausalLM, right_padded


@dataclass(frozen=True)
class DataRecipe:
    prompts: int = 448               # prompts requested from the training mix (distinct ones are kept)
    seed: int = 0
    max_prompt_tokens: int = 256     # longer chat-formatted prompts are skipped
    max_new_tokens: int = 160
    batch: int = 64                  # sequences decoded together
    shard_size: int = 64             # sequences per shard file
    sampled_every: int = 4           # every n-th sequence is sampled (T, top-p below) instead of greedy
    temperature: float = 0.7
    top_p: float = 0.99
    mix: str = "v2"                  # training prompt mix (beamtrt.train.prompts.MIXES)


@dataclass
class FeatureSet:
    """Every shard of a feature cache, concatenated in memory."""

    ids: torch.Tensor         # [T] int64
    taps: torch.Tensor        # [T, F] bf16
    seq_start: torch.Tensor   # [n + 1]
    prompt_len: torch.Tensor  # [n]
    greedy: torch.Tensor      # [n] bool

    def __len__(self) -> int:
        return self.prompt_len.shape[0]

    def sequence(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(ids [T_i], taps [T_i, F], prompt length) of sequence i."""
        a, b = int(self.seq_start[i]), int(self.seq_start[i + 1])
        return self.ids[a:b], self.taps[a:b], int(self.prompt_len[i])


def _sample(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator) -> torch.Tensor:
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    sorted_p[(sorted_p.cumsum(-1) - sorted_p) >= top_p] = 0.0
    pick = torch.multinomial(sorted_p, 1, generator=gen).squeeze(-1)
    return order.gather(-1, pick[:, None]).squeeze(-1)


@torch.inference_mode()
def answer_with_taps(target: BeamForCausalLM, prompts: Sequence[Sequence[int]], taps: Sequence[int],
                     eos_ids: Sequence[int], max_new_tokens: int, sampled: Sequence[bool], temperature: float,
                     top_p: float, gen: torch.Generator) -> list[tuple[list[int], torch.Tensor]]:
    """Decode every prompt in one batch and return (all tokens, taps [T, n_taps * H]) per sequence.

    Every new token is fed back once (that forward yields its taps); a row stops after an EOS id (kept) or
    max_new_tokens. Finished rows step along with their EOS, ignored, until half the batch has finished; then the
    live rows' caches are compacted into a smaller batch (one copy, instead of a gather every step).
    """
    B, device = len(prompts), target.device
    ids, lengths = right_padded(prompts, device)
    cache = target.new_cache(B, int(lengths.max()) + max_new_tokens)
    out = target(ids, cache, num_tokens=lengths, taps=taps)
    prompt_taps = torch.cat(out.taps, dim=-1)  # [B, T, F]
    logits = out.logits[torch.arange(B), lengths - 1]  # [B, V]
    sampled_rows = torch.tensor(list(sampled), device=device)
    eos = torch.tensor(list(eos_ids), dtype=torch.long, device=device)
    rows = torch.arange(B, device=device)  # the sequence each cache row holds
    done = torch.zeros(B, dtype=torch.bool, device=device)
    answers: list[list[int]] = [[] for _ in range(B)]
    answer_taps: list[list[torch.Tensor]] = [[] for _ in range(B)]
    for _ in range(max_new_tokens):
        nxt = logits.argmax(-1)
        if bool(sampled_rows[rows].any()):
            nxt = torch.where(sampled_rows[rows], _sample(logits, temperature, top_p, gen), nxt)
        if eos.numel():
            nxt = torch.where(done, eos[0], nxt)
        out = target(nxt[:, None], cache, taps=taps)
        feats = torch.cat(out.taps, dim=-1)[:, 0]  # [rows, F]
        live = (~done).nonzero().flatten()
        for r, b in zip(live.tolist(), rows[live].tolist()):
            answers[b].append(int(nxt[r]))
            answer_taps[b].append(feats[r])
        done |= torch.isin(nxt, eos)
        if bool(done.all()):
            break
        logits = out.logits[:, -1]
        if int(done.sum()) * 2 >= done.numel():  # compact: keep only the live rows' caches
            keep = (~done).nonzero().flatten()
            cache.k, cache.v, cache.lengths = cache.k[:, keep], cache.v[:, keep], cache.lengths[keep]
            rows, done, logits = rows[keep], done[keep], logits[keep]
    return [(list(p) + answers[b], torch.cat((prompt_taps[b, :len(p)], torch.stack(answer_taps[b]))))
            for b, p in enumerate(prompts)]


def _chat_ids(tokenizer, prompt: str) -> list[int]:
    return list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True))


def build_features(target: BeamForCausalLM, tokenizer, taps: Sequence[int], prompts: Sequence[str], out: Path,
                   recipe: DataRecipe, quiet: bool = False) -> Path:
    """Fill `out` with feature shards for `prompts` (resuming after the last complete shard); returns `out`."""
    from tqdm import tqdm

    out.mkdir(parents=True, exist_ok=True)
    meta = {"recipe": dataclasses.asdict(recipe), "taps": list(taps), "prompts": len(prompts),
            "hidden_size": target.cfg.hidden_size}
    meta_path = out / "meta.json"
    if meta_path.exists():
        old = json.loads(meta_path.read_text())
        old.get("recipe", {}).setdefault("mix", "v1")  # caches made before mixes had names used the first one
        if {k: old.get(k) for k in meta} != meta:
            raise BeamtrtError(f"{out} holds features made with other settings: remove it or choose another --data")
    else:
        meta_path.write_text(json.dumps(meta, indent=2) + "\n")
    encoded = [ids for ids in (_chat_ids(tokenizer, p) for p in prompts) if len(ids) <= recipe.max_prompt_tokens]
    eos_ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    shards = [encoded[i:i + recipe.shard_size] for i in range(0, len(encoded), recipe.shard_size)]
    done = sum(1 for i in range(len(shards)) if (out / f"features-{i:05d}.safetensors").exists())
    bar = tqdm(total=len(encoded), initial=sum(len(s) for s in shards[:done]), desc="target answers",
               unit="seq", disable=quiet, dynamic_ncols=True)
    produced, t0 = 0, time.perf_counter()
    for i, shard in enumerate(shards):
        path = out / f"features-{i:05d}.safetensors"
        if path.exists():
            continue
        gen = torch.Generator().manual_seed(recipe.seed * 1_000_003 + i)
        seqs = []
        for j in range(0, len(shard), recipe.batch):
            chunk = shard[j:j + recipe.batch]
            sampled = [(i * recipe.shard_size + j + k) % recipe.sampled_every == recipe.sampled_every - 1
                       for k in range(len(chunk))]
            seqs += [(ids, f, len(p), not s) for (ids, f), p, s in zip(
                answer_with_taps(target, chunk, taps, eos_ids, recipe.max_new_tokens, sampled,
                                 recipe.temperature, recipe.top_p, gen), chunk, sampled)]
            produced += sum(len(ids) - len(p) for (ids, _, _, _), p in zip(seqs[-len(chunk):], chunk))
            bar.update(len(chunk))
            bar.set_postfix(answer_tok_s=f"{produced / (time.perf_counter() - t0):.0f}")
        lengths = torch.tensor([len(s[0]) for s in seqs])
        tensors = {
            "ids": torch.tensor([t for s in seqs for t in s[0]], dtype=torch.long),
            "taps": torch.cat([s[1] for s in seqs]).to(torch.bfloat16).contiguous(),
            "seq_start": torch.cat((torch.zeros(1, dtype=torch.long), lengths.cumsum(0))),
            "prompt_len": torch.tensor([s[2] for s in seqs], dtype=torch.long),
            "greedy": torch.tensor([s[3] for s in seqs], dtype=torch.bool),
        }
        tmp = path.with_name(path.name + ".tmp")
        save_file(tensors, str(tmp))
        os.replace(tmp, path)
    bar.close()
    return out


def load_features(*dirs: Path) -> FeatureSet:
    """Read every shard of one or more feature caches (in the order given) into one FeatureSet."""
    parts, taps = [], None
    for data in dirs:
        paths = sorted(data.glob("features-*.safetensors"))
        if not paths:
            raise BeamtrtError(f"{data}: no feature shards (features-*.safetensors)")
        meta = json.loads((data / "meta.json").read_text()) if (data / "meta.json").is_file() else {}
        if taps is not None and meta.get("taps") != taps:
            raise BeamtrtError(f"{data}: features of target layers {meta.get('taps')}, the first cache has {taps}")
        taps = meta.get("taps")
        for p in paths:
            try:
                parts.append(load_file(str(p)))
            except Exception as e:  # safetensors raises several types for a truncated or corrupt file
                raise BeamtrtError(f"{p}: corrupt feature shard ({e})") from None
    starts, total = [], 0
    for part in parts:
        starts.append(part["seq_start"][:-1] + total)
        total += part["ids"].shape[0]
    return FeatureSet(ids=torch.cat([p["ids"] for p in parts]), taps=torch.cat([p["taps"] for p in parts]),
                      seq_start=torch.cat(starts + [torch.tensor([total])]),
                      prompt_len=torch.cat([p["prompt_len"] for p in parts]),
                      greedy=torch.cat([p["greedy"] for p in parts]))

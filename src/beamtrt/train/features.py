"""Drafter training data: the target's own answers to prompts plus its tapped hidden states, in resumable shards.

A shard `features-NNNNN.safetensors` holds a run of sequences back to back:
    ids        [T] int64            every token (prompt, then the target's answer, EOS included when reached)
    taps       [T, n_taps * H] bf16 the target's residual stream after each drafter tap layer, per token
    seq_start  [n + 1] int64        sequence i is rows seq_start[i] : seq_start[i + 1]
    prompt_len [n] int64            the first prompt_len[i] rows of sequence i are prompt (no loss on them)
    greedy     [n] bool             the answer was decoded greedily (so it is the target's argmax path)
Shards are written whole (temporary file, then rename), so an interrupted run answers only the missing shards.
Beside each one, `answers-NNNNN.safetensors` holds the same sequences without their taps (ids as int32, seq_start,
prompt_len, greedy: about 4 bytes a token instead of ~5.8 KB), small enough to commit; a shard whose answers file
is present but whose features are not gets its taps back from one teacher-forced forward per sequence
(`rebuild_features`), about 2.5× faster than answering again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Collection, Iterator, Sequence

import torch
from safetensors.torch import load_file

from beamtrt.checkpoint.hf import read_json, save_safetensors, write_json
from beamtrt.errors import BeamtrtError
from beamtrt.models.beam import BeamForCausalLM, right_padded
from beamtrt.prompts import render_chat

MAX_PROMPTS = 1_000_000  # train_drafter.py --prompts: beyond, minutes of silent work making them, then memory


@dataclass(frozen=True)
class DataRecipe:
    prompts: int = 448               # prompts requested from the training mix (distinct ones are kept), <= MAX_PROMPTS
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

    def prompt(self, i: int) -> tuple[int, ...]:
        """The prompt ids of sequence i (its chat-template ids, as a key)."""
        a = int(self.seq_start[i])
        return tuple(self.ids[a:a + int(self.prompt_len[i])].tolist())

    def select(self, indices: Sequence[int]) -> "FeatureSet":
        """A new set of these sequences (at least one), in this order."""
        parts = []
        for i in indices:
            ids, taps, _ = self.sequence(i)
            parts.append(FeatureSet(ids, taps, torch.tensor([0, ids.shape[0]]), self.prompt_len[i:i + 1],
                                    self.greedy[i:i + 1]))
        return concat_features(parts)


def concat_features(parts: Sequence[FeatureSet]) -> FeatureSet:
    """One set of the sequences of all parts (at least one), in order."""
    starts, total = [], 0
    for part in parts:
        starts.append(part.seq_start[:-1] + total)
        total += part.ids.shape[0]
    return FeatureSet(ids=torch.cat([p.ids for p in parts]), taps=torch.cat([p.taps for p in parts]),
                      seq_start=torch.cat(starts + [torch.tensor([total])]),
                      prompt_len=torch.cat([p.prompt_len for p in parts]), greedy=torch.cat([p.greedy for p in parts]))


def _sample(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator) -> torch.Tensor:
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    sorted_p[(sorted_p.cumsum(-1) - sorted_p) >= top_p] = 0.0
    pick = torch.multinomial(sorted_p, 1, generator=gen).squeeze(-1)
    return order.gather(-1, pick[:, None]).squeeze(-1)


PREFILL_ROWS = 8  # prompts prefilled per forward: sorted by length, so that little of it is padding


@torch.inference_mode()
def answer_with_taps(target: BeamForCausalLM, prompts: Sequence[Sequence[int]], taps: Sequence[int],
                     eos_ids: Sequence[int], max_new_tokens: int, sampled: Sequence[bool], seeds: Sequence[int],
                     temperature: float, top_p: float, batch: int | None = None
                     ) -> Iterator[tuple[int, list[int], torch.Tensor]]:
    """Answer every prompt; yield (prompt index, all tokens, taps [T, n_taps * H]) as each answer ends.

    Continuous batching over `batch` cache slots (default: all prompts at once): every new token is fed back once
    (that forward yields its taps); an answer stops after an EOS id (kept) or max_new_tokens, and its slot takes
    the next waiting prompt at once. Decode steps feed only the occupied slots. A sampled answer (T, top-p) draws
    from its own generator, seeded with seeds[i], so every answer is the same whatever it is batched with.
    """
    n, device = len(prompts), target.device
    if n == 0:
        return
    B = min(batch or n, n)
    cache = target.new_cache(B, max(map(len, prompts)) + max_new_tokens)
    eos = set(eos_ids)
    holds = [-1] * B  # the prompt each slot is answering; -1 = free
    gens: dict[int, torch.Generator] = {}  # slot -> generator of its sampled answer
    logits = torch.empty(B, target.cfg.vocab_size, device=device)  # each slot's next-token logits
    prompt_taps: dict[int, torch.Tensor] = {}
    answers: dict[int, list[int]] = {}
    answer_taps: dict[int, list[torch.Tensor]] = {}
    waiting = 0  # prompts[waiting:] have no slot yet
    while True:
        free = [s for s in range(B) if holds[s] < 0][:n - waiting]
        new = sorted(range(waiting, waiting + len(free)), key=lambda i: len(prompts[i]))
        waiting += len(free)
        for g in range(0, len(free), PREFILL_ROWS):  # prefill the next prompts into the free slots
            group, into = new[g:g + PREFILL_ROWS], free[g:g + PREFILL_ROWS]
            slots = torch.tensor(into, device=device)
            cache.reset(into)
            ids, num = right_padded([prompts[i] for i in group], device)
            out = target(ids, cache, num_tokens=num, taps=taps, last_only=True, slots=slots)
            feats = torch.cat(out.taps, dim=-1)  # [rows, T, F]
            logits[slots] = out.logits[:, -1]
            for j, (s, i) in enumerate(zip(into, group)):
                holds[s], prompt_taps[i], answers[i], answer_taps[i] = i, feats[j, :len(prompts[i])], [], []
                if sampled[i]:
                    gens[s] = torch.Generator(device=device).manual_seed(seeds[i])
        live = [s for s in range(B) if holds[s] >= 0]
        if not live:
            return
        rows = torch.tensor(live, device=device)
        nxt = logits[rows].argmax(-1)
        for j, s in enumerate(live):
            if sampled[holds[s]]:
                nxt[j] = _sample(logits[s:s + 1], temperature, top_p, gens[s])[0]
        out = target(nxt[:, None], cache, taps=taps, slots=None if len(live) == B else rows)
        feats = torch.cat(out.taps, dim=-1)[:, 0]  # [live, F]
        logits[rows] = out.logits[:, -1]
        for j, (s, tok) in enumerate(zip(live, nxt.tolist())):
            i = holds[s]
            answers[i].append(tok)
            answer_taps[i].append(feats[j])
            if tok in eos or len(answers[i]) == max_new_tokens:
                holds[s] = -1
                yield i, list(prompts[i]) + answers.pop(i), torch.cat((prompt_taps.pop(i),
                                                                        torch.stack(answer_taps.pop(i))))


def chat_ids(tokenizer, prompt: str) -> list[int]:
    """The ids the target answers for one prompt: a user turn in its chat template, ready for the reply."""
    return render_chat(tokenizer, [{"role": "user", "content": prompt}])


def target_digest(target: BeamForCausalLM) -> str:
    """A short digest of the target's config and weights as loaded: a cache holds one target's answers and taps."""
    h = hashlib.sha256(json.dumps(dataclasses.asdict(target.cfg), sort_keys=True, default=str).encode())
    for name, t in sorted(target.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()[:16]


def read_meta(data: Path) -> dict:
    """A cache's meta.json (recipe, taps, hidden size, target digest); {} for a cache made before it existed."""
    path = data / "meta.json"
    if not path.exists():
        return {}
    meta = read_json(path, "feature cache description")
    recipe = meta.get("recipe", {})
    if not isinstance(recipe, dict):
        raise BeamtrtError(f"{path}: not a feature cache's description (its recipe is not a JSON object)")
    for f in dataclasses.fields(DataRecipe):  # each field of its default's type (an int for a float too)
        kind, want = ("number", (int, float)) if isinstance(f.default, float) else (type(f.default).__name__,
                                                                                    type(f.default))
        if f.name in recipe and (not isinstance(recipe[f.name], want) or isinstance(recipe[f.name], bool)):
            raise BeamtrtError(f"{path}: recipe field {f.name!r} is {recipe[f.name]!r}, not a {kind} (a damaged "
                               "cache description)")
    if not 1 <= recipe.get("prompts", 1) <= MAX_PROMPTS:  # they are made again from it: 10**12 ran for hours
        raise BeamtrtError(f"{path}: recipe field 'prompts' is {recipe['prompts']!r}, outside 1 to {MAX_PROMPTS:,} "
                           "(a damaged cache description)")
    return meta


TAPS_TARGET = "features-target.json"  # the target whose taps were rebuilt into a cache made before caches recorded
#                                       theirs (the committed ones): git-ignored like the taps themselves


def cache_target(data: Path, meta: dict) -> str | None:
    """The digest of the target a cache's answers and taps come from: meta.json's, else the one that rebuilt its taps,
    else None (a cache made before caches recorded it, never rebuilt since)."""
    if "target" in meta:
        return meta["target"]
    path = data / TAPS_TARGET
    if not path.exists():
        return None
    try:
        return str(json.loads(path.read_text())["target"])
    except (OSError, ValueError, KeyError, TypeError):
        raise BeamtrtError(f"{path}: unreadable; remove it and the cache's features-*.safetensors (their taps are "
                           "rebuilt from the answers files)") from None


def check_target(data: Path, meta: dict, digest: str | None) -> None:
    """A cache holds one target's answers and taps: another target's digest is refused."""
    recorded = cache_target(data, meta)
    if digest is not None and recorded not in (None, digest):
        raise BeamtrtError(f"{data}: made by another target (digest {recorded}, this one's {digest}): use the "
                           "target that made it, or another directory")


def sequence_files(data: Path, name: str = "") -> list[tuple[Path, str]]:
    """A cache's shards in order, each as (its answers file, else its feature shard: the same sequences, what it is).
    A folder with neither is one line naming it as `name` (default: its path)."""
    shards = {p.name.split("-", 1)[1]: (p, "feature shard") for p in data.glob("features-*.safetensors")}
    shards |= {p.name.split("-", 1)[1]: (p, "answers file") for p in data.glob("answers-*.safetensors")}
    if not shards:
        raise BeamtrtError(f"{name or data}: not a feature cache (no answers-*.safetensors or features-*.safetensors)")
    return [shards[number] for number in sorted(shards)]


def answered_prompts(*caches: Path) -> set[tuple[int, ...]]:
    """The prompt ids of every sequence in these feature caches (from their answers files, and from the feature
    shards that have none)."""
    found: set[tuple[int, ...]] = set()
    for data in caches:
        for path, what in sequence_files(data):
            t = read_sequences(path, what)
            ids = t["ids"].tolist()
            found.update(tuple(ids[a:a + n]) for a, n in zip(t["seq_start"].tolist(), t["prompt_len"].tolist()))
    return found


def _skipped(left_out: list[list[int]]) -> dict:
    """meta.json's record of the prompts a cache left out: how many, and a digest of which."""
    h = hashlib.sha256(json.dumps(sorted(left_out)).encode())
    return {"prompts": len(left_out), "digest": h.hexdigest()[:16]}


def _check_skipped(out: Path, old: dict | None, new: dict | None) -> None:
    """A cache resumes with the prompts it was started with: the same ones left out, or none."""
    if old == new:
        return
    if new is None:
        raise BeamtrtError(f"{out} was made leaving out {old['prompts']} prompts answered in other caches: pass the "
                           "same --skip-answered-in caches as when it was made")
    if old is None:
        raise BeamtrtError(f"{out} was made without --skip-answered-in: resume it without it, or choose another --data")
    raise BeamtrtError(f"{out} was made leaving out {old['prompts']} prompts answered in other caches; these "
                       f"--skip-answered-in caches leave out {new['prompts']} (other ones): pass the same caches as "
                       "when it was made")


# meta.json's fields as the train_drafter.py flags that set them (a refused resume names the flag)
FLAGS = {"recipe.prompts": "--prompts", "recipe.seed": "--data-seed", "recipe.max_new_tokens": "--max-new-tokens",
         "recipe.shard_size": "shard size (--gen-batch)", "recipe.mix": "--prompt-mix",
         "taps": "taps (the drafter's target layers)"}


def _made_by(meta: dict) -> dict:
    """What a resumed cache must share with the run that started it: not the recipe's batch, the answers decoded at
    once, which changes no answer (continuous batching, each sampled answer from its own seed); meta.json keeps the
    first run's."""
    return {**meta, "recipe": {k: v for k, v in meta.get("recipe", {}).items() if k != "batch"}}


def build_features(target: BeamForCausalLM, tokenizer, taps: Sequence[int], prompts: Sequence[str], out: Path,
                   recipe: DataRecipe, quiet: bool = False, digest: str | None = None,
                   skip: Collection[tuple[int, ...]] | None = None,
                   before_answering: Callable[[int], None] | None = None) -> Path:
    """Fill `out` with feature shards for `prompts` (answering only the shards not yet written); returns `out`.
    digest: the target's `target_digest` (computed when not given). skip: prompt ids (`answered_prompts` of other
    caches) left out, recorded in meta.json so that a resumed cache has the same prompts; None: nothing left out.
    before_answering: called with the number of shards that have no answers yet, once a resumed cache's settings are
    checked, before anything is written."""
    from tqdm import tqdm

    digest = digest or target_digest(target)
    encoded = [ids for ids in (chat_ids(tokenizer, p) for p in prompts) if len(ids) <= recipe.max_prompt_tokens]
    meta = {"recipe": dataclasses.asdict(recipe), "taps": list(taps), "prompts": len(prompts),
            "hidden_size": target.cfg.hidden_size}
    if skip is not None:
        left_out = [ids for ids in encoded if tuple(ids) in skip]
        encoded = [ids for ids in encoded if tuple(ids) not in skip]
        meta["skipped"] = _skipped(left_out)
        if left_out and not encoded:
            raise BeamtrtError(f"{out}: every one of the {len(left_out)} prompts was answered in the "
                               "--skip-answered-in caches already: choose another --data-seed or raise --prompts")
    shards = [encoded[i:i + recipe.shard_size] for i in range(0, len(encoded), recipe.shard_size)]
    made = any(out.glob("*-[0-9][0-9][0-9][0-9][0-9].safetensors"))
    old = read_meta(out) if made else None  # a meta.json alone (stopped before its first shard): nothing to resume
    if not old and made:
        raise BeamtrtError(f"{out}: holds feature shards but no meta.json, so what made them is unknown: remove them "
                           "or choose another --data")
    if old:
        old.get("recipe", {}).setdefault("mix", "v1")  # caches made before mixes had names used the first one
        _check_skipped(out, old.get("skipped"), meta.get("skipped"))
        theirs, mine = _made_by(old), _made_by(meta)
        if {k: theirs.get(k) for k in mine} != mine:
            was = {**{f"recipe.{k}": v for k, v in theirs["recipe"].items()}, **theirs}
            now = {**{f"recipe.{k}": v for k, v in mine["recipe"].items()}, **mine}
            changed = [k for k, v in now.items() if k != "recipe" and was.get(k) != v]
            if "recipe.prompts" in changed and "prompts" in changed:  # the count made follows --prompts: said once
                changed.remove("prompts")
            diff = [f"{FLAGS.get(k, k)} {was.get(k)} (now {now[k]})" for k in changed]
            raise BeamtrtError(f"{out} holds features made with other settings ({', '.join(diff)}): resume it with "
                               "those, or choose another --data")
        check_target(out, old, digest)
    if before_answering is not None:  # after the settings check: changed flags make shards missing, and it names them
        before_answering(sum(not (out / f"features-{i:05d}.safetensors").exists()
                             and not (out / f"answers-{i:05d}.safetensors").exists() for i in range(len(shards))))
    if not old:
        write_json(out / "meta.json", meta | {"target": digest})
    if skip is not None:
        print(f"phase 1: {meta['skipped']['prompts']} of {len(encoded) + meta['skipped']['prompts']} prompts left out, "
              "answered in the --skip-answered-in caches", file=sys.stderr)
    eos_ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    rebuild_features(target, taps, out, quiet=quiet, digest=digest)  # its check_cache read every file's header
    todo = [i for i in range(len(shards)) if not (out / f"features-{i:05d}.safetensors").exists()]
    if todo:
        _check_writable(out)
    bar = tqdm(total=len(encoded), initial=len(encoded) - sum(len(shards[i]) for i in todo), desc="target answers",
               unit="seq", disable=quiet or not todo, dynamic_ncols=True)  # none: no bar
    where = [(i, k) for i in todo for k in range(len(shards[i]))]  # (shard, position) of every prompt to answer
    number = [i * recipe.shard_size + k for i, k in where]  # its index in the cache
    sampled = [x % recipe.sampled_every == recipe.sampled_every - 1 for x in number]  # the others are greedy
    pending: dict[int, dict[int, tuple[list[int], torch.Tensor, bool]]] = {i: {} for i in todo}  # shard -> answers
    produced, t0 = 0, time.perf_counter()
    for j, ids, feats in answer_with_taps(
            target, [shards[i][k] for i, k in where], taps, eos_ids, recipe.max_new_tokens,
            sampled, seeds=[recipe.seed * 1_000_003 + x for x in number], temperature=recipe.temperature,
            top_p=recipe.top_p, batch=recipe.batch):
        i, k = where[j]
        pending[i][k] = ids, feats, not sampled[j]
        produced += len(ids) - len(shards[i][k])
        bar.update(1)
        bar.set_postfix(answer_tok_s=f"{produced / (time.perf_counter() - t0):.0f}")
        if len(pending[i]) == len(shards[i]):
            _write_shard(out / f"features-{i:05d}.safetensors", shards[i], pending.pop(i))
    bar.close()
    return out


def _check_writable(cache: Path) -> None:
    """Before the work whose files go into `cache`: a complete cache is used as it is, also on read-only storage."""
    from beamtrt.cli_util import probe_writable

    try:
        probe_writable(cache)
    except OSError as e:
        raise BeamtrtError(f"{cache}: cannot write in it ({e.strerror or e}), and the cache lacks shards") from None


def _save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")  # written whole: temporary file, then rename
    try:
        save_safetensors(tensors, tmp, name=path)
        os.replace(tmp, path)
    except BaseException as e:  # Ctrl-C leaves no tmp either
        with contextlib.suppress(OSError):  # (the folder may be the problem)
            tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):  # the rename (save_safetensors names its own file in one line)
            raise BeamtrtError(f"{path}: cannot write it ({e.strerror or e})") from None
        raise


def _check_header(path: Path, what: str) -> None:
    """A safetensors file whose header and size agree (no tensor read): a truncated or garbage one is one line."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt"):
            pass
    except Exception as e:
        raise _corrupt(path, what, e) from None


def _answers_path(features: Path) -> Path:
    return features.with_name(features.name.replace("features-", "answers-", 1))


def _save_answers(shard: dict[str, torch.Tensor], features: Path) -> None:
    """The shard's sequences without their taps, beside it (ids as int32: every vocabulary here is < 2^31)."""
    _save({"ids": shard["ids"].to(torch.int32)} | {k: shard[k] for k in ("seq_start", "prompt_len", "greedy")},
          _answers_path(features))


def _write_shard(path: Path, prompts: list[list[int]], answers: dict[int, tuple[list[int], torch.Tensor, bool]]
                 ) -> None:
    """One shard file and its answers file. answers: position -> (all tokens, taps, greedy)."""
    seqs = [answers[k] for k in range(len(prompts))]
    lengths = torch.tensor([len(ids) for ids, _, _ in seqs])
    tensors = {
        "ids": torch.tensor([t for ids, _, _ in seqs for t in ids], dtype=torch.long),
        "taps": torch.cat([f for _, f, _ in seqs]).to("cpu", torch.bfloat16).contiguous(),
        "seq_start": torch.cat((torch.zeros(1, dtype=torch.long), lengths.cumsum(0))),
        "prompt_len": torch.tensor([len(p) for p in prompts], dtype=torch.long),
        "greedy": torch.tensor([greedy for _, _, greedy in seqs], dtype=torch.bool),
    }
    _save(tensors, path)  # then its answers: a stop between the two is mended from the shard (rebuild_features),
    _save_answers(tensors, path)  # where answers alone would have their taps recomputed, not bit for bit the same


_REMEDY = {"feature shard": "remove it: its taps are rebuilt from its answers file",
           "answers file": "remove it and its feature shard, and train_drafter.py with this cache as --data (and "
                           "the flags that made it) answers the shard again"}


def _corrupt(path: Path, what: str, e: Exception) -> BeamtrtError:
    """One line for a file safetensors cannot read, with what to do about it."""
    remedy = f"; {_REMEDY[what]}" if what in _REMEDY else ""
    if path.is_dir():  # safetensors' own reason would be 'No such device'
        return BeamtrtError(f"{path}: a directory, not a {what}{remedy}")
    return BeamtrtError(f"{path}: corrupt {what} ({' '.join(str(e).split())}){remedy}")


def _read(path: Path, what: str) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except Exception as e:  # safetensors raises several types for a truncated or corrupt file
        raise _corrupt(path, what, e) from None


def check_cache(target: BeamForCausalLM, taps: Sequence[int], data: Path, digest: str | None = None) -> str | None:
    """`data` is a cache of this target's answers for these taps, its files readable (headers only): what a run trains
    on is checked before its phase 1. Returns the target digest it records (None: an older cache). digest: as for
    rebuild_features."""
    meta = read_meta(data)
    for path in sorted(data.glob("answers-*.safetensors")) + sorted(data.glob("features-*.safetensors")):
        _check_header(path, "answers file" if path.name.startswith("answers-") else "feature shard")
    recorded = cache_target(data, meta)
    if recorded is not None:
        check_target(data, meta, digest or target_digest(target))
    if meta.get("taps", list(taps)) != list(taps):
        raise BeamtrtError(f"{data}: answers made for target layers {meta.get('taps')}, the drafter taps {list(taps)}")
    if meta.get("hidden_size", target.cfg.hidden_size) != target.cfg.hidden_size:
        raise BeamtrtError(f"{data}: a cache of a target with hidden size {meta['hidden_size']}, this target's is "
                           f"{target.cfg.hidden_size}")
    return recorded


def rebuild_features(target: BeamForCausalLM, taps: Sequence[int], data: Path, quiet: bool = False,
                     digest: str | None = None) -> None:
    """Give every answers file in `data` without a feature shard its taps (one teacher-forced forward per sequence,
    8 sequences at a time), and every feature shard without an answers file its answers file. digest: the
    target's `target_digest` (computed when the cache records one and it is not given)."""
    from tqdm import tqdm

    recorded = check_cache(target, taps, data, digest)
    lone = [f for f in sorted(data.glob("features-*.safetensors")) if not _answers_path(f).exists()]
    missing = [(a, a.with_name(a.name.replace("answers-", "features-", 1)))
               for a in sorted(data.glob("answers-*.safetensors"))]
    missing = [(a, f) for a, f in missing if not f.exists()]
    if lone or missing:
        _check_writable(data)
    for features in lone:
        _save_answers(_read(features, "feature shard"), features)
    if not missing:
        return
    shards = [(features, read_sequences(answers, "answers file", target.cfg.vocab_size))
              for answers, features in missing]
    if recorded is None:  # an older cache: from now on its taps are this target's
        write_json(data / TAPS_TARGET, {"target": digest or target_digest(target)})
    bar = tqdm(total=sum(len(s["prompt_len"]) for _, s in shards), desc=f"taps from answers ({data.name})",
               unit="seq", disable=quiet, dynamic_ncols=True)
    for features, shard in shards:
        start = shard["seq_start"].tolist()
        seqs = [shard["ids"][a:b].long() for a, b in zip(start[:-1], start[1:])]
        _save({"ids": shard["ids"].long(), "taps": torch.cat(sequence_taps(target, taps, seqs, bar=bar)).cpu(),
               "seq_start": shard["seq_start"], "prompt_len": shard["prompt_len"], "greedy": shard["greedy"]},
              features)
    bar.close()


def sequence_taps(target: BeamForCausalLM, taps: Sequence[int], seqs: Sequence[torch.Tensor], rows: int = 8,
                  bar=None) -> list[torch.Tensor]:
    """Each sequence's taps [T_i, F] in bf16, from one teacher-forced forward through the last tapped layer, `rows`
    sequences at a time (similar lengths together: little padding); `bar` counts the sequences done."""
    order = sorted(range(len(seqs)), key=lambda k: len(seqs[k]))
    feats: dict[int, torch.Tensor] = {}
    for g in range(0, len(order), rows):
        group = order[g:g + rows]
        ids, num = right_padded([seqs[k].tolist() for k in group], target.device)
        cache = target.new_cache(len(group), ids.shape[1])
        out = torch.cat(target(ids, cache, num_tokens=num, taps=taps, taps_only=True).taps, dim=-1)  # [rows, T, F]
        for j, k in enumerate(group):
            feats[k] = out[j, :len(seqs[k])].to(torch.bfloat16)
        if bar is not None:
            bar.update(len(group))
    return [feats[k] for k in range(len(seqs))]


def read_answers(data: Path, vocab_size: int | None = None) -> FeatureSet:
    """A cache's sequences without their taps (`taps` is [T, 0]), from its answers files and the feature shards that
    have none: for a tool that computes the taps of the few it needs (`with_taps`) instead of the whole cache's."""
    parts = []
    for path, what in sequence_files(data):
        t = read_sequences(path, what, vocab_size)
        ids = t["ids"].long()
        parts.append(FeatureSet(ids, torch.empty(ids.shape[0], 0, dtype=torch.bfloat16), t["seq_start"],
                                t["prompt_len"], t["greedy"]))
    return concat_features(parts)


def with_taps(target: BeamForCausalLM, taps: Sequence[int], part: FeatureSet, quiet: bool = False) -> FeatureSet:
    """`part` with its sequences' taps computed by `target` (`sequence_taps`), in memory."""
    from tqdm import tqdm

    seqs = [part.sequence(i)[0] for i in range(len(part))]
    with tqdm(total=len(seqs), desc="taps", unit="seq", disable=quiet or None, dynamic_ncols=True) as bar:
        feats = sequence_taps(target, taps, seqs, bar=bar)
    return FeatureSet(part.ids, torch.cat(feats).cpu(), part.seq_start, part.prompt_len, part.greedy)


def load_features(*dirs: Path, digest: str | None = None, vocab_size: int | None = None) -> FeatureSet:
    """Read every shard of one or more feature caches (in the order given) into one FeatureSet; with a target's
    digest and vocabulary size, caches of another target are refused. The caches' taps must be alike: as their
    meta.json records them (a cache made before meta.json, which check_cache accepts, records none) and as wide."""
    parts, recorded, first = [], {}, None  # recorded: meta.json key -> (the first cache with it, its value)
    for data in dirs:
        paths = sorted(data.glob("features-*.safetensors"))
        if not paths:
            raise BeamtrtError(f"{data}: no feature shards (features-*.safetensors)")
        meta = read_meta(data)
        check_target(data, meta, digest)
        for key, what in (("taps", "features of target layers"), ("hidden_size", "a target hidden size of")):
            if key in meta:
                had, value = recorded.setdefault(key, (data, meta[key]))
                if meta[key] != value:
                    raise BeamtrtError(f"{data}: {what} {meta[key]}, {had} has {value}")
        for path in paths:
            part = _shard(path, meta, vocab_size)
            first = first or (path, part.taps.shape[1])  # (the first shard, its taps' width)
            if part.taps.shape[1] != first[1]:
                raise BeamtrtError(f"{path}: taps {part.taps.shape[1]} wide, {first[0]}'s {first[1]} (features of "
                                   "other target layers)")
            parts.append(part)
    return concat_features(parts)


def read_sequences(path: Path, what: str, vocab_size: int | None = None) -> dict[str, torch.Tensor]:
    """A feature shard's or answers file's tensors, its sequences checked: ids, seq_start, prompt_len and greedy
    fit together, and every id is a token of the vocabulary (where its size is given)."""
    t = _read(path, what)
    missing = [k for k in ("ids", "seq_start", "prompt_len", "greedy") if k not in t]
    if missing:
        raise BeamtrtError(f"{path}: corrupt {what} (no {missing[0]!r} tensor)")
    ids, start, plen, greedy = t["ids"], t["seq_start"], t["prompt_len"], t["greedy"]
    n = plen.shape[0] if plen.dim() == 1 else -1
    ok = (ids.dim() == 1 and n >= 0 and greedy.shape == (n,) and start.shape == (n + 1,)
          and not any(x.is_floating_point() for x in (ids, start, plen)) and int(start[0]) == 0
          and int(start[-1]) == ids.shape[0] and bool((plen >= 0).all()) and bool((start.diff() >= plen).all()))
    if not ok:
        raise BeamtrtError(f"{path}: corrupt {what} (ids {tuple(ids.shape)}, seq_start {tuple(start.shape)}, "
                           f"prompt_len {tuple(plen.shape)}, greedy {tuple(greedy.shape)} do not fit together)")
    if ids.numel() and (int(ids.min()) < 0 or (vocab_size is not None and int(ids.max()) >= vocab_size)):
        raise BeamtrtError(f"{path}: token ids {int(ids.min())}..{int(ids.max())} are outside the target's "
                           f"vocabulary of {vocab_size}: a cache of another target?")
    return t


def _shard(path: Path, meta: dict, vocab_size: int | None = None) -> FeatureSet:
    """One feature shard, its sequences checked (read_sequences) and its taps against them (finite; the cache's tap
    width where known)."""
    t = read_sequences(path, "feature shard", vocab_size)
    if "taps" not in t:
        raise BeamtrtError(f"{path}: corrupt feature shard (no 'taps' tensor)")
    ids, taps = t["ids"], t["taps"]
    width = len(meta["taps"]) * meta["hidden_size"] if meta.get("taps") and meta.get("hidden_size") else None
    if not (taps.dim() == 2 and taps.shape[0] == ids.shape[0] and width in (None, taps.shape[1])):
        raise BeamtrtError(f"{path}: corrupt feature shard (ids {tuple(ids.shape)}, taps {tuple(taps.shape)} do not "
                           "fit together)")
    if not bool(torch.isfinite(taps).all()):
        raise BeamtrtError(f"{path}: corrupt feature shard (its taps hold NaN or inf values)")
    return FeatureSet(ids, taps, t["seq_start"], t["prompt_len"], t["greedy"])

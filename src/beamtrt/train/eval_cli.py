"""Command line of scripts/eval_drafter.py: a drafter's decoded τ on feature caches' greedy answers, by prompt kind."""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import torch

from beamtrt.checkpoint.hf import require_dir, resolved, write_json
from beamtrt.cli_util import ArgumentParser, output_path, outside_inputs, run_cli, set_threads, torch_device
from beamtrt.errors import BeamtrtError
from beamtrt.prompts import load_tokenizer


def last_greedy(kinds: list[str], greedy: torch.Tensor, per_kind: int) -> dict[str, list[int]]:
    """kind -> indices of its last `per_kind` greedy sequences (kinds[i]: the prompt kind of sequence i)."""
    groups: dict[str, list[int]] = {}
    for i, kind in enumerate(kinds):
        if bool(greedy[i]):
            groups.setdefault(kind, []).append(i)
    return {kind: groups[kind][-per_kind:] for kind in sorted(groups)}


def evaluate_by_kind(drafter, data, kinds: list[str], per_kind: int, block: int) -> dict[str, dict]:
    """kinds[i]: the prompt kind of sequence i. Scores the last `per_kind` greedy answers of every kind (and all of
    them together) with the training eval (trainer.evaluate: the decoder's walk at `block`, drafting from the
    drafter's draft vocabulary when it has one): `tau` / `tau_top1` as run.py's acceptance length (the mean over
    answers), beside the training eval's ratios (`eval_tau`: tokens / steps of all of them, long answers weighing
    more)."""
    from tqdm import tqdm

    from beamtrt.train.trainer import TrainConfig, eval_ratios, eval_sums

    cfg = TrainConfig(eval_block_size=block, block_size=max(block, TrainConfig().block_size))
    groups = last_greedy(kinds, data.greedy, per_kind)
    answers: dict[str, list[dict[str, float]]] = {}  # kind -> eval_sums of each of its answers
    with tqdm(total=sum(map(len, groups.values())), desc="scoring", unit="answer", disable=None,
              dynamic_ncols=True) as bar:
        for kind, group in groups.items():  # a bar step per answer: once per kind, it stood for minutes
            answers[kind] = []
            for i in group:
                answers[kind].append(eval_sums(drafter, data, [i], cfg))
                bar.update()
    if answers:  # all kinds together without scoring them twice
        answers["all"] = [a for group in answers.values() for a in group]
    return {kind: {"scored": len(group)} | _mean_tau(group) | eval_ratios(_added(group))
            for kind, group in answers.items()}


def _mean_tau(answers: list[dict[str, float]]) -> dict[str, float]:
    """eval_sums of each answer -> the decoder's τ over them (run.py's acceptance length: the mean over answers of
    each one's tokens / steps, answers without a step left out), greedy walk and top-1; {} where none has a step."""
    walked = [a for a in answers if a["steps"]]
    if not walked:
        return {}
    return {name: round(sum(a["tokens"] / a[steps] for a in walked) / len(walked), 4)
            for name, steps in (("tau", "steps"), ("tau_top1", "steps_top1"))}


def _added(sums: list[dict[str, float]]) -> dict[str, float]:
    """eval_sums' counts of several sets of answers, added: those of their union."""
    return {key: sum(s[key] for s in sums) for key in sums[0]}


def trained_recipes(drafter_dir: Path) -> list[dict]:
    """The recipes of the caches a drafter's training.json names (train_drafter.py's record: its --data's recipe, and
    those of its --extra-data caches found from here). A record that cannot be read names none: it warns only."""
    from beamtrt.train.features import read_meta

    recipes = []
    try:
        record = json.loads((drafter_dir / "training.json").read_text())
        recipes.append(record.get("data"))
        for extra in record.get("extra_data") or []:
            recipes.append(read_meta(Path(extra)).get("recipe"))
    except (OSError, ValueError, TypeError, AttributeError, BeamtrtError):
        pass
    return [r for r in recipes if isinstance(r, dict)]


def _meta(data_dir: Path) -> dict:
    """A feature cache's meta.json, which must hold its recipe (the prompts are regenerated from it)."""
    from beamtrt.train.features import read_meta

    meta = read_meta(data_dir)
    if not {"prompts", "seed"} <= set(meta.get("recipe") or {}):
        raise BeamtrtError(f"{data_dir}: no readable meta.json with the cache's recipe")
    return meta


def cache_kinds(data_dir: Path, tokenizer, data) -> list[str]:
    """The prompt kind of every sequence of the cache in data_dir (loaded as `data`), found by regenerating its
    prompts from meta.json's recipe and matching their chat-template ids; "other" where none matches."""
    from beamtrt.train.features import chat_ids
    from beamtrt.train.prompts import MIXES, tagged_prompts

    recipe = _meta(data_dir)["recipe"]
    mix = recipe.get("mix", "v1")  # caches made before mixes had names used the first one
    if mix not in MIXES:
        raise BeamtrtError(f"{data_dir}: made with prompt mix {mix!r}, which this version does not know")
    kind_of = {tuple(chat_ids(tokenizer, prompt)): kind
               for prompt, kind in tagged_prompts(recipe["prompts"], recipe["seed"], mix)}
    return [kind_of.get(data.prompt(i), "other") for i in range(len(data))]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(
        description="Score a drafter on feature caches made by scripts/train_drafter.py: the acceptance length "
                    "speculative decoding would reach on their greedy answers (the training eval), by prompt kind. "
                    "Use caches the drafter was not trained on. Their answers files are enough: the target's taps "
                    "of the answers scored are computed in memory, and the caches are only read.")
    p.add_argument("--data", nargs="+", required=True, metavar="DIR",
                   help="feature caches (the --data directories of train_drafter.py)")
    p.add_argument("--drafter", default=None,
                   help="drafter checkpoint (default: checkpoints/<target name>-dflash2, the committed drafter for "
                        "beam-mini)")
    p.add_argument("--target", default=None, help="target checkpoint (default: beam-mini, made if missing)")
    p.add_argument("--per-kind", type=int, default=32,
                   help="greedy answers scored per kind, the last of each, the caches taken in the order of their "
                        "paths (default: %(default)s)")
    p.add_argument("--block-size", type=int, default=8,
                   help="draft block, from 2 up to the drafter's own block size (default: %(default)s)")
    p.add_argument("--device", default="cpu", help="torch device of the target and drafter, e.g. cpu or cuda "
                                                   "(default: %(default)s)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads; 0 = torch's default (default: %(default)s)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the table as JSON")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def run() -> None:
        from beamtrt.config import BeamConfig, check_block_size
        from beamtrt.models.beam import load_beam
        from beamtrt.models.beam_mini import CHECKPOINTS, ensure_beam_mini
        from beamtrt.models.dflash2 import drafter_config_for, load_drafter
        from beamtrt.train.features import check_cache, concat_features, read_answers, target_digest, with_taps

        if args.per_kind < 1:
            raise ValueError(f"--per-kind must be >= 1, got {args.per_kind}")
        check_block_size(args.block_size)
        device = torch_device(args.device)
        set_threads(args.threads)
        if args.json:
            output_path(args.json, "--json")
        for d in args.data:
            require_dir(d, "a feature cache directory", "--data")
        if len({resolved(d) for d in args.data}) < len(args.data):
            raise BeamtrtError("--data names the same cache twice (its answers would be counted twice)")
        target_dir = Path(args.target) if args.target else ensure_beam_mini()
        drafter_dir = Path(args.drafter) if args.drafter else CHECKPOINTS / f"{resolved(target_dir).name}-dflash2"
        for what, d in (("target", target_dir), ("drafter", drafter_dir)):
            if not (d / "config.json").is_file():
                default = " (the default for the target's name: pass --drafter DIR)" if (
                    what == "drafter" and not args.drafter) else ""
                raise BeamtrtError(f"{what} {d}: not a checkpoint directory (no config.json){default}")
        if args.json:
            outside_inputs(args.json, "--json", [("the target", target_dir), ("the drafter", drafter_dir),
                                                 *(("--data", d) for d in args.data)])
        tcfg = BeamConfig.from_file(target_dir / "config.json")  # a target of another family: said first
        tokenizer = load_tokenizer(target_dir)  # the answers are scored as text: before any weight loads
        dcfg = drafter_config_for(drafter_dir, tcfg)  # so is this
        if args.block_size > dcfg.block_size:
            raise ValueError(f"--block-size {args.block_size} is above the drafter's ({dcfg.block_size})")
        taps = list(dcfg.target_layer_ids)
        trained = trained_recipes(drafter_dir)
        for d in map(Path, args.data):
            meta = _meta(d)
            if meta.get("taps") != taps:
                raise BeamtrtError(f"{d}: features of target layers {meta.get('taps')}, the drafter reads {taps}")
            if meta["recipe"] in trained:  # scored all the same: a user may want its fit on what it saw
                print(f"warning: {d}: the drafter trained on this cache (its recipe is one its training.json names): "
                      "its acceptance here is no held-out score", file=sys.stderr, flush=True)
        target = load_beam(target_dir, dtype=torch.float32, device=device).requires_grad_(False)
        drafter = load_drafter(drafter_dir, target, dtype=torch.float32).eval()
        parts, kinds = [], []
        digest = target_digest(target)
        for d in sorted(map(Path, args.data), key=resolved):  # "the last of each kind": the same whatever the order
            check_cache(target, taps, d, digest)
            parts.append(read_answers(d, target.cfg.vocab_size))  # the answers alone: taps for those scored, later
            kinds += cache_kinds(d, tokenizer, parts[-1])
        every = concat_features(parts)
        answers = Counter(kind for kind, greedy in zip(kinds, every.greedy.tolist()) if greedy)
        keep = sorted(i for group in last_greedy(kinds, every.greedy, args.per_kind).values() for i in group)
        if not keep:
            raise BeamtrtError("the caches hold no greedy answer to score")
        scored = with_taps(target, taps, every.select(keep))  # in memory: the caches are only read
        rows = evaluate_by_kind(drafter, scored, [kinds[i] for i in keep], args.per_kind, args.block_size)
        answers["all"] = sum(answers.values())
        rows = {kind: {"answers": answers[kind]} | r for kind, r in rows.items()}
        top_k = dcfg.selector_top_k  # the selector's candidates per slot (at most the vocabulary: DrafterConfig)
        columns = {"τ decoded": "tau", "τ top-1": "tau_top1", "τ pooled": "eval_tau",
                   "every-anchor mean": "eval_tau_every_anchor", f"top-{top_k} recall": "eval_recall"}
        print("| kind | greedy answers | scored | " + " | ".join(columns) + " |\n|---|---|---|"
              + "---|" * len(columns))
        for kind, r in rows.items():
            print(f"| {kind} | {r['answers']} | {r['scored']} | "
                  + " | ".join(f"{r.get(key, float('nan')):.2f}" for key in columns.values()) + " |")
        if args.json:
            write_json(args.json, {"drafter": str(drafter_dir), "target": str(target_dir), "data": args.data,
                                   "block_size": args.block_size, "per_kind": args.per_kind, "kinds": rows})
        print(f"drafter {drafter_dir} on {len(args.data)} cache(s) at block {args.block_size}", file=sys.stderr)

    return run_cli(run)

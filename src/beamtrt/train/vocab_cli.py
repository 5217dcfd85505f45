"""Write a drafter's draft_vocab.json: the tokens of the training sequences it was trained on (a `--head-vocab seen`
run scores exactly these), from the answer caches named, held-out answers excluded as the trainer excludes them.

    python scripts/draft_vocab.py DRAFTER --data CACHE ... LAST_CACHE

New runs of scripts/train_drafter.py store it themselves; this is for drafters trained before they did.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from beamtrt.checkpoint.hf import require_dir, resolved
from beamtrt.cli_util import ArgumentParser, description, run_cli
from beamtrt.errors import BeamtrtError


def training_tokens(dirs: list[Path], eval_sequences: int) -> torch.Tensor:
    """Sorted distinct token ids of the sequences the trainer trains on, over the caches in training order (--data
    last): their answers files (committed) or feature shards."""
    from beamtrt.train.features import FeatureSet, concat_features, read_sequences, sequence_files
    from beamtrt.train.trainer import TrainConfig, split

    parts = []
    for d in dirs:
        for path, what in sequence_files(d, f"--data {d}"):
            t = read_sequences(path, what)
            parts.append(FeatureSet(ids=t["ids"], taps=torch.empty(t["ids"].shape[0], 0), seq_start=t["seq_start"],
                                    prompt_len=t["prompt_len"], greedy=t["greedy"]))
    data = concat_features(parts)
    train, _ = split(data, TrainConfig(eval_sequences=eval_sequences))
    return torch.cat([data.sequence(i)[0] for i in train]).unique()


def check_caches_target(dirs: list[Path], target: str | None) -> None:
    """Caches that record the target they were made by (a digest of its weights) must be the drafter's target's; the
    target (default beam-mini) is loaded only when one does."""
    from beamtrt.train.features import cache_target, check_target, read_meta, target_digest

    metas = [(d, read_meta(d)) for d in dirs]
    if not any(cache_target(d, meta) for d, meta in metas):
        return
    from beamtrt.models.beam import load_beam
    from beamtrt.models.beam_mini import ensure_beam_mini

    digest = target_digest(load_beam(Path(target) if target else ensure_beam_mini(), dtype=torch.float32))
    for d, meta in metas:
        check_target(d, meta, digest)


def replaced(drafter: Path, cfg) -> str:
    """What the draft vocabulary about to be overwritten held, for the closing line ('' when there was none)."""
    from beamtrt.models.dflash2 import read_draft_vocab

    try:
        ids = read_draft_vocab(drafter, cfg)
    except BeamtrtError:
        return " (replaced an unreadable one)"
    return "" if ids is None else f" (replaced one of {ids.numel()} tokens)"


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(description=description(__doc__))
    p.add_argument("drafter", help="the drafter checkpoint directory to write draft_vocab.json into")
    p.add_argument("--data", nargs="+", required=True,
                   help="its training caches in the order it was trained on them: --extra-data ..., then --data")
    p.add_argument("--eval-sequences", type=int, default=32,
                   help="the held-out greedy answers at the end of the last cache (train_drafter's; default 32)")
    p.add_argument("--target", help="the target the drafter was trained for, loaded only to check caches that record "
                   "their target against it (default: beam-mini)")
    p.add_argument("--force", action="store_true", help="replace a draft_vocab.json the drafter holds already")
    args = p.parse_args(argv)

    def run() -> None:
        from beamtrt.config import DrafterConfig
        from beamtrt.models.dflash2 import DRAFT_VOCAB_FILE, check_draft_vocab, write_draft_vocab
        from beamtrt.train.eval_cli import trained_recipes

        if args.eval_sequences < 0:
            raise ValueError(f"--eval-sequences must be >= 0, got {args.eval_sequences}")
        dirs = [require_dir(d, "an answers or feature cache directory", "--data") for d in args.data]
        if len({resolved(d) for d in dirs}) < len(dirs):  # as train_drafter.py refuses it
            raise BeamtrtError("--data names the same cache twice (its held-out answers would count as trained on)")
        if args.target:  # read only when a cache records its target: a wrong path is said whether or not
            require_dir(args.target, "the target checkpoint directory", "--target")
        drafter = Path(args.drafter)
        cfg = DrafterConfig.from_file(drafter / "config.json")
        if (drafter / DRAFT_VOCAB_FILE).exists() and not args.force:
            raise BeamtrtError(f"{drafter}: holds a {DRAFT_VOCAB_FILE} already; pass --force to replace it")
        check_caches_target(dirs, args.target)
        tokens = training_tokens(dirs, args.eval_sequences)
        if tokens.numel() and int(tokens.max()) >= cfg.vocab_size:
            raise BeamtrtError(f"--data holds token id {int(tokens.max())}, beyond the drafter's vocabulary of "
                               f"{cfg.vocab_size}: the caches are another target's answers")
        ids = check_draft_vocab(tokens, cfg.vocab_size, cfg.selector_top_k)
        trained = trained_recipes(drafter)  # those found from here
        if other := [str(d) for d in dirs if trained and _recipe(d) not in trained]:
            print(f"warning: {drafter} did not train on --data {other[0]} (no recipe its training.json names): the "
                  "draft vocabulary is then not the tokens it learnt", file=sys.stderr)
        was = replaced(drafter, cfg)
        write_draft_vocab(drafter, ids)
        print(f"{drafter / DRAFT_VOCAB_FILE}: {ids.numel()} of {cfg.vocab_size} tokens{was}")

    return run_cli(run)


def _recipe(data: Path) -> dict | None:
    from beamtrt.train.features import read_meta

    try:
        return read_meta(data).get("recipe")
    except (BeamtrtError, AttributeError):  # no meta.json (a cache of committed answers files keeps one), or damaged
        return None

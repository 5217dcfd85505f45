"""Command line of scripts/train_drafter.py: target answers with taps, then DFlash 2 training; both resumable."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

from beamtrt.checkpoint.hf import recover_output, require_dir, resolved, write_json, writing
from beamtrt.cli_util import ArgumentParser, check_seed, output_path, run_cli, set_threads, torch_device
from beamtrt.errors import BeamtrtError


def init_drafter(cfg, target, seed: int):
    """fp32 drafter initialized per the recipe (dflash.md §3.4): linears N(0, 0.02), identity convs (projection 0),
    predecessor codebook N(0, 0.02), successor codebook 0 — so it starts as an exact DFlash v1."""
    from beamtrt.models.dflash2 import random_drafter

    drafter = random_drafter(cfg, target, seed=seed, dtype=torch.float32, conv_std=0.0)
    with torch.no_grad():
        drafter.candidate_selector.successor_codebook.zero_()
    return drafter


def start_from(path: Path, cfg, target, seed: int = 0):
    """fp32 trainable copy of an existing drafter (--init) whose layout is `cfg`, or `cfg` with fewer layers: then
    the drafter grows to cfg's depth by new last layers that start as the identity (recipe initialization with
    their output projections zeroed), so at step 0 it drafts exactly as the checkpoint does."""
    from beamtrt.models.dflash2 import load_drafter

    check_init(path, cfg, target.cfg)
    drafter = load_drafter(path, target, dtype=torch.float32)
    if drafter.cfg == cfg:
        return drafter.requires_grad_(True)
    grown = init_drafter(cfg, target, seed)
    grown.set_draft_vocab(drafter.draft_vocab)
    params = dict(grown.named_parameters())
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            params[name].copy_(p)
        for layer in grown.layers[drafter.cfg.num_hidden_layers:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down.weight.zero_()
    return grown.requires_grad_(True)


def check_init(path: Path, cfg, target_cfg):
    """--init names a drafter of this target whose layout is `cfg` or `cfg` with fewer layers (whatever block it was
    trained at): checked from its config.json before phase 1 (which may take hours), one line naming --init. Returns
    its config."""
    from beamtrt.errors import CheckpointError, ConfigError
    from beamtrt.models.dflash2 import drafter_config_for

    try:
        have = drafter_config_for(path, target_cfg)  # not a drafter, or another target's: its config.json says so
    except (ConfigError, CheckpointError) as e:
        raise BeamtrtError(f"--init {e}") from None
    diff = [f.name for f in dataclasses.fields(cfg)
            if f.name != "block_size" and getattr(cfg, f.name) != getattr(have, f.name)]
    fixed = [name for name in diff if name not in ("num_hidden_layers", "selector_rank")]  # no flag changes these
    if fixed:
        raise BeamtrtError(f"--init {path}: a drafter of another target or recipe ({', '.join(fixed)} differ from "
                           "what this target's drafter has)")
    if diff and (diff != ["num_hidden_layers"] or have.num_hidden_layers > cfg.num_hidden_layers):
        raise BeamtrtError(f"--init {path}: its layout differs from the one to train ({', '.join(diff)}); pass the "
                           "matching --selector-rank, and --layers at least its depth")
    return have


def replays_init_batches(init: Path, seed: int, sequences: int, tokens: int) -> bool:
    """Whether the --init drafter was trained with this --seed on data of this size (its training.json): every
    random draw of step s comes from (seed, s), so its first steps would be trained again on the same blocks."""
    try:
        done = json.loads((init / "training.json").read_text())
        return (done["train"]["seed"], done["data_sequences"], done["data_tokens"]) == (seed, sequences, tokens)
    except (OSError, ValueError, KeyError, TypeError):
        return False


def check_out(out: Path, force: bool, inputs: list[tuple[str, Path]], init: Path | None = None) -> None:
    """The drafter output (checked before hours of work, and again before it is written): not one of the inputs or
    the training state, nor inside or around one (--init may be --out itself: it is read before --out is written),
    and replaced only when it holds a drafter and --force says so."""
    from beamtrt.checkpoint.hf import holds
    from beamtrt.config import DrafterConfig

    for flag, d in inputs + ([("--init", init)] if init else []):
        around, inside = holds(d, out), holds(out, d)
        if (around or inside) and not (flag == "--init" and around and inside):  # --init may be --out itself
            raise BeamtrtError(f"--out {out}: overlaps {flag} {d} (the drafter replaces --out whole); choose another "
                               "--out")
    if not out.is_dir() or not any(out.iterdir()):
        return
    try:
        DrafterConfig.from_file(out / "config.json")
    except Exception:
        raise BeamtrtError(f"--out {out}: exists and does not hold a drafter checkpoint; choose another "
                           "--out") from None
    if not force:
        raise BeamtrtError(f"--out {out}: holds a drafter already; pass --force to replace it (every file in it), or "
                           "choose another --out")


def check_folders(writes: list[tuple[str, Path]], reads: list[tuple[str, Path]]) -> None:
    """The folders a run writes (--data, --work) are none of the others, nor inside or around one, and hold no
    checkpoint (a config.json: a target or drafter given by mistake): one line before any work."""
    from beamtrt.checkpoint.hf import holds

    for i, (flag, d) in enumerate(writes):
        for other, o in writes[i + 1:] + reads:
            if holds(d, o) or holds(o, d):
                raise BeamtrtError(f"{flag} {d}: overlaps {other} {o}; give {flag} a folder of its own")
        if (d / "config.json").is_file():
            what = "a feature cache" if flag == "--data" else "a training state"
            raise BeamtrtError(f"{flag} {d}: holds a checkpoint (config.json), not {what}; give {flag} a folder of "
                               "its own")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from beamtrt.train.features import MAX_PROMPTS, DataRecipe
    from beamtrt.train.prompts import MIXES
    from beamtrt.train.trainer import HEAD_VOCABS, TrainConfig

    d, t = DataRecipe(), TrainConfig()
    p = ArgumentParser(
        description="Train a DFlash 2 drafter for a Beam-architecture target. Phase 1 has the target answer a mix "
                    "of training prompts (math, code, general; no benchmark set) and caches its tapped hidden "
                    "states; phase 2 trains the drafter on them. Both phases resume where an interrupted run "
                    "stopped. The result is a drafter checkpoint directory that runtime/run.py and "
                    "build/build_engines.py accept as --drafter.")
    io = p.add_argument_group("paths")
    io.add_argument("--target", help="target checkpoint (default: beam-mini, created if missing)")
    io.add_argument("--data", help="feature cache directory (default: checkpoints/<target>-dflash2-data)")
    io.add_argument("--work", help="training state directory, for resuming "
                    "(default: checkpoints/<target>-dflash2-train)")
    io.add_argument("--out", help="trained drafter output, a new directory (default: "
                    "checkpoints/<target>-dflash2-trained; the committed beam-mini drafter is checkpoints/beam-mini-"
                    "dflash2)")
    io.add_argument("--force", action="store_true",
                    help="replace an --out that already holds a drafter (all of that directory)")
    io.add_argument("--init", metavar="DIR",
                    help="start from this drafter checkpoint instead of the recipe's initialization (continued "
                         "training, e.g. on more data; its layout must match --selector-rank; a --layers deeper "
                         "than its own grows it by identity-initialized last layers)")
    io.add_argument("--extra-data", nargs="+", default=[], metavar="DIR",
                    help="more feature caches (e.g. made earlier with another --data-seed and --data-only) to train "
                         "on, placed before --data's (whose last greedy answers stay the held-out set)")
    data = p.add_argument_group("phase 1: target answers")
    data.add_argument("--prompts", type=int, default=d.prompts,
                      help=f"training prompts to answer, at most {MAX_PROMPTS:,} (default: %(default)s)")
    data.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens,
                      help="answer length cap (default: %(default)s)")
    data.add_argument("--gen-batch", type=int, default=d.batch,
                      help=f"answers decoded together; above {d.shard_size} also the answers per shard file, "
                           "which a cache resumes with (default: %(default)s)")
    data.add_argument("--data-seed", type=int, default=d.seed,
                      help="seed of the prompt mix and sampling, in [0, 2**32) (default: %(default)s)")
    data.add_argument("--skip-answered-in", nargs="+", default=None, metavar="DIR",
                      help="leave out every prompt these feature caches already answered (e.g. the caches a new one "
                           "adds to: caches drawn from one mix with different seeds repeat many prompts); recorded in "
                           "--data's meta.json, so a cache resumes only with the same caches here (default: none)")
    data.add_argument("--prompt-mix", choices=tuple(MIXES), default=d.mix,
                      help="training prompt mix: v1 = math, code, general (the first caches); v2 adds code stubs, "
                           "chat, passages and the evaluation wrappers; v3 shifts toward longer word problems, "
                           "MATH-like algebra and chat; v4 is over half open-ended writing and role-play "
                           "(default: %(default)s)")
    tr = p.add_argument_group("phase 2: training")
    tr.add_argument("--steps", type=int, default=t.steps, help="optimizer steps (default: %(default)s)")
    tr.add_argument("--seqs-per-step", type=int, default=t.seqs_per_step,
                    help="sequences per step (default: %(default)s)")
    tr.add_argument("--anchors", type=int, default=t.anchors_per_seq, help="blocks per sequence (default: %(default)s)")
    tr.add_argument("--block-size", type=int, default=t.block_size,
                    help="training block size; the drafter's config.json records the largest block it trained at "
                         "(with --init, the larger of this and that drafter's), the most it drafts (default: "
                         "%(default)s)")
    tr.add_argument("--eval-block-size", type=int, default=t.eval_block_size,
                    help="serving block size the eval measures (default: %(default)s)")
    tr.add_argument("--lr", type=float, default=t.lr, help="peak AdamW learning rate (default: %(default)s)")
    tr.add_argument("--gamma", type=float, default=t.gamma,
                    help="loss decay exp(-(k-1)/gamma), at least 0.01 (default: %(default)s)")
    tr.add_argument("--selector-weight", type=float, default=t.selector_weight,
                    help="weight of the selector loss (default: %(default)s)")
    tr.add_argument("--head-vocab", choices=HEAD_VOCABS, default=t.head_vocab,
                    help="LM head rows the training loss scores: full = the whole vocabulary (the recipe); seen = only "
                         "the tokens in the training data (about 4x less head work on beam-mini, so ~2.5x faster "
                         "steps; unseen tokens are no longer pushed down, so the drafter drafts from the seen ones "
                         "alone, in the eval too, and is saved with them as its draft_vocab.json) (default: "
                         "%(default)s)")
    tr.add_argument("--distill", type=float, default=t.distill,
                    help="weight of a distillation term: each slot also learns the target's whole next-token "
                         "distribution there (KL divergence, rebuilt from the cached taps through the target's "
                         "layers after the last tapped one; steps take about 1.4x as long on beam-mini); 0 = the "
                         "recipe's loss alone (default: %(default)s)")
    tr.add_argument("--seed", type=int, default=t.seed,
                    help="seed of initialization and draws, in [0, 2**32) (default: %(default)s)")
    tr.add_argument("--eval-every", type=int, default=t.eval_every,
                    help="held-out eval period in steps (default: %(default)s)")
    tr.add_argument("--checkpoint-every", type=int, default=t.checkpoint_every,
                    help="training-state save period in steps (default: %(default)s)")
    tr.add_argument("--layers", type=int, default=2, help="draft layers, at most 64 (default: %(default)s)")
    tr.add_argument("--selector-rank", type=int, default=32, help="selector codebook rank (default: %(default)s)")
    p.add_argument("--data-only", action="store_true",
                   help="stop after phase 1 (generate or complete --data): --work and --out are not used, and phase "
                        "2's flags are checked but not used, so a training command with --data-only added makes its "
                        "cache first")
    p.add_argument("--device", default="cpu",
                   help="torch device of both phases, e.g. cpu or cuda: the feature cache stays in host memory and "
                        "each step's sequences move to the device (default: %(default)s)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads; 0 = torch's default (default: %(default)s)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def run() -> None:
        with contextlib.ExitStack() as held:  # the folders the command locks (beamtrt.checkpoint.hf.writing)
            command(held)

    def command(held: contextlib.ExitStack) -> None:
        from beamtrt.config import BeamConfig, check_block_size
        from beamtrt.models.beam import load_beam
        from beamtrt.models.beam_mini import CHECKPOINTS, drafter_layout, ensure_beam_mini
        from beamtrt.models.dflash2 import save_drafter
        from beamtrt.prompts import TOKENIZER_FILES, has_tokenizer, load_tokenizer
        from beamtrt.train.features import (MAX_PROMPTS, DataRecipe, answered_prompts, build_features, check_cache,
                                            concat_features, load_features, read_answers, rebuild_features,
                                            sequence_files, target_digest)
        from beamtrt.train.prompts import training_prompts
        from beamtrt.train.trainer import TrainConfig, check_data, check_state, fingerprint, split, train, write_log

        device = torch_device(args.device)
        set_threads(args.threads)
        for name in ("prompts", "gen_batch", "layers", "selector_rank"):
            if getattr(args, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
        if args.max_new_tokens < 2:  # a block's anchor is an answer token, and it drafts the next one
            raise ValueError(f"--max-new-tokens must be >= 2 (training anchors blocks on answer tokens and drafts "
                             f"the ones after them), got {args.max_new_tokens}")
        for name, most in (("prompts", MAX_PROMPTS), ("layers", 64)):  # beyond: minutes of silent work, then memory
            if getattr(args, name) > most:
                raise ValueError(f"--{name} must be at most {most:,}, got {getattr(args, name)}")
        check_seed(args.seed, bits=32)  # each step's and answer's generator is seeded by seed * 1,000,003 + its number
        check_seed(args.data_seed, "--data-seed", bits=32)
        check_block_size(args.block_size)
        cfg = TrainConfig(steps=args.steps, seqs_per_step=args.seqs_per_step, anchors_per_seq=args.anchors,
                          block_size=args.block_size, eval_block_size=args.eval_block_size, lr=args.lr,
                          gamma=args.gamma, selector_weight=args.selector_weight, seed=args.seed,
                          eval_every=args.eval_every, checkpoint_every=args.checkpoint_every,
                          head_vocab=args.head_vocab, distill=args.distill,
                          init_from=str(resolved(args.init)) if args.init else "")
        recipe = DataRecipe(prompts=args.prompts, seed=args.data_seed, max_new_tokens=args.max_new_tokens,
                            batch=args.gen_batch, shard_size=max(args.gen_batch, DataRecipe().shard_size),
                            mix=args.prompt_mix)
        # a run with --out X stopped between its two renames left X aside: staging() puts it back, but only when X is
        # written, after --init X is read
        if args.init and not (Path(args.init) / "config.json").is_file() and not recover_output(Path(args.init)):
            raise BeamtrtError(f"--init {args.init}: not a drafter checkpoint (no config.json)")
        for flag, dirs in (("--extra-data", args.extra_data), ("--skip-answered-in", args.skip_answered_in or [])):
            for d in dirs:
                sequence_files(require_dir(d, "a feature cache directory", flag), f"{flag} {d}")
        target_dir = Path(args.target) if args.target else ensure_beam_mini()
        if not (target_dir / "config.json").is_file():
            raise BeamtrtError(f"--target {target_dir}: not a checkpoint directory (no config.json)")
        name = resolved(target_dir).name
        data_dir = Path(args.data) if args.data else CHECKPOINTS / f"{name}-dflash2-data"
        work = Path(args.work) if args.work else CHECKPOINTS / f"{name}-dflash2-train"
        out = Path(args.out) if args.out else CHECKPOINTS / f"{name}-dflash2-trained"
        outputs = (("--data", data_dir),) + (() if args.data_only else (("--work", work), ("--out", out)))
        for flag, d in outputs:  # before hours of work (--data-only writes neither --work nor --out)
            if flag != "--data" or not (d / "meta.json").is_file():  # a cache's missing shards: checked in phase 1
                output_path(d, flag, directory=True, replaced=flag == "--out")  # --work, --data: written into
        caches = [resolved(d) for d in (*map(Path, args.extra_data), data_dir)]
        if len(set(caches)) < len(caches):
            raise BeamtrtError("--extra-data and --data name the same cache twice (its held-out answers would be "
                               "trained on)")
        init = Path(args.init) if args.init else None
        extra = [("--extra-data", Path(d)) for d in args.extra_data]
        if any(resolved(d) == resolved(data_dir) for d in args.skip_answered_in or []):
            raise BeamtrtError(f"--skip-answered-in names --data {data_dir} itself (its own prompts would be left out)")
        skipped = [("--skip-answered-in", Path(d)) for d in args.skip_answered_in or []]
        check_folders(list(outputs[:2]), [("--target", target_dir)] + ([("--init", init)] if init else []) + extra
                      + skipped)
        target_cfg = BeamConfig.from_file(target_dir / "config.json")
        if args.selector_rank > target_cfg.hidden_size:
            raise ValueError(f"--selector-rank {args.selector_rank} is above the target's hidden size "
                             f"({target_cfg.hidden_size})")
        dcfg = drafter_layout(target_cfg, args.layers, args.selector_rank, args.block_size)
        if init is not None:  # the drafter's config records the largest block it has trained at
            trained = check_init(init, dcfg, target_cfg).block_size
            dcfg = dataclasses.replace(dcfg, block_size=max(dcfg.block_size, trained))
        context = target_cfg.max_position_embeddings
        if recipe.max_prompt_tokens + recipe.max_new_tokens > context:
            raise BeamtrtError(f"--max-new-tokens {recipe.max_new_tokens}: prompts of up to {recipe.max_prompt_tokens} "
                               f"tokens and their answers must fit the target's context of {context} tokens")
        if not has_tokenizer(target_dir):  # phase 1 asks the target chat prompts (a random model has no tokenizer)
            raise BeamtrtError(f"--target {target_dir}: no tokenizer files (none of {', '.join(TOKENIZER_FILES)}); "
                               "the drafter learns from the target's answers to chat prompts")
        if not args.data_only:
            held.enter_context(writing(work, f"--work {work}: in use by another running train_drafter.py (it holds "
                                             "the folder's lock): wait for it to end, or choose another --work"))
        inputs = [("--target", target_dir), ("--data", data_dir), ("--work", work)] + extra + skipped
        if not args.data_only:
            check_out(out, args.force, inputs, init)

        target = load_beam(target_dir, dtype=torch.float32, device=device, quiet=args.quiet).requires_grad_(False)
        digest = target_digest(target)
        trained_on = None  # the data fingerprint of a run to resume
        if not args.data_only:  # what training needs besides phase 1's cache, checked before phase 1
            if (work / "train_state.pt").exists():  # a run to resume: its settings, layout and target
                trained_on = check_state(work / "train_state.pt", cfg, dcfg, digest)["data"]
            for extra in map(Path, args.extra_data):
                check_cache(target, dcfg.target_layer_ids, extra, digest)
            drafter = (start_from(init, dcfg, target, cfg.seed) if init else  # --init's weights read here
                       init_drafter(dcfg, target, cfg.seed))
        tokenizer = load_tokenizer(target_dir)
        t0 = time.perf_counter()
        prompts = training_prompts(recipe.prompts, recipe.seed, recipe.mix)
        skip = None if args.skip_answered_in is None else answered_prompts(*map(Path, args.skip_answered_in))

        def resumable(unanswered: int) -> None:  # a resume trains on the data it began with, all of it answered
            if trained_on is None:
                return
            if unanswered:
                raise BeamtrtError(f"--data {data_dir}: has {unanswered} shard(s) not answered yet, but --work "
                                   f"{work} holds a run to resume, which trained on complete data: this is another "
                                   "cache, or one that lost shards. Pass the --data it trained on, complete this one "
                                   "first (--data-only), or use another --work")
            answers = [read_answers(d, target.cfg.vocab_size) for d in (*map(Path, args.extra_data), data_dir)]
            check_data(work / "train_state.pt", trained_on, fingerprint(concat_features(answers)))  # before any taps

        with writing(data_dir):  # another run making or completing the same cache is waited for
            build_features(target, tokenizer, dcfg.target_layer_ids, prompts, data_dir, recipe, quiet=args.quiet,
                           digest=digest, skip=skip, before_answering=resumable)
        if args.data_only:
            print(f"data: {data_dir} complete (--data-only: no training)", file=sys.stderr)
            return
        for extra in map(Path, args.extra_data):  # committed answers files get their taps back
            with writing(extra):
                rebuild_features(target, dcfg.target_layer_ids, extra, quiet=args.quiet, digest=digest)
        data = load_features(*map(Path, args.extra_data), data_dir, digest=digest, vocab_size=target.cfg.vocab_size)
        n_answer = int(sum(int(data.seq_start[i + 1] - data.seq_start[i]) - int(data.prompt_len[i])
                           for i in range(len(data))))
        print(f"data: {len(data)} sequences, {data.ids.shape[0]} tokens ({n_answer} answer tokens) in {data_dir}",
              file=sys.stderr)
        unscored = "" if split(data, cfg)[1] else (  # the last eval_sequences greedy answers, when there are more
            f"not evaluated: nothing held out, as the data has {int(data.greedy.sum())} greedy answers and the last "
            f"{cfg.eval_sequences} are held out only when there are more; raise --prompts for a score")
        if unscored:
            print(f"warning: training is {unscored}", file=sys.stderr)

        if args.init and replays_init_batches(Path(args.init), cfg.seed, len(data), int(data.ids.shape[0])):
            print(f"warning: --init {args.init} was trained on this data with --seed {cfg.seed}: its steps would "
                  "draw the same blocks again; pass another --seed for new ones", file=sys.stderr)
        t1 = time.perf_counter()  # phase 1 (answers, taps, the caches read) ends, training starts
        log = train(drafter, data, cfg, work, quiet=args.quiet, digest=digest)
        write_log(work / "train_log.jsonl", log)

        check_out(out, args.force, inputs, init)  # again: something may have been put there since the start
        final = next((row for row in reversed(log) if "eval_tau" in row), {})
        first = log[0] if log and log[0]["step"] == 0 else {}
        summary = {"target": str(target_dir), "data": dataclasses.asdict(recipe), "extra_data": args.extra_data,
                   "train": dataclasses.asdict(cfg),
                   "data_sequences": len(data), "data_tokens": int(data.ids.shape[0]), "answer_tokens": n_answer,
                   "data_seconds_this_run": round(t1 - t0, 1),
                   "train_seconds_this_run": round(time.perf_counter() - t1, 1),
                   "train_seconds_total": round(sum(row["seconds"] for row in log), 1),
                   "initial_eval": {k: v for k, v in first.items() if k.startswith("eval_")},  # the --init drafter
                   "final_eval": {k: v for k, v in final.items() if k.startswith("eval_")}}

        def records(folder: Path) -> None:  # inside the drafter's folder before it is renamed into place
            write_log(folder / "train_log.jsonl", log)
            write_json(folder / "training.json", summary)
        save_drafter(drafter.to("cpu", torch.bfloat16), out, overwrite=True, also=records)  # fp32 trained, bf16 kept
        print(f"drafter: {out}  (" + (unscored or f"held-out greedy acceptance length at block "
                                               f"{cfg.eval_block_size}: {final.get('eval_tau', float('nan')):.2f}")
              + ")")

    return run_cli(run)

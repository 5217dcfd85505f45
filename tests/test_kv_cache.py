"""KV cache semantics: cropping rolls back exactly; ragged batches equal each sequence decoded alone."""

import pytest
import torch

from conftest import tiny_model

pytestmark = pytest.mark.usefixtures("step_path")  # every test on both CPU step paths


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def decode(model, cache, tokens):  # tokens: [B, n] fed one step at a time -> logits [B, n, V]
    return torch.cat([model(tokens[:, t:t + 1], cache).logits for t in range(tokens.shape[1])], dim=1)


def test_crop_then_redecode_equals_uncropped():
    model = tiny_model()
    g = torch.Generator().manual_seed(1)
    prompt, cont = torch.randint(0, 101, (1, 5), generator=g), torch.randint(0, 101, (1, 20), generator=g)
    ref_cache = model.new_cache(1, 64)
    model(prompt, ref_cache)
    ref = decode(model, ref_cache, cont)

    cache = model.new_cache(1, 64)
    model(prompt, cache)
    decode(model, cache, cont)
    cache.crop(cache.lengths - 7)
    again = decode(model, cache, cont[:, -7:])
    assert rel(again, ref[:, -7:]) < 1e-6
    assert int(cache.lengths) == 25


def test_crop_then_other_tokens_equals_fresh_run():
    model = tiny_model()
    g = torch.Generator().manual_seed(2)
    seq = torch.randint(0, 101, (1, 12), generator=g)
    other = torch.randint(0, 101, (1, 4), generator=g)
    cache = model.new_cache(1, 32)
    model(seq, cache)
    cache.crop([8])
    got = model(other, cache).logits  # verify-style multi-token step after a rollback
    fresh = model.new_cache(1, 32)
    want = model(torch.cat([seq[:, :8], other], 1), fresh).logits[:, 8:]
    assert rel(got, want) < 1e-6


def test_ragged_batch_equals_each_alone():
    model = tiny_model()
    g = torch.Generator().manual_seed(3)
    lengths = [3, 9, 14]
    prompts = [torch.randint(0, 101, (n,), generator=g) for n in lengths]
    steps = torch.randint(0, 101, (3, 10), generator=g)
    ids = torch.zeros(3, 14, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, :len(p)] = p
    cache = model.new_cache(3, 64)
    first = model(ids, cache, num_tokens=torch.tensor(lengths), last_only=True).logits
    batched = decode(model, cache, steps)
    assert cache.lengths.tolist() == [n + 10 for n in lengths]
    for b, p in enumerate(prompts):
        alone = model.new_cache(1, 64)
        first_b = model(p[None], alone).logits[:, -1:]
        assert rel(first[b:b + 1], first_b) < 1e-6
        assert rel(batched[b:b + 1], decode(model, alone, steps[b:b + 1])) < 1e-6


def test_per_slot_crop_and_reset():
    model = tiny_model()
    g = torch.Generator().manual_seed(4)
    seq = torch.randint(0, 101, (2, 10), generator=g)
    cache = model.new_cache(2, 32)
    model(seq, cache)
    cache.crop([10, 4])  # only row 1 rolls back
    nxt = torch.randint(0, 101, (2, 1), generator=g)
    got = model(nxt, cache).logits
    for b, keep in enumerate((10, 4)):
        alone = model.new_cache(1, 32)
        want = model(torch.cat([seq[b:b + 1, :keep], nxt[b:b + 1]], 1), alone).logits[:, -1:]
        assert rel(got[b:b + 1], want) < 1e-6
    cache.reset([0])
    assert cache.lengths.tolist() == [0, 5]


def test_bad_crop_and_overflow_are_clear():
    model = tiny_model()
    cache = model.new_cache(1, 8)
    model(torch.zeros(1, 5, dtype=torch.long), cache)
    with pytest.raises(ValueError, match="crop lengths"):
        cache.crop([6])
    with pytest.raises(ValueError, match="crop lengths"):
        cache.crop([-1])
    with pytest.raises(ValueError, match="exceeds the KV cache capacity 8"):
        model(torch.zeros(1, 4, dtype=torch.long), cache)


def test_forward_on_a_subset_of_slots():
    model = tiny_model()
    g = torch.Generator().manual_seed(5)
    seq = torch.randint(0, 101, (3, 7), generator=g)
    cache = model.new_cache(3, 32)
    model(seq, cache, num_tokens=torch.tensor([7, 5, 6]))
    nxt = torch.randint(0, 101, (2, 3), generator=g)
    slots = torch.tensor([2, 0])
    got = model(nxt, cache, slots=slots).logits
    assert cache.lengths.tolist() == [10, 5, 9]
    one = model(nxt[:1, :1], cache, slots=torch.tensor([1])).logits  # single-row fast path on slot 1
    assert cache.lengths.tolist() == [10, 6, 9]
    for i, (slot, keep) in enumerate(((2, 6), (0, 7))):
        alone = model.new_cache(1, 32)
        want = model(torch.cat([seq[slot:slot + 1, :keep], nxt[i:i + 1]], 1), alone).logits[:, -3:]
        assert rel(got[i:i + 1], want) < 1e-6
    alone = model.new_cache(1, 32)
    want = model(torch.cat([seq[1:2, :5], nxt[:1, :1]], 1), alone).logits[:, -1:]
    assert rel(one, want) < 1e-6
    cache.crop([8, 4], slots=torch.tensor([2, 1]))
    assert cache.lengths.tolist() == [10, 4, 8]
    with pytest.raises(ValueError, match="crop lengths"):
        cache.crop([11], slots=torch.tensor([0]))

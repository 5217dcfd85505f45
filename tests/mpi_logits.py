"""Run under mpirun by tests/test_mpi.py: every rank loads its shard of CKPT; rank 0 compares the fp32 logits of a
batch with the un-sharded model and prints the max relative difference."""

import sys

import torch

from beamtrt.checkpoint.trtllm_files import load_target
from beamtrt.runtime import tp
from beamtrt.runtime.dist import Dist

dist = Dist.create()
model = tp.load_target_shard(sys.argv[1], dist)
ids = torch.randint(0, model.shard.vocab_size, (3, 11), generator=torch.Generator().manual_seed(0))
logits = model(ids, model.new_cache(3, 16)).logits
if dist.rank == 0:
    ref = load_target(sys.argv[1])
    want = ref(ids, ref.new_cache(3, 16)).logits
    print(f"max relative logit difference {float((logits - want).abs().max() / want.abs().max()):.3e}")

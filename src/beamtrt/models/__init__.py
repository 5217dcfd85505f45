"""The reference networks in PyTorch: the Beam target, beam-mini, random Beam checkpoints and the DFlash2 drafter."""

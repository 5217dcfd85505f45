"""Speculative decoding: the selector walk, greedy and rejection-sampling verification, the decode loop, metrics."""

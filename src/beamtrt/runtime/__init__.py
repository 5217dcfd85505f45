"""The decode runtime: backends (torch, trt), tensor-parallel ranks, loading a build and the `run.py` CLI."""

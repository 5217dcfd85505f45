"""The `trt` backend: TensorRT-LLM 1.2 engines behind the backend interface (import-guarded)."""

from __future__ import annotations

TRTLLM_PINNED = "1.2"  # the last TensorRT-LLM release line with the TensorRT engine backend


def trt_support() -> str | None:
    """None where the trt backend can run here, else why not (one line)."""
    from beamtrt.build.pipeline import engine_support

    return engine_support()


def load_engines(root, manifest: dict, dist, spec: bool = True):
    raise NotImplementedError("the trt backend is not written yet")

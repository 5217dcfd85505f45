"""beamtrt: TensorRT-LLM engine builder and tensor-parallel DFlash2 speculative runtime for Beam."""

__version__ = "0.1.0"

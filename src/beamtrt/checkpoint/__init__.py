"""Checkpoint files: streaming safetensors, TensorRT-LLM checkpoint layout, the build manifest and its validation."""

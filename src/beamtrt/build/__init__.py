"""The engine builder: calibration, quantization, TP sharding, TensorRT-LLM checkpoints, engines and the manifest."""

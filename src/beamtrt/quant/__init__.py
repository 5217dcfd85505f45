"""Pure-torch NVFP4 and FP8 quantization, bit-identical to nvidia-modelopt's export numerics."""

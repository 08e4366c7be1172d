"""torch_npu kernels: attention, quantised linear, GGUF, fused layer ops."""

"""The CPU kernels: attention, linear, quantised linear, GGUF, fused layer ops (the compiled
library where it loads, native.py)."""

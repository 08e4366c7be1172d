"""CUDA kernels: flash-attn attention."""

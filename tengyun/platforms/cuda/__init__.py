"""The CUDA platform (platform.py) and its kernels (kernels/)."""

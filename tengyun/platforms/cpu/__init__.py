"""The CPU platform: CpuPlatform (platform.py), its process-wide runtime tuning (runtime/), the
compiled kernel library (native.py) and the kernels it chooses from (kernels/)."""

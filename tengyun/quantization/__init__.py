"""Quantised checkpoints: which format a checkpoint is in, what its linear layers hold, and how
`tengyun quantize` writes one.

Torch-free (the planner reads them): ``scheme`` (the tensors of one quantised linear layer and
their bytes), ``config`` (format detection and the registry of formats), one module per format
(``compressed_tensors``, ``gguf``). Torch: ``packing`` (int4 packing, round-to-nearest) and ``quantize``
(`tengyun quantize`). Layers take their scheme in tengyun/layers/quantized.py; kernels run it
through the platform (tengyun/layers/quant_kernels.py, Platform.quant_linear_kernel).
"""

"""Mixture-of-experts pieces: routing (routing.py), the experts as grouped matmuls (grouped.py),
the layer that holds and loads the experts (tengyun/layers/fused_moe.py)."""

"""LoRA's torch side: adapter weights in device slots beside each targeted linear (layer.py),
the step's token -> slot map (batch.py), the batched low-rank products (kernels.py), PEFT tensors
placed for this rank (loader.py) and the worker's LoRAManager (manager.py). docs/lora.md."""

"""LoRA adapters on one base model (docs/lora.md): what a request names (request.py), how a PEFT
folder is read and checked (peft_adapter.py, targets.py) and which adapter sits in which of the
worker's slots (slots.py). Torch-free; the weights and the batched products are in
tengyun/layers/lora/."""

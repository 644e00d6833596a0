"""Accuracy recovery: LoRA adapters trained on the frozen quantized model with a data mixture."""

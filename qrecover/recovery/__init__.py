"""Accuracy recovery: LoRA adapters (:mod:`qrecover.adapters`) trained on the frozen quantized model with a data mixture
(:mod:`qrecover.data`): the objective, the learning-rate schedule, the training loop, ``tune`` and the ``recover``/``finetune``
entry points."""

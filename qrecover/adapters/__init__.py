"""Adapters on the frozen quantized model, through PEFT: attaching and saving LoRA (:mod:`.lora`), the LoRA
layer whose merge re-quantizes (:mod:`.peft_quant`), the head adapter (:mod:`.head_lora`), int8 adapter files
(:mod:`.int8`), serving several adapters at once on one model (:mod:`.serve`), the SVD initialisation from the
quantization error (:mod:`.svd_init`) and rank allocation (:mod:`.rank_alloc`). Recovery training
(:mod:`qrecover.recovery`) uses them; so does loading a checkpoint with its adapter (:mod:`qrecover.loading`)."""

"""The recovery training config: a dataclass that round-trips to JSON, every field documented where declared."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, ClassVar

from ..errors import QRecoverError
from ..fields import DictConfig, doc_field

OBJECTIVES = ("ce", "kd", "mix")
PRECISIONS = ("auto", "bf16", "fp32")
BASE_DTYPES = ("auto", "bf16", "fp32")
INITS = ("svd", "zero")
SCHEDULES = ("cosine", "wsd")
ADAPTER_BITS = (16, 8)
RANK_ALLOCATIONS = ("uniform", "damage")


@dataclass
class RecoverConfig(DictConfig):
    what = "recover config"
    allow_zero_lr: ClassVar[bool] = False  # tuning (TuneConfig) allows lr 0: a run that must leave every tensor as it was

    rank: int = doc_field(16, "LoRA rank r (AFM trains 8, 16 and 32)", short="-r")
    alpha: float | None = doc_field(None, "LoRA alpha; None = 2 x rank (scaling 2)")
    init: str = doc_field("svd", "'svd': B A starts as the rank-r approximation of the quantization error W - Q(W), weighted by the "
                          "calibration inputs (LoftQ-style; needs the unquantized model); 'zero': PEFT's B = 0 (starts at the "
                          "quantized model). `finetune` ignores it: a feature adapter starts from its --init-adapter")
    rank_allocation: str = doc_field("uniform", "'uniform': rank r on every target layer; 'damage': the same number of adapter "
                                     "parameters (r x the sum of in + out) spread by each layer's quantization damage and "
                                     "the spectrum of its error (qrecover/adapters/rank_alloc.py; needs the unquantized model)")
    targets: str = doc_field("all", "'all' quantized projections, or 'top:N' = the N layers whose quantization damage (manifest) is largest")
    tokens: int = doc_field(65536, "training tokens (whole run, all processes)", short="-t")
    mix: str | None = doc_field(None, "data-mix recipe (TOML); None = the shipped default mix (qrecover/recipes/default-mix.toml)", cli=False)
    objective: str = doc_field("kd", "'ce' (next-token cross-entropy on the data), 'kd' (KL to the unquantized model), 'mix' (both)")
    kd_weight: float = doc_field(0.5, "with objective 'mix': loss = (1 - kd_weight) * CE + kd_weight * KL")
    temperature: float = doc_field(1.0, "distillation temperature (1 = match the teacher's distribution as is)")
    hidden_weight: float = doc_field(0.0, "add hidden_weight x the mean over decoder layers of each layer output's relative "
                                     "squared error to the unquantized model's, per token (||h - h_teacher||^2 / "
                                     "||h_teacher||^2): a dense signal on every hidden unit beside the logits' KL; 0 = off. "
                                     "Needs objective 'kd' or 'mix' (docs/tune.md)")
    seq_len: int = doc_field(512, "tokens per packed training sequence")
    batch_size: int = doc_field(1, "sequences per micro-batch (per process); 1 x 512 tokens = more optimizer steps per token, "
                                   "which closed more of the gap than 4 x 512 at equal tokens on the default model")
    grad_accum: int = doc_field(1, "micro-batches per optimizer step")
    lr: float = doc_field(5e-4, "peak learning rate (AdamW). With the 'svd' init the model starts close and a high lr first undoes "
                          "part of that: 5e-4 beat 1e-3 and 2e-3 on the default model (reports/recover-tuning.md); "
                          "with init 'zero', 2e-3 was best")
    warmup: float = doc_field(0.05, "fraction of steps of linear warm-up")
    min_lr_ratio: float = doc_field(0.1, "the cosine schedule ends at this fraction of the peak lr")
    weight_decay: float = doc_field(0.0, "AdamW weight decay on the adapter weights")
    max_grad_norm: float = doc_field(1.0, "gradient clipping (global L2 norm); 0 disables")
    dropout: float = doc_field(0.0, "LoRA dropout")
    seed: int = doc_field(0, "seed for initialisation and data order")
    log_every: int = doc_field(10, "optimizer steps between reads of the loss from the device (the progress bar's loss, the non-finite "
                               "check); the steps between them never wait for the device. Checkpoints and the first 2 steps are read too")
    checkpoint_every: int = doc_field(50, "optimizer steps between resumable checkpoints; 0 = only at the end")
    gradient_checkpointing: bool = doc_field(False, "recompute activations in backward (less memory, ~30% slower)")
    precision: str = doc_field("auto", "'bf16' autocast (fp32 adapter weights and loss), 'fp32', or 'auto' = bf16 where the "
                               "device computes it natively (CUDA with bf16, CPUs with AVX512-BF16/AMX), else fp32")
    base_dtype: str = doc_field("auto", "dtype of the frozen base's unpacked floats while training (norm weights, an unquantized "
                                "embedding or head, biases), and so of the residual stream: 'bf16', 'fp32', or 'auto' = bf16 "
                                "on CUDA with bf16 precision (no fp32<->bf16 cast around every projection and adapter: copies "
                                "were 18% of an H100 step's GPU time), else fp32 (the CPU's numerics unchanged). Restored "
                                "after training; the packed weights are untouched")
    compile_layers: bool = doc_field(False, "torch.compile each decoder layer of the student and the teacher (one graph per layer "
                                     "kind, compiled in the first steps: the warm-up); for GPUs, off by default (on a CPU the "
                                     "compilation costs more than it saves on short runs)")
    fused_layers: bool = doc_field(True, "fewer passes over the activations while training: LoRA's scale and add inside one "
                                   "GEMM, and on CUDA with liger-kernel installed (qrecover[train-gpu]) its fused RMSNorm, "
                                   "SwiGLU and rotary embedding (not with --compile-layers, which fuses them itself); the same "
                                   "numbers",
                                   flag="--no-fused-layers", negate=True)
    teacher_graph: bool = doc_field(True, "on CUDA, replay the distillation teacher's forward as a CUDA graph (captured at its second "
                                    "call per shape: no host time for it after; the same kernels, so the same numbers); "
                                    "eager if the capture fails, with --hidden-weight and with --compile-layers",
                                    flag="--no-teacher-graph", negate=True)
    cache_dequantized: bool = doc_field(True, "keep dequantized base weights in memory during training (faster, +4 bytes per weight)",
                                        flag="--no-cache-dequantized", negate=True)
    shard_base: bool = doc_field(False, "on several processes (torchrun, or accelerate launch without --use_fsdp): shard the "
                                 "frozen packed base across them with torch's FSDP2 (each decoder layer gathered as it runs) "
                                 "instead of a whole copy per process; the adapter and its optimizer state stay whole on every "
                                 "process, as under DDP. Turns off cache_dequantized. No effect on one process")
    decontaminate: bool = doc_field(True, "drop training documents that overlap the evaluation sets (13/7-gram rule)",
                                    flag="--no-decontaminate", negate=True)
    loss_chunk: int = doc_field(1024, "predicted positions per chunk of the loss: the student's and teacher's vocabulary-sized logits "
                                "exist one chunk at a time (recomputed in backward); 0 = the whole micro-batch at once "
                                "(batch x seq x vocab floats per tensor: 8 GB at 8 x 2048 tokens and a 128k vocabulary)")
    teacher_device: str | None = doc_field(None, "device of the distillation teacher, e.g. 'cuda:1' (with several processes per machine, per "
                                           "process: cuda:N + local rank); None = the training device. "
                                           "On CUDA with bf16 precision the (frozen) teacher is cast to bf16 once")
    head_rank: int = doc_field(0, "rank of a LoRA on the output head (the tied LM head reads the packed embedding, so no "
                               "projection adapter reaches it): a low-rank correction added to the logits only "
                               "(qrecover/adapters/head_lora.py); 0 = none. Costs 2 x r x (hidden + vocab) bytes")
    schedule: str = doc_field("cosine", "learning-rate schedule after warm-up: 'cosine' (decays over the whole run) or 'wsd' "
                              "(warm-up, stable at the peak lr, then a 1-sqrt decay over the last decay_fraction of steps)")
    decay_fraction: float = doc_field(0.2, "with schedule 'wsd': the fraction of steps that decays to min_lr_ratio x lr")
    adapter_bits: int = doc_field(16, "bits of the exported adapter weights: 16 (fp16, plain PEFT) or 8 (per-row int8 "
                                  "A and B with fp16 scales, qrecover's adapter_model.int8.safetensors; "
                                  "qrecover/adapters/int8.py)")

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank <= 0:
            raise QRecoverError(f"--rank {self.rank!r} must be a positive integer, e.g. --rank 16")
        if isinstance(self.tokens, bool) or not isinstance(self.tokens, int) or self.tokens < (0 if self.other_training() else 1):
            raise QRecoverError(f"--tokens {self.tokens!r} must be a positive number of training tokens, e.g. --tokens 65536")
        if self.objective not in OBJECTIVES:
            raise QRecoverError(f"--objective {self.objective!r} must be one of {', '.join(OBJECTIVES)}")
        if self.init not in INITS:
            raise QRecoverError(f"--init {self.init!r} must be one of {', '.join(INITS)}")
        if self.precision not in PRECISIONS:
            raise QRecoverError(f"--precision {self.precision!r} must be one of {', '.join(PRECISIONS)}")
        if self.base_dtype not in BASE_DTYPES:
            raise QRecoverError(f"--base-dtype {self.base_dtype!r} must be one of {', '.join(BASE_DTYPES)}")
        if self.base_dtype == "bf16" and self.shard_base:
            raise QRecoverError("--base-dtype bf16 cannot be combined with --shard-base (FSDP shards the base as stored); "
                                "leave --base-dtype at auto, which keeps a sharded base as it is")
        if not 0.0 <= self.kd_weight <= 1.0:
            raise QRecoverError(f"--kd-weight {self.kd_weight} must be in [0, 1]")
        for name in ("seq_len", "batch_size", "grad_accum"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise QRecoverError(f"--{name.replace('_', '-')} {v!r} must be a positive integer")
        if not (self.lr > 0 or (self.allow_zero_lr and self.lr == 0)):
            raise QRecoverError(f"--lr {self.lr} must be positive, e.g. --lr 1e-3")
        if not self.temperature > 0:
            raise QRecoverError(f"--temperature {self.temperature} must be positive")
        if not self.hidden_weight >= 0:
            raise QRecoverError(f"--hidden-weight {self.hidden_weight!r} must be >= 0 (0 = off), e.g. --hidden-weight 1")
        if self.hidden_weight > 0 and self.objective == "ce":
            raise QRecoverError(f"--hidden-weight {self.hidden_weight:g} matches the unquantized model's hidden states, which "
                                "objective 'ce' does not run; use --objective kd or mix, or --hidden-weight 0")
        if not 0.0 <= self.warmup < 1.0 or not 0.0 <= self.min_lr_ratio <= 1.0:
            raise QRecoverError(f"warmup={self.warmup} must be in [0, 1) and min_lr_ratio={self.min_lr_ratio} in [0, 1]")
        if isinstance(self.log_every, bool) or not isinstance(self.log_every, int) or self.log_every <= 0:
            raise QRecoverError(f"--log-every {self.log_every!r} must be a positive number of steps, e.g. --log-every 10")
        if self.checkpoint_every < 0 or self.max_grad_norm < 0:
            raise QRecoverError("--checkpoint-every and max_grad_norm must not be negative")
        if isinstance(self.loss_chunk, bool) or not isinstance(self.loss_chunk, int) or self.loss_chunk < 0:
            raise QRecoverError(f"--loss-chunk {self.loss_chunk!r} must be a number of positions >= 0 (0 = unchunked), "
                                "e.g. --loss-chunk 1024")
        if self.teacher_device is not None and not re.fullmatch(r"cpu|cuda(:\d+)?|xpu(:\d+)?|mps", str(self.teacher_device)):
            raise QRecoverError(f"--teacher-device {self.teacher_device!r} is not a device; pass e.g. cuda:1, cuda or cpu")
        if isinstance(self.head_rank, bool) or not isinstance(self.head_rank, int) or self.head_rank < 0:
            raise QRecoverError(f"--head-rank {self.head_rank!r} must be 0 (no head adapter) or a positive integer, e.g. 16")
        if self.schedule not in SCHEDULES:
            raise QRecoverError(f"--schedule {self.schedule!r} must be one of {', '.join(SCHEDULES)}")
        if not 0.0 < self.decay_fraction <= 1.0 or self.warmup + self.decay_fraction > 1.0:
            raise QRecoverError(f"--decay-fraction {self.decay_fraction} must be in (0, 1] with warmup + decay_fraction "
                                f"<= 1 (warmup={self.warmup}), e.g. 0.2")
        if self.adapter_bits not in ADAPTER_BITS:
            raise QRecoverError(f"--adapter-bits {self.adapter_bits!r} must be 16 or 8")
        if self.rank_allocation not in RANK_ALLOCATIONS:
            raise QRecoverError(f"--rank-allocation {self.rank_allocation!r} is unknown; choose from {list(RANK_ALLOCATIONS)}")
        if self.targets != "all":
            n = self.targets.removeprefix("top:")
            if not self.targets.startswith("top:") or not n.isdigit() or int(n) <= 0:
                raise QRecoverError(f"--targets {self.targets!r} must be 'all' or 'top:N' with N > 0, e.g. top:60")

    def other_training(self) -> bool:
        """Whether something else trains besides the ``tokens`` loop (then ``tokens`` may be 0)."""
        return False

    @property
    def tokens_per_step(self) -> int:
        """Tokens per optimizer step on one process."""
        return self.batch_size * self.grad_accum * self.seq_len

    @classmethod
    def default(cls, name: str) -> Any:
        """The default of field ``name`` (the CLI's defaults are these, so the two never drift apart)."""
        return cls.__dataclass_fields__[name].default


#: what `qrecover tune` can train (TuneConfig.params)
PARAM_KINDS = ("tables", "scales", "norms", "embedding", "codes")


@dataclass
class TuneConfig(RecoverConfig):
    """:class:`RecoverConfig` (data, objective, schedule, batch, resume, precision...) plus what to tune. The LoRA
    fields (rank, init, targets, head_rank, adapter_bits) are unused."""

    what = "tune config"
    allow_zero_lr: ClassVar[bool] = True

    # the continuous parameters to train: 'tables' (palettization look-up tables), 'scales' (blockwise/GPTQ scales),
    # 'norms' (normalization weights), 'embedding' (the packed embedding's tables or scales, read by the tied head too)
    params: str = doc_field("tables,scales,norms,embedding", "what trains: a comma-separated subset of tables, scales, norms, "
                            "embedding, codes")
    # in units of each row's RMS (so lr 2e-3 moves a table entry or a scale by about 0.2% of its row's size per step),
    # and of the norms; 0 leaves every tensor as it was. 2e-3 closed 2.4x more held-out gap than 5e-4 on SmolLM2
    # (docs/tune.md)
    lr: float = doc_field(2e-3, "peak learning rate of the fp32 masters (AdamW); 0 changes nothing")
    # the codes' master weights (--params codes): their peak lr in row units; a 3-bit code crosses to its neighbour after
    # moving ~0.25 of its row's RMS, so it needs a larger step than the tables' lr (docs/tune.md, "The codes")
    codes_lr: float = doc_field(1e-2, "peak learning rate of the codes' master weights (--params codes; row units, as --lr)")
    # windows of seq_len tokens of the python-docs 'eval' split, scored with the fp32 masters and after rounding them
    # to fp16 (what rounding costs)
    rounding_windows: int = doc_field(4, "held-out windows scored before and after rounding the masters to fp16 (0: not measured)")
    # block-wise reconstruction first (qrecover/recovery/blocks.py): each decoder block's output fitted to the
    # unquantized block's, one block at a time, on windows of the same data; then the end-to-end pass on --tokens
    block_tokens: int = doc_field(0, "tokens of block-wise reconstruction before the end-to-end pass (each block's output "
                                  "fitted to the unquantized block's, docs/tune.md); 0 = none. With it --tokens may be 0")
    block_epochs: int = doc_field(2, "passes over the block-wise windows")
    block_lr: float = doc_field(1e-3, "peak learning rate of the block-wise pass (row units, as --lr)")

    @property
    def code_step(self) -> float:
        """How much farther per optimizer step the codes' masters move than the tables': their lr is the schedule's
        (``lr``) and their unit is scaled by ``codes_lr / lr`` (one AdamW parameter group, as Adam's step scales with
        the unit). lr 0 changes nothing either way."""
        return self.codes_lr / self.lr if self.lr > 0 else 1.0

    def validate(self) -> None:
        super().validate()
        unknown = [k for k in self.kinds if k not in PARAM_KINDS]
        if unknown or not self.kinds:
            raise QRecoverError(f"--params {self.params!r}: choose a comma-separated subset of {', '.join(PARAM_KINDS)}, "
                                "e.g. --params tables,scales")
        if self.shard_base:
            raise QRecoverError("tune does not shard the base (--shard-base): its tables and scales train, and FSDP would "
                                "shard them; tune data parallel (one whole copy per process) instead")
        if not self.codes_lr >= 0:
            raise QRecoverError(f"--codes-lr {self.codes_lr!r} must be >= 0, e.g. --codes-lr 1e-2")
        if self.rounding_windows < 0:
            raise QRecoverError(f"--rounding-windows {self.rounding_windows} must be >= 0")
        if isinstance(self.block_tokens, bool) or not isinstance(self.block_tokens, int) or self.block_tokens < 0 or (
                0 < self.block_tokens < self.seq_len):
            raise QRecoverError(f"--block-tokens {self.block_tokens!r} must be 0 (none) or at least one window of --seq-len "
                                f"{self.seq_len} tokens, e.g. --block-tokens 32768")
        if isinstance(self.block_epochs, bool) or not isinstance(self.block_epochs, int) or self.block_epochs <= 0:
            raise QRecoverError(f"--block-epochs {self.block_epochs!r} must be a positive integer, e.g. --block-epochs 2")
        if not self.block_lr > 0:
            raise QRecoverError(f"--block-lr {self.block_lr} must be positive, e.g. --block-lr 1e-3")

    def other_training(self) -> bool:
        return isinstance(self.block_tokens, int) and self.block_tokens > 0

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(k.strip() for k in str(self.params).split(",") if k.strip())


@dataclass
class FinetuneConfig(RecoverConfig):
    """:class:`RecoverConfig` with a feature adapter's defaults (``qrecover finetune``): cross-entropy on the feature's
    own data, not decontaminated, from a start that is already good. The LoRA fields (rank, init, ...) are unused: the
    adapter is its ``--init-adapter``'s."""

    what = "finetune config"

    objective: str = doc_field("ce", "'ce' only: a feature adapter learns new behaviour, it does not imitate the unquantized model")
    lr: float = doc_field(2e-4, "peak learning rate (lower than recovery: the start is already good)")
    batch_size: int = doc_field(4, "sequences per micro-batch")
    decontaminate: bool = doc_field(False, "the feature's own data is kept whole (not checked against the evaluation sets)")

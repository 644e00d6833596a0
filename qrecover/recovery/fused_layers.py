"""Fewer passes over the activations in a training step: LoRA's scale and add folded into one GEMM, and Liger
Kernel's fused RMSNorm, SwiGLU and rotary embedding on CUDA.

An H100 profile of a recovery step (Llama-3.2-1B geometry, rank 16 on every projection, KD, 4 x 2048 tokens,
bf16 base; ``benchmarks/train_speed.py --profile``, 2026-11-27) spent 38% of its GPU time in matmuls and most of
the rest in elementwise kernels over activation-sized tensors: 855 multiplies (41 ms of 243), 821 copies (24 ms),
608 adds (22 ms). Counted per decoder layer, the largest sources are:

- PEFT's ``result + lora_B(lora_A(x)) * scaling``: a multiply and an add over every projection's output, and the
  multiply again in backward. :func:`fused_lora` computes ``result.addmm_(lora_A(x), B^T, alpha=scaling)``: the
  scale and the add happen in the GEMM's epilogue (about 5 of 7 passes over each output saved).
- transformers' RMSNorm (fp32 upcast, ``pow``, ``mean``, ``rsqrt``, two multiplies, a downcast: ~10 passes where a
  fused kernel makes 2) and SwiGLU's ``act(gate) * up``. Liger Kernel's ``LigerRMSNormFunction`` and
  ``LigerSiLUMulFunction`` (well-kept Triton kernels with their own backward) replace them on CUDA where
  liger-kernel is installed (``pip install qrecover[train-gpu]``), on module instances only and only while training
  (Liger's own ``apply_liger_kernel_to_*`` patches transformers' classes for the whole process).
- The rotary embedding of the queries and keys (transformers' ``apply_rotary_pos_emb``: ``rotate_half``'s slices,
  negation and ``cat``, two multiplies and an add, for q and for k, and about as many again in backward: some 20
  q-sized passes per decoder layer of the student and 10 of the teacher). Liger's ``LigerRopeFunction`` rotates both
  in place in one kernel, forward and backward. It is called from a module-level function of the modeling file, so
  that function is replaced in the modeling modules of the models' attention classes while training and put back
  after; the replacement takes Liger's kernel only for tensors on CUDA of one dtype, and calls the original otherwise.

Both keep the numbers (the same operations, fused; tests compare outputs and gradients with the unfused layers).
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import sys
import types
from collections.abc import Iterator

import torch
import torch.nn as nn

#: RMSNorm classes whose forward is Llama's (fp32 statistics, the normalised input cast back, times ``weight``)
LLAMA_NORMS = ("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm", "SmolLM3RMSNorm")


def _plain_lora(m: nn.Module) -> bool:
    """A PEFT LoRA ``Linear`` with one adapter, no dropout and no variant (DoRA and the like): what
    :func:`_lora_forward` computes exactly."""
    from peft.tuners.lora.layer import Linear as LoraLinear  # qrecover's QuantLoraLinear is one too

    return (isinstance(m, LoraLinear) and hasattr(m, "lora_variant") and len(m.lora_A) == 1 and not m.lora_variant
            and not getattr(m, "fan_in_fan_out", False)
            and all(isinstance(d, nn.Identity) for d in m.lora_dropout.values()))


def _lora_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """PEFT's LoRA forward with ``scaling`` and the add inside one ``addmm_`` (PEFT's own forward where anything
    else is asked: several or disabled adapters, merged weights, per-sample adapter names, mixed dtypes)."""
    name = next(iter(self.lora_A))
    lora_a = self.lora_A[name]
    autocast = torch.is_autocast_enabled(x.device.type)
    if (args or kwargs or self.disable_adapters or self.merged or list(self.active_adapters) != [name]
            or not (autocast or x.dtype == lora_a.weight.dtype)):
        return type(self).forward(self, x, *args, **kwargs)
    x2 = x.reshape(-1, x.shape[-1])
    result = self.base_layer(x2)
    a = lora_a(x2)
    if result.dtype != a.dtype or result._base is not None:  # as PEFT computes it
        out = result + self.lora_B[name](a) * self.scaling[name]
    else:
        out = result.addmm_(a, self.lora_B[name].weight.to(a.dtype).t(), alpha=self.scaling[name])
    return out.reshape(*x.shape[:-1], out.shape[-1])


@contextlib.contextmanager
def _forwards(pairs: list[tuple[nn.Module, object]]) -> Iterator[int]:
    """While active, each module of ``pairs`` runs its function as its forward (an instance attribute, removed after);
    yields how many."""
    for m, fn in pairs:
        m.forward = types.MethodType(fn, m)
    try:
        yield len(pairs)
    finally:
        for m, _ in pairs:
            m.__dict__.pop("forward", None)


def fused_lora(model: nn.Module) -> contextlib.AbstractContextManager[int]:
    """While active, every plain PEFT LoRA ``Linear`` of ``model`` runs :func:`_lora_forward`; yields how many."""
    return _forwards([(m, _lora_forward) for m in model.modules() if _plain_lora(m)])


#: device types on which Liger's kernels replace the layers (tests add "cpu" under TRITON_INTERPRET=1)
LIGER_DEVICES = ("cuda",)


def liger_available() -> bool:
    try:
        import liger_kernel.ops.rms_norm  # noqa: F401
        import liger_kernel.ops.rope  # noqa: F401
        import liger_kernel.ops.swiglu  # noqa: F401
    except Exception:  # not installed, or no triton/GPU build to import with
        return False
    return True


def _norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    return LigerRMSNormFunction.apply(hidden_states, self.weight, self.variance_epsilon, 0.0, "llama", False)


def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    return self.down_proj(LigerSiLUMulFunction.apply(self.gate_proj(x), self.up_proj(x)))


#: SiLU activations: torch's, and transformers' ``ACT2FN["silu"]`` (its own class; the H100 run of 2026-11-27 matched
#: only torch's, so its MLPs stayed unfused there)
SILU = ("SiLU", "SiLUActivation")


def _swiglu_mlp(m: nn.Module) -> bool:
    return (all(hasattr(m, p) for p in ("gate_proj", "up_proj", "down_proj"))
            and type(getattr(m, "act_fn", None)).__name__ in SILU and type(m).__name__.endswith("MLP"))


#: modeling modules (``transformers.models.<name>.modeling_<name>``) whose ``apply_rotary_pos_emb(q, k, cos, sin)``
#: is Llama's: the whole head rotated by ``rotate_half``, cos and sin duplicated over its two halves (Liger's kernel)
LLAMA_ROPE = ("llama", "mistral", "qwen2", "qwen3", "smollm3")
ROPE_PARAMETERS = ["q", "k", "cos", "sin", "unsqueeze_dim"]


def _rope_module(m: nn.Module):
    """The modeling module whose ``apply_rotary_pos_emb`` the attention module ``m`` calls, if it is Llama's."""
    name = type(m).__module__
    module = sys.modules.get(name)
    if not type(m).__name__.endswith("Attention") or module is None or not hasattr(module, "apply_rotary_pos_emb"):
        return None
    if not any(name.endswith(f".modeling_{n}") for n in LLAMA_ROPE):
        return None
    # transformers' signature (not an already replaced function, nor one a later version changed)
    return module if list(inspect.signature(module.apply_rotary_pos_emb).parameters) == ROPE_PARAMETERS else None


def _liger_rope(original):
    """``apply_rotary_pos_emb`` through Liger's kernel where it computes the same thing (q, k, cos and sin of one dtype
    on a :data:`LIGER_DEVICES` device, no other argument); ``original`` otherwise."""
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        if (args or kwargs or q.device.type not in LIGER_DEVICES or q.ndim != 4 or k.ndim != 4
                or not q.dtype == k.dtype == cos.dtype == sin.dtype):
            return original(q, k, cos, sin, *args, **kwargs)
        from liger_kernel.ops.rope import LigerRopeFunction

        return LigerRopeFunction.apply(q, k, cos, sin)

    apply_rotary_pos_emb.original = original
    return apply_rotary_pos_emb


@contextlib.contextmanager
def _functions(modules: list) -> Iterator[int]:
    """While active, each modeling module of ``modules`` calls :func:`_liger_rope` as its ``apply_rotary_pos_emb``;
    put back after. Yields how many."""
    for module in modules:
        module.apply_rotary_pos_emb = _liger_rope(module.apply_rotary_pos_emb)
    try:
        yield len(modules)
    finally:
        for module in modules:
            module.apply_rotary_pos_emb = module.apply_rotary_pos_emb.original


def _on_liger_device(m: nn.Module) -> bool:
    return any(t.device.type in LIGER_DEVICES for t in itertools.chain(m.parameters(), m.buffers()))  # packed: buffers


@contextlib.contextmanager
def liger_layers(*models: nn.Module | None) -> Iterator[int]:
    """While active, Llama-style RMSNorms, SiLU-gated MLPs and rotary embeddings of ``models`` on CUDA run Liger
    Kernel's fused kernels (forward and backward); yields how many modules and modeling functions; 0 and nothing
    changed without liger-kernel or CUDA."""
    mods, ropes = [], []
    if liger_available():
        for model in (m for m in models if m is not None):
            for m in model.modules():
                if not _on_liger_device(m):
                    continue
                if type(m).__name__ in LLAMA_NORMS and hasattr(m, "variance_epsilon"):
                    mods.append((m, _norm_forward))
                elif _swiglu_mlp(m):
                    mods.append((m, _mlp_forward))
                elif (module := _rope_module(m)) is not None and module not in ropes:
                    ropes.append(module)
    with _forwards(mods) as n, _functions(ropes) as n_rope:
        yield n + n_rope

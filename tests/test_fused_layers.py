"""Fused layers while training (qrecover.recovery.fused_layers): LoRA's scale and add inside one GEMM gives PEFT's
outputs and gradients with fewer elementwise passes; Liger's norms, MLPs and rotary embedding only on CUDA with
liger-kernel (its rotary-embedding kernel also in triton's interpreter here)."""

from __future__ import annotations

import contextlib
import os
import sys

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from qrecover.recovery.fused_layers import fused_lora, liger_available, liger_layers
from qrecover.recovery.host_sync import HostSyncCounter


def _model(dropout: float = 0.0):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64)
    model = get_peft_model(LlamaForCausalLM(cfg), LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout,
                                                             target_modules=["q_proj", "v_proj", "down_proj", "up_proj"]))
    for n, p in model.named_parameters():  # non-zero B: the adapters change the output
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.05)
    return model


def _step(model, ids, autocast: bool = False):
    model.zero_grad()
    with HostSyncCounter() as c:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    grads = {n: p.grad.double().clone() for n, p in model.named_parameters() if p.requires_grad}
    return loss.detach().double(), grads, c


def _close(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("autocast", [False, True])
def test_fused_lora_gives_peft_loss_and_gradients_with_fewer_passes(autocast):
    model, ids = _model(), torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    loss, grads, ops = _step(model, ids, autocast)
    with fused_lora(model) as n:
        assert n == 2 * 4  # every adapted projection of both layers
        loss_f, grads_f, ops_f = _step(model, ids, autocast)
    tol = 2e-2 if autocast else 1e-5  # bf16 autocast: PEFT adds in another order of rounding
    assert abs(float(loss_f - loss)) < tol * abs(float(loss))
    for name, g in grads.items():
        assert _close(grads_f[name], g) < (5e-2 if autocast else 1e-5), name
    # PEFT: a multiply by the scale and an add over each adapted projection's output, and the multiply again in
    # backward; fused, the scale multiplies only the rank-sized gradients of the two small factors
    assert ops_f.ops["add"] <= ops.ops["add"] - n
    saved = 2 * 32 * (64 + 32 + 64 + 128) * (2 if autocast else 4)  # two output-sized multiplies per projection, 32 tokens
    assert ops.out_bytes["mul"] - ops_f.out_bytes["mul"] >= 0.9 * saved, (ops.out_bytes["mul"], ops_f.out_bytes["mul"])
    assert all("forward" not in m.__dict__ for m in model.modules())  # put back
    loss_after, _, _ = _step(model, ids, autocast)
    assert float(loss_after) == float(loss)


def test_fused_lora_leaves_dropout_and_disabled_adapters_to_peft():
    model = _model(dropout=0.1)
    with fused_lora(model) as n:
        assert n == 0  # a dropout mask per call: PEFT's own forward
    model = _model()
    ids = torch.randint(0, 128, (1, 8))
    with torch.no_grad():
        with model.disable_adapter():
            base = model(input_ids=ids).logits
        with fused_lora(model), model.disable_adapter():
            assert torch.equal(model(input_ids=ids).logits, base)


def test_liger_layers_change_nothing_without_cuda_or_liger():
    model = _model()
    if torch.cuda.is_available() and liger_available():
        pytest.skip("a CUDA machine with liger-kernel: tested by test_liger_layers_match_on_cuda")
    with liger_layers(model, None) as n:
        assert n == 0
        assert all("forward" not in m.__dict__ for m in model.modules())


def test_liger_layers_pick_llama_norms_and_silu_mlps(monkeypatch):
    """Which modules get Liger's kernels, and that the patched forwards compute the layers' own functions (Liger's
    kernels replaced by torch references here: they run only on CUDA)."""
    import types

    from qrecover.recovery import fused_layers as fl

    model = _model()
    ids = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    calls = {"rms": 0, "silu_mul": 0, "rope": 0}

    def rope(q, k, cos, sin):
        calls["rope"] += 1
        from transformers.models.llama.modeling_llama import rotate_half

        return q * cos[:, None] + rotate_half(q) * sin[:, None], k * cos[:, None] + rotate_half(k) * sin[:, None]

    def rms(x, w, eps, offset, mode, inplace):
        calls["rms"] += 1
        return w * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    def silu_mul(a, b):
        calls["silu_mul"] += 1
        return torch.nn.functional.silu(a) * b

    monkeypatch.setattr(fl, "liger_available", lambda: True)
    monkeypatch.setitem(sys.modules, "liger_kernel.ops.rms_norm",
                        types.SimpleNamespace(LigerRMSNormFunction=types.SimpleNamespace(apply=rms)))
    monkeypatch.setitem(sys.modules, "liger_kernel.ops.swiglu",
                        types.SimpleNamespace(LigerSiLUMulFunction=types.SimpleNamespace(apply=silu_mul)))
    monkeypatch.setitem(sys.modules, "liger_kernel.ops.rope",
                        types.SimpleNamespace(LigerRopeFunction=types.SimpleNamespace(apply=rope)))
    from transformers.models.llama import modeling_llama

    original = modeling_llama.apply_rotary_pos_emb
    with liger_layers(model, None) as n, torch.no_grad():
        assert n == 0  # on the CPU: nothing chosen
    with monkeypatch.context() as m:
        m.setattr(fl, "LIGER_DEVICES", ("cuda", "cpu"))  # the device checks only
        stack = contextlib.ExitStack()
        n = stack.enter_context(liger_layers(model, None))
        with stack, torch.no_grad():
            assert n == 2 * 3 + 1 + 1  # two norms and an MLP per layer, the final norm; Llama's rotary embedding
            out = model(input_ids=ids).logits
            with torch.autocast("cpu", dtype=torch.bfloat16):  # q, k in bf16, cos and sin in fp32: torch's own
                model(input_ids=ids)
    # the patched functions ran once per module and forward; the rotary embedding's only where all four share a dtype
    assert calls == {"rms": 2 * (2 * 2 + 1), "silu_mul": 2 * 2, "rope": 2}
    assert _close(out.double(), ref.double()) < 1e-6
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert modeling_llama.apply_rotary_pos_emb is original  # put back
    with monkeypatch.context() as m:  # nested: the inner context does not wrap the outer one's function again
        m.setattr(fl, "LIGER_DEVICES", ("cuda", "cpu"))
        with liger_layers(model) as outer, liger_layers(model) as inner:
            assert outer == 2 * 3 + 1 + 1 and inner == 2 * 3 + 1  # the modules again, not the modeling function
            assert modeling_llama.apply_rotary_pos_emb.original is original
    assert modeling_llama.apply_rotary_pos_emb is original


@pytest.mark.skipif(not liger_available(), reason="needs liger-kernel (qrecover[train-gpu])")
def test_liger_kernels_give_the_layers_loss_and_gradients_in_the_interpreter(monkeypatch):
    """Liger's own Triton kernel for the rotary embedding (forward and backward, q and k rotated in place) runs on the
    CPU under TRITON_INTERPRET=1 in place of transformers' function, with LoRA training: the same loss and adapter
    gradients, and the function put back after. (Liger's RMSNorm and SwiGLU kernels do not run in triton's
    interpreter: they call ``.to`` on scalar arguments, which it passes as Python floats; the test above checks their
    wiring, test_liger_layers_match_on_cuda the kernels.)"""
    from transformers.models.llama import modeling_llama

    from qrecover.recovery import fused_layers as fl

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs Liger's kernels in triton's interpreter")
    model, ids = _model(), torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    loss, grads, ops = _step(model, ids)
    monkeypatch.setattr(fl, "LIGER_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(fl, "LLAMA_NORMS", ())
    monkeypatch.setattr(fl, "SILU", ())
    original = modeling_llama.apply_rotary_pos_emb
    with liger_layers(model) as n, fused_lora(model):
        assert n == 1  # Llama's rotary embedding
        assert modeling_llama.apply_rotary_pos_emb is not original
        loss_l, grads_l, ops_l = _step(model, ids)
    assert modeling_llama.apply_rotary_pos_emb is original
    assert abs(float(loss_l - loss)) < 1e-5 * abs(float(loss))
    for name, g in grads.items():
        assert _close(grads_l[name], g) < 1e-5, name
    # rotate_half's cat of q and of k per layer, its negations and their backward: in Liger's kernel
    assert ops.ops["cat"] - ops_l.ops["cat"] == 2 * 2 and ops.ops["neg"] > 0 and ops.ops["slice_backward"] > 0
    assert ops_l.ops["neg"] == 0 and ops_l.ops["slice_backward"] == 0


@pytest.mark.skipif(not (torch.cuda.is_available() and liger_available()), reason="needs CUDA and liger-kernel")
def test_liger_layers_match_on_cuda():
    model = _model().cuda()
    ids = torch.randint(0, 128, (2, 16), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ref = model(input_ids=ids, labels=ids).loss
        with liger_layers(model) as n:
            assert n == 2 * 3 + 1 + 1  # two norms and an MLP per layer, the final norm; the rotary embedding
            out = model(input_ids=ids, labels=ids).loss
    assert abs(float(out - ref)) < 2e-2 * abs(float(ref))

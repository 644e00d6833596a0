"""Fused dequant-matmul and multi-adapter LoRA kernels (qrecover.kernels) against float64 references.

Without a GPU the Triton kernels run on CPU under triton's interpreter: the module fixture sets
``TRITON_INTERPRET=1`` before the kernel modules are imported (``@triton.jit`` reads it at decoration time)
and restores the environment afterwards. With a GPU the same tests run the compiled kernels on CUDA.
Every packed format ``qrecover compress`` writes is checked (palettize 2/3/4 with whole-row and per-block
tables, and 8, blockwise 2/3/4/8 symmetric/asymmetric, blocks 32/64/per-channel), at batch 1 (GEMV) and > 16
(tiled), with odd output counts that do not fill the last tile. The dispatch decision (``select``) is
pure and tested without triton. GPU-only tests are marked ``gpu``.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from kernel_helpers import CUDA, DEV, make_layer, ref64, rel_err

from qrecover import kernels
from qrecover.errors import QRecoverError
from qrecover.kernels import KernelChoice, layer_format, reference, select
from qrecover.kernels.formats import BLOCKWISE, Config
from qrecover.kernels.multi_adapter import MultiAdapterLinear, add_lora, lora_delta_reference, stack_adapters
from qrecover.packing import unpack

needs_triton = pytest.mark.skipif(
    not kernels.triton_available(),
    reason="triton is not installed: pip install 'qrecover[kernels]' (the kernel tests run on CPU under TRITON_INTERPRET=1)",
)
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


FORMATS = (
    [("palettize", b, dict(block_size=c)) for b in (2, 3, 4) for c in (None, 32)]
    + [("palettize", 8, dict(block_size=64))]  # 256-entry tables: gathered through L1, not registers
    + [("palettize", b, dict(group_size=1, error_feedback=False)) for b in (3, 4)]  # a table per row: embedding candidates
    + [("blockwise", b, dict(block_size=c, symmetric=s)) for b in (2, 3, 4, 8) for c in (32, 64, None) for s in (True, False)]
    # GPTQ: blockwise's tensors with block_size = group_size, served by the blockwise kernels
    + [("gptq", 4, dict(group_size=32, symmetric=False, act_order=True)), ("gptq", 3, dict(group_size=64, symmetric=True)),
       ("gptq", 2, dict(group_size=None, symmetric=False)), ("gptq", 8, dict(group_size=32, symmetric=True))]
)


@needs_triton
@pytest.mark.parametrize("scheme,bits,params", FORMATS, ids=lambda v: str(v))
def test_every_format_matches_float64(interp, scheme, bits, params):
    out_f = 48 if scheme == "palettize" else 40  # 40, 48: the last 32/64-row tile is partial
    layer = make_layer(scheme, bits, out_f, 128, bias=bits != 3, **params)
    for batch in (1, 20):  # GEMV (broadcast product) and tiled tl.dot
        x = torch.randn(batch, 128, device=DEV)
        y = kernels.fused_linear(layer, x)
        assert y.shape == (batch, out_f) and y.dtype == torch.float32
        assert rel_err(y, ref64(layer, x)) < 1e-5, (scheme, bits, params, batch)


@needs_triton
@pytest.mark.parametrize("dtype,tol", [(torch.float16, 2e-3), (torch.bfloat16, 1.5e-2)])
@pytest.mark.parametrize("scheme,bits,params", [("palettize", 3, dict(block_size=32)), ("blockwise", 4, dict(block_size=32, symmetric=False))])
def test_half_activations(interp, dtype, tol, scheme, bits, params):
    layer = make_layer(scheme, bits, 48, 96, **params)
    for batch in (1, 7, 33):  # broadcast GEMV, tl.dot GEMV on a 16-row tile, tiled
        x = torch.randn(batch, 96, device=DEV).to(dtype)
        y = kernels.fused_linear(layer, x)
        assert y.dtype == dtype
        ref = ref64(layer, x)
        assert rel_err(y, ref) < tol
        # as close to float64 as the reference path in the same dtype is
        assert rel_err(y, ref) < 3 * rel_err(reference.linear(layer, x), ref) + 1e-3


@needs_triton
def test_3bit_codes_decode_exactly_across_word_boundaries(interp):
    """Identity tables (lut[k] = k) and one-hot inputs read back every code: 3-bit codes 10 and 21 of each 32
    straddle 32-bit words."""
    layer = make_layer("palettize", 3, 16, 64, bias=False)
    layer.lut.copy_(torch.arange(8, dtype=torch.float16).expand_as(layer.lut))
    codes = unpack(layer.qdata.cpu(), 3, 16 * 64).view(16, 64).float()
    for cols in (range(0, 32), range(32, 64)):
        x = torch.eye(64, device=DEV)[list(cols)]
        y = kernels.fused_linear(layer, x)
        assert torch.equal(y.cpu(), codes[:, list(cols)].T)


@needs_triton
@pytest.mark.parametrize("cfg", [Config(1, 16, 32, 2, False), Config(2, 32, 32, 4, False), Config(16, 32, 32, 3, True),
                                 Config(32, 64, 32, 2, True)])
def test_split_k_configs_with_bias(interp, cfg):
    """Split-K writes fp32 partial sums and a second kernel adds them and the bias; uneven splits included."""
    layer = make_layer("blockwise", 3, 40, 160, block_size=32, symmetric=False)
    x = torch.randn(3, 160, device=DEV)
    assert rel_err(kernels.fused_linear(layer, x, config=cfg), ref64(layer, x)) < 1e-5


@needs_triton
def test_config_that_crosses_column_blocks_is_refused(interp):
    layer = make_layer("blockwise", 3, 40, 160, block_size=32)
    with pytest.raises(ValueError, match="block_k must divide cblock"):
        kernels.fused_linear(layer, torch.randn(3, 160, device=DEV), config=Config(2, 32, 64, 4, False))


@needs_triton
@pytest.mark.parametrize("batch", [1, 3, 4, 5, 16, 17, 64, 300])
def test_candidate_configs_are_valid(interp, batch):
    for cblock in (32, 64, 96, 4096):
        fmt = layer_format(make_layer("blockwise", 4, 8, cblock, block_size=None))
        for fp32 in (False, True):
            configs = interp.candidate_configs(fmt, batch, fp32)
            assert configs
            for c in configs:
                assert cblock % c.block_k == 0 and (c.block_m >= 16 or not c.use_dot)
                assert (c.block_m <= 16) == (batch <= 16) or c.block_m == 16  # GEMV tiles for decoding batches
                # the tensor-core kernels above batch 4; at batch 2-4 (16-bit) also the decode-and-dot kernel's
                # transposed product, one 16-input tile
                assert c.use_dot == (batch > 4) or (2 <= batch <= 4 and not fp32 and c.swap and c.block_m == 16)
            if 2 <= batch <= 4:
                assert any(c.swap for c in configs) != fp32
                assert not (fp32 and c.use_dot) or c.block_m * c.block_n * c.block_k <= 32 * 64 * 32


@needs_triton
def test_leading_dims_and_strided_input(interp):
    layer = make_layer("palettize", 4, 32, 64)
    x = torch.randn(2, 3, 128, device=DEV)[..., ::2]  # (2, 3, 64), stride 2 along features
    y = kernels.fused_linear(layer, x)
    assert y.shape == (2, 3, 32)
    assert rel_err(y.reshape(6, 32), ref64(layer, x.reshape(6, 64))) < 1e-5


def test_fused_linear_refuses_unsupported_layer():
    layer = make_layer("blockwise", 4, 8, 48, block_size=None)  # 48 is not a multiple of 32
    with pytest.raises(QRecoverError, match="in_features=48"):
        kernels.fused_linear(layer, torch.randn(1, 48, device=DEV))


@needs_triton
def test_kernels_compile_for_h100_without_a_gpu():
    """The interpreter checks values, not compilation: compile for sm_90 with triton's own ptxas (no GPU needed)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    r = subprocess.run([sys.executable, "-m", "qrecover.kernels.compile_check", "--smoke"], capture_output=True,
                       text=True, env=env, cwd=Path(__file__).resolve().parents[1], timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [line for line in r.stdout.splitlines() if line.startswith("| ") and "registers" not in line]
    # 6 dequant-matmul variants (the batch-16 one also as the transposed product) + split-K reduce + lora shrink/expand
    # (fp16, int8) + 3 r4 + 2 kd + 2 error feedback
    assert len(rows) == 18 and all(int(row.split("|")[2]) > 0 for row in rows), r.stdout
    feedback = [row for row in rows if row.startswith("| error feedback block")]
    assert len(feedback) == 2 and all(int(row.split("|")[3]) == 0 for row in feedback), r.stdout
    lora = [row for row in rows if row.startswith("| lora ")]
    assert len(lora) == 4 and all(int(row.split("|")[3]) == 0 for row in lora), r.stdout  # int8 variants too, no spill
    r4 = [row for row in rows if row.startswith("| r4 rotation 1536")]
    assert len(r4) == 1 and int(r4[0].split("|")[3]) == 0, r.stdout  # the default model's size: no spills
    kd = [row for row in rows if row.startswith("| kd loss")]
    # no spill, and <= 80 registers: at least 3 programs of 8 warps per SM (3.6: 64, 3.9: 73-76)
    assert len(kd) == 2 and all(int(row.split("|")[3]) == 0 and int(row.split("|")[2]) <= 80 for row in kd), r.stdout


# --- dispatch: a pure decision, no triton needed ---------------------------------------------------------


def test_select_decisions(monkeypatch, caplog):
    layer = make_layer("palettize", 3, 32, 64)
    monkeypatch.setattr(kernels, "triton_available", lambda: True)
    monkeypatch.delenv("QRECOVER_KERNELS", raising=False)
    assert select(layer, "cpu", 1) == KernelChoice("reference", "device cpu (fused kernels run on CUDA)")
    assert select(layer, "cuda", 1).name == "gemv"
    assert select(layer, "cuda", 16).name == "gemv"
    assert select(layer, "cuda", 17).name == "tiled"
    monkeypatch.setenv("QRECOVER_KERNELS", "0")
    assert select(layer, "cuda", 1) == KernelChoice("reference", "QRECOVER_KERNELS=0")
    monkeypatch.setenv("QRECOVER_KERNELS", "1")
    assert "in_features=48" in select(make_layer("blockwise", 4, 8, 48, block_size=None), "cuda", 1).reason
    six = select(make_layer("palettize", 6, 16, 64), "cuda", 1)
    assert six.name == "reference" and "bits=6" in six.reason
    monkeypatch.setattr(kernels, "triton_available", lambda: False)
    assert "pip install 'qrecover[kernels]'" in select(layer, "cuda", 1).reason
    # each decision is logged once
    monkeypatch.setattr(kernels, "triton_available", lambda: True)
    monkeypatch.setattr(kernels, "_logged", set())
    with caplog.at_level(logging.INFO, logger="qrecover.kernels"):
        for _ in range(3):
            select(layer, "cuda", 2)
        select(layer, "cuda", 40)
    msgs = [r.getMessage() for r in caplog.records if r.name == "qrecover.kernels"]
    assert len(msgs) == 2 and "gemv" in msgs[0] and "tiled" in msgs[1]


def test_layer_format_reads_the_stored_geometry():
    fmt = layer_format(make_layer("palettize", 4, 32, 128, group_size=16, block_size=64))
    assert (fmt.bits, fmt.out_f, fmt.in_f, fmt.group, fmt.cblock, fmt.has_zp) == (4, 32, 128, 16, 64, False)
    fmt = layer_format(make_layer("blockwise", 2, 8, 96, block_size=None, symmetric=False))
    assert (fmt.group, fmt.cblock, fmt.has_zp) == (1, 96, True)
    # GPTQ is blockwise's layout with block_size = group_size (the default, asymmetric: zero points stored)
    gptq = make_layer("gptq", 4, 8, 128, group_size=64)
    fmt = layer_format(gptq)
    assert (fmt.scheme, fmt.bits, fmt.group, fmt.cblock, fmt.has_zp) == (BLOCKWISE, 4, 1, 64, True)
    assert "zero_point" in gptq._tensor_names
    fmt = layer_format(make_layer("gptq", 3, 8, 96, group_size=None, symmetric=True))
    assert (fmt.scheme, fmt.cblock, fmt.has_zp) == (BLOCKWISE, 96, False)


def test_cpu_forward_is_the_reference_path_bit_for_bit():
    layer = make_layer("palettize", 3, 32, 64).cpu()
    x = torch.randn(5, 64)
    assert torch.equal(layer(x), F.linear(x, layer.dequantize(x.dtype), layer.bias))
    assert torch.equal(kernels.linear(layer, x), layer(x))  # CPU: select falls back to the reference


# --- multi-adapter LoRA ---------------------------------------------------------------------------------


def _adapters(in_f: int, out_f: int, ranks: tuple[int, ...], seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(r, in_f, generator=g) / in_f**0.5, torch.randn(out_f, r, generator=g), 0.5 + i)
            for i, r in enumerate(ranks)]


def _one_by_one64(x, adapters, index):
    """Each token through its own adapter, PEFT's formula ``s * B (A x)``, in float64."""
    out = torch.zeros(x.shape[0], adapters[0][1].shape[0], dtype=torch.float64)
    for m, a in enumerate(index.tolist()):
        if a >= 0:
            A, B, s = adapters[a]
            out[m] = s * (B.double() @ (A.double() @ x[m].double().cpu()))
    return out


def test_stack_adapters_pads_ranks():
    lora_a, lora_b, scaling = stack_adapters(_adapters(64, 24, (4, 8)))
    assert lora_a.shape == (2, 8, 64) and lora_b.shape == (2, 24, 8) and scaling.tolist() == [0.5, 1.5]
    assert not lora_a[0, 4:].any() and not lora_b[0, :, 4:].any()


@needs_triton
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 3e-3)])
@pytest.mark.parametrize("ranks", [(8, 4, 16), (8, 4, 5), (12, 4, 3)])
def test_multi_adapter_kernels_match_one_by_one(interp, dtype, tol, ranks):
    """Stacked ranks 16 (the expand reads each row of ``B`` unmasked: ``FULL_R``), 8 and 12 (padded to 16, masked)."""
    adapters = _adapters(96, 40, ranks)
    lora_a, lora_b, scaling = stack_adapters(adapters)
    index = torch.tensor([2, -1, 0, 1, 2, 2, -1, 0, 1, 1, 0, 2, -1, 2, 0, 1, 1, 2, 0])  # 19 tokens, 3 adapters and none
    x = torch.randn(19, 96)
    y0 = torch.randn(19, 40)
    ref = y0.double() + _one_by_one64(x.to(dtype), adapters, index)
    dev = lambda t: t.to(DEV)  # noqa: E731 (a short local helper)
    out = add_lora(dev(y0.to(dtype)), dev(x.to(dtype)), dev(lora_a.to(dtype)), dev(lora_b.to(dtype)), dev(scaling),
                   dev(index), use_kernels=True)
    assert out.dtype == dtype
    assert rel_err(out.cpu(), ref) < tol
    assert torch.equal(out[index == -1].cpu(), y0.to(dtype)[index == -1])  # no adapter: the base output untouched
    # the torch reference (one by one over the distinct adapters) agrees too
    assert rel_err(y0 + lora_delta_reference(x, lora_a, lora_b, scaling, index), y0.double() + _one_by_one64(x, adapters, index)) < 1e-5


def test_shrink_splits_fill_the_gpu():
    """The shrink's programs (tokens x input splits) fill an H100's 132 SMs twice over where the layer has enough
    columns (one split per 128 at the least, at most 64 splits): 32 programs at batch 1 and 512 at batch 16 on a
    4096-input layer, where one split per 1,024 columns ran 4 and 64; the splits cover the inputs exactly."""
    from qrecover.kernels.multi_adapter_kernels import MAX_SPLITS, shrink_splits

    for m in (1, 2, 4, 16, 64, 300):
        for k in (128, 4096, 14336):
            block_k = 128
            k_split, n = shrink_splits(m, k, block_k)
            assert k_split % block_k == 0 and (n - 1) * k_split < k <= n * k_split, (m, k)
            assert m * n >= 2 * 132 or 2 * n > min(k // block_k, MAX_SPLITS), (m, k, n)  # (k_split rounds up)
    assert shrink_splits(1, 4096)[1] == 32 and shrink_splits(16, 4096)[1] == 32 and shrink_splits(1, 14336)[1] == 56


_EXPAND_SASS = """
import json, re
from triton.backends.compiler import GPUTarget
from qrecover.kernels import compile_check as cc, multi_adapter_kernels as mak
cc.ALIGNED = True  # as the launcher specializes: strides that are multiples of 16 (B's row stride is the rank, 16)
cc.ALIGNED_INTS = ("N", "stride_bn", "stride_bo", "stride_ym")
out = {}
for w in ("fp16", "i8"):
    sig = {"t_ptr": "*fp32", "b_ptr": f"*{w}", "b_scale_ptr": "*fp32", "scale_ptr": "*fp32", "idx_ptr": "*i64",
           "y_ptr": "*fp16", **{k: "i32" for k in ("M", "N", "R", "n_splits", "stride_bn", "stride_bo", "stride_ym")}}
    for full in (False, True):
        k = cc._compile(mak._expand_kernel, sig, dict(INT8=w == "i8", R_PAD=16, BLOCK_N=128, S_PAD=64, FULL_R=full),
                        GPUTarget("cuda", 90, 32), num_warps=4)
        sass = cc.sass(k)
        out[f"{w} {full}"] = [len(re.findall(r"LDG\\.E\\.128", sass)), len(re.findall(r"LDG\\.E\\.(?:U16|U8)\\b", sass))]
print(json.dumps(out))
"""


@needs_triton
def test_expand_reads_adapter_rows_by_vector_loads():
    """Compiled for sm_90 (no GPU needed): with the rank a power of two (``FULL_R``, rank 16), the expand reads each row
    of ``B`` (16 ranks: 32 bytes fp16, 16 int8) by 128-bit loads; with a mask along the rank it read them one element at
    a time (16 two-byte or one-byte loads per row), as it still does for a padded rank."""
    from test_gemv import _compiled
    got = _compiled(_EXPAND_SASS)
    for w in ("fp16", "i8"):
        masked, full = got[f"{w} False"], got[f"{w} True"]
        assert masked[1] >= 16 and full[1] <= 1 and full[0] > masked[0], got


@needs_triton
def test_multi_adapter_kernels_sum_many_splits(interp):
    """One token over 2,048 inputs: the shrink writes 64 splits (the most), which the expand reads as one tile."""
    from qrecover.kernels.multi_adapter_kernels import MAX_SPLITS, shrink

    adapters = _adapters(2048, 24, (16, 8))
    lora_a, lora_b, scaling = stack_adapters(adapters)
    x, y0 = torch.randn(2, 2048), torch.randn(2, 24)
    index = torch.tensor([1, 0])
    ref = y0.double() + _one_by_one64(x, adapters, index)
    assert shrink(x.to(DEV), lora_a.to(DEV), index.to(DEV)).shape[0] == MAX_SPLITS
    out = add_lora(y0.to(DEV), x.to(DEV), lora_a.to(DEV), lora_b.to(DEV), scaling.to(DEV), index.to(DEV), use_kernels=True)
    assert rel_err(out.cpu(), ref) < 1e-5  # (in place: on the CPU, out is y0)


@needs_triton
def test_multi_adapter_linear_on_a_quantized_base(interp):
    base = make_layer("palettize", 3, 48, 64)
    adapters = _adapters(64, 48, (16, 16))
    layer = MultiAdapterLinear.from_adapters(base, adapters).to(DEV)
    x = torch.randn(2, 5, 64, device=DEV)
    index = torch.tensor([0, 1, -1, 1, 0, 0, -1, -1, 1, 0])
    ref = ref64(base, x.reshape(10, 64)).cpu() + _one_by_one64(x.reshape(10, 64), adapters, index)
    for use_kernels in (False, True):
        y = layer(x, index, use_kernels=use_kernels)
        assert y.shape == (2, 5, 48)
        assert rel_err(y.reshape(10, 48).cpu(), ref) < 1e-5


@needs_triton
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 3e-3)])
def test_int8_adapters_match_float64_of_their_stored_values(interp, dtype, tol, monkeypatch):
    """int8 adapters (codes and row scales, as 8-bit adapter files store them) through the kernels equal the float64
    product of codes x scales; the shrink's workspace needs no zero fill (filled with NaN here, the result is the same)."""
    from qrecover.adapters.serve import quantize_adapter
    from qrecover.kernels.multi_adapter import stack_int8

    adapters = _adapters(96, 40, (8, 4, 16))
    q = [quantize_adapter(*a) for a in adapters]
    lora_a, a_scale, lora_b, b_scale, scaling = stack_int8(q)
    assert lora_a.dtype == lora_b.dtype == torch.int8 and a_scale.shape == (3, 16) and b_scale.shape == (3, 40)
    stored = [((qa.double() * sa.double()[:, None]).float(), (qb.double() * sb.double()[:, None]).float(), s)
              for qa, sa, qb, sb, s in q]
    index = torch.tensor([2, -1, 0, 1, 2, 2, -1, 0, 1, 1, 0, 2, -1, 2, 0, 1, 1, 2, 0])
    x, y0 = torch.randn(19, 96), torch.randn(19, 40)
    ref = y0.double() + _one_by_one64(x.to(dtype), stored, index)
    empty = torch.empty

    def nan_empty(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", nan_empty)
    dev = lambda t: t.to(DEV)  # noqa: E731 (a short local helper)
    out = add_lora(dev(y0.to(dtype)), dev(x.to(dtype)), dev(lora_a), dev(lora_b), dev(scaling), dev(index), use_kernels=True,
                   a_scale=dev(a_scale), b_scale=dev(b_scale))
    assert out.dtype == dtype and rel_err(out.cpu(), ref) < tol
    assert torch.equal(out[index == -1].cpu(), y0.to(dtype)[index == -1])
    ref_path = y0 + lora_delta_reference(x, lora_a, lora_b, scaling, index, a_scale, b_scale)
    assert rel_err(ref_path, y0.double() + _one_by_one64(x, stored, index)) < 1e-5
    # int8 weights without their scales are refused, naming what is missing
    with pytest.raises(QRecoverError, match="b_scale of shape \\(3, 40\\)"):
        add_lora(y0, x, lora_a, lora_b, scaling, index, a_scale=a_scale)


def test_multi_adapter_shape_errors():
    base = make_layer("palettize", 3, 48, 64).cpu()
    layer = MultiAdapterLinear.from_adapters(base, _adapters(64, 48, (4,)))
    with pytest.raises(QRecoverError, match="one adapter \\(or -1\\) per token"):
        layer(torch.randn(3, 64), torch.tensor([0, 0]))


def _peft_adapter(ckpt, out, rank: int, targets: list[str], seed: int):
    """A PEFT adapter on the loaded checkpoint with random (non-zero) A and B, saved in PEFT's format."""
    from peft import LoraConfig, get_peft_model

    from qrecover.loading import load

    model = get_peft_model(load(ckpt), LoraConfig(r=rank, lora_alpha=2.0 * rank + seed, target_modules=targets))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    model.save_pretrained(out)
    return out


def test_attach_adapters_serves_peft_adapters_per_sequence(tiny_ckpt, tmp_path):
    """Three sequences through one model, each with its own adapter (or none), match PEFT run adapter by adapter."""
    from peft import PeftModel

    from qrecover.adapters.serve import attach_adapters
    from qrecover.loading import load

    dirs = [_peft_adapter(tiny_ckpt, tmp_path / "a0", 4, ["q_proj", "v_proj"], 0),
            _peft_adapter(tiny_ckpt, tmp_path / "a1", 2, ["q_proj", "down_proj"], 1)]
    ids = torch.randint(0, 1000, (3, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = load(tiny_ckpt)(input_ids=ids).logits
        expected = [PeftModel.from_pretrained(load(tiny_ckpt), str(dirs[i])).eval()(input_ids=ids[i:i + 1]).logits[0]
                    for i in range(2)] + [base[2]]
        model = load(tiny_ckpt)
        set_index = attach_adapters(model, dirs)
        set_index(torch.tensor([0, 1, -1]))
        got = model(input_ids=ids).logits
    for i in range(3):
        assert rel_err(got[i], expected[i].double()) < 1e-5, i
    for i in range(2):  # the adapters do change the output
        assert rel_err(expected[i], base[i].double()) > 1e-3, i


def test_attach_adapters_serves_8bit_adapter_directories_as_their_stored_codes(tiny_ckpt, tmp_path):
    """An 8-bit adapter directory is served as its int8 codes and row scales (read, not re-quantized), and the model
    matches PEFT on the directory's fp16 expansion of the same values to fp16 rounding."""
    from peft import PeftModel
    from safetensors.torch import load_file, save_file

    from qrecover.adapters.int8 import INT8_FILE, save_int8
    from qrecover.adapters.serve import attach_adapters
    from qrecover.kernels.multi_adapter import MultiAdapterLinear
    from qrecover.loading import load

    d = _peft_adapter(tiny_ckpt, tmp_path / "a0", 4, ["q_proj", "down_proj"], 0)
    _, expanded = save_int8(load_file(str(d / "adapter_model.safetensors")), d / INT8_FILE)
    save_file({k: v.contiguous() for k, v in expanded.items()}, str(d / "adapter_model.safetensors"))
    stored = load_file(str(d / INT8_FILE))
    ids = torch.randint(0, 1000, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = PeftModel.from_pretrained(load(tiny_ckpt), str(d)).eval()(input_ids=ids[:1]).logits[0]
        base = load(tiny_ckpt)(input_ids=ids[1:]).logits[0]
        model = load(tiny_ckpt)
        attach_adapters(model, [d])(torch.tensor([0, -1]))  # int8 chosen by itself: the directory is 8-bit
        got = model(input_ids=ids).logits
    layer = model.get_submodule("model.layers.0.self_attn.q_proj")
    assert isinstance(layer, MultiAdapterLinear) and layer.int8
    assert torch.equal(layer.lora_a[0], stored["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"])
    assert torch.equal(layer.b_scale[0], stored["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight_scale"])
    assert rel_err(got[0], expected.double()) < 1e-3 and rel_err(got[1], base.double()) < 1e-6


# --- real device ----------------------------------------------------------------------------------------


@gpu
@needs_cuda
@needs_triton
def test_cuda_forward_uses_the_fused_kernel(monkeypatch):
    monkeypatch.setenv("QRECOVER_KERNELS", "1")  # forced: the measured dispatch may prefer the dense path
    layer = make_layer("palettize", 3, 256, 512)
    calls = []
    real = kernels.reference.linear
    monkeypatch.setattr(kernels.reference, "linear", lambda *a: calls.append(1) or real(*a))
    with torch.no_grad():
        for batch in (1, 16, 64):
            x = torch.randn(batch, 512, device="cuda", dtype=torch.float16)
            assert select(layer, x.device, batch).fused
            assert rel_err(layer(x), ref64(layer, x)) < 2e-3
    assert not calls  # never fell back
    monkeypatch.setenv("QRECOVER_KERNELS", "0")
    with torch.no_grad():
        layer(torch.randn(1, 512, device="cuda", dtype=torch.float16))
    assert calls == [1]


@gpu
@needs_cuda
@needs_triton
def test_loaded_checkpoint_moved_to_cuda_matches_cpu(tiny_ckpt):
    from qrecover.loading import load

    model = load(tiny_ckpt)
    ids = torch.randint(0, 1000, (1, 12))
    with torch.no_grad():
        cpu_logits = model(input_ids=ids).logits
        model.to("cuda")
        cuda_logits = model(input_ids=ids.cuda()).logits.cpu()
    assert rel_err(cuda_logits, cpu_logits.double()) < 1e-3


@gpu
@needs_cuda
@needs_triton
def test_measured_dispatch_on_cuda(monkeypatch):
    """Unforced: each batch bucket is timed once on the GPU, and whichever path wins gives the reference's output."""
    monkeypatch.delenv("QRECOVER_KERNELS", raising=False)
    monkeypatch.setattr(kernels.dispatch, "DECISIONS", {})
    layer = make_layer("blockwise", 4, 256, 512, block_size=64)
    with torch.no_grad():
        for batch in (1, 64):
            x = torch.randn(batch, 512, device="cuda", dtype=torch.float16)
            assert rel_err(layer(x), ref64(layer, x)) < 2e-3
    assert sorted(k[1] for k in kernels.dispatch.DECISIONS) == [1, 64]
    assert set(kernels.dispatch.DECISIONS.values()) <= {"fused", "dense", "int4"}

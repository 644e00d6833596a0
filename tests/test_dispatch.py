"""The measured dispatch (qrecover.kernels.select/linear + qrecover.kernels.dispatch) with an injected timer.

The fused path is made reachable on CPU by patching ``kernels.gpu_device`` (the device check), the kernels then
running under triton's interpreter. Checked: the policy keeps the faster measured path per batch bucket and
dtype and times each kind once; a layer keeps its dense copy only when the dense path wins and memory allows;
training, a dense cache and ``QRECOVER_KERNELS=0/1`` override it; and a recovery training step of the tiny
model with LoRA makes no fused-kernel call while the same model in inference does.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from kernel_helpers import DEV, make_layer, ref64, rel_err

from qrecover import kernels
from qrecover.adapters.lora import attach_lora
from qrecover.kernels import dispatch
from qrecover.loading import load
from qrecover.recovery.config import RecoverConfig
from qrecover.recovery.objective import step_loss


class FakeTimer:
    """``timer(name, fn)``: runs ``fn`` (so the timed closures are checked), records the call, returns a set time."""

    def __init__(self, times: dict[int, dict[str, float]]):
        self.times, self.calls, self.outputs = times, [], {}

    def __call__(self, name, fn):
        out = fn()
        bucket = dispatch.bucket(out.numel() // out.shape[-1])
        self.calls.append((bucket, name))
        self.outputs[(bucket, name)] = out
        return self.times[bucket][name]


@pytest.fixture
def on_gpu(monkeypatch, interp):
    """Every device counts as a GPU for the dispatch; fresh decisions; fused calls counted."""
    monkeypatch.setattr(kernels, "gpu_device", lambda device: True)
    monkeypatch.setattr(kernels, "triton_available", lambda: True)
    monkeypatch.delenv("QRECOVER_KERNELS", raising=False)
    monkeypatch.setattr(dispatch, "DECISIONS", {})
    fused_calls = []
    real = interp.quant_matmul
    monkeypatch.setattr(interp, "quant_matmul", lambda *a, **k: fused_calls.append(a[0].shape[0]) or real(*a, **k))
    return fused_calls


def test_policy_keeps_the_faster_measured_path_per_bucket(on_gpu, monkeypatch):
    timer = FakeTimer({1: {"fused": 1.0, "dense": 2.0}, 32: {"fused": 3.0, "dense": 1.0}})
    monkeypatch.setattr(dispatch, "timer", timer)
    layer = make_layer("palettize", 3, 48, 64)
    with torch.no_grad():
        x1, x20 = torch.randn(1, 64, device=DEV), torch.randn(20, 64, device=DEV)
        assert rel_err(layer(x1), ref64(layer, x1)) < 1e-5
        assert layer._dispatch_dense is None  # fused won at batch 1: the copy made for timing is dropped
        assert rel_err(layer(x20), ref64(layer, x20)) < 1e-5
        assert layer._dispatch_dense is not None  # dense won at batch 20 (bucket 32): the layer keeps it
        for key, out in timer.outputs.items():  # both timed closures computed the layer's output
            x = x1 if key[0] == 1 else x20
            assert rel_err(out, ref64(layer, x)) < 1e-5, key
        assert timer.calls == [(1, "fused"), (1, "dense"), (32, "fused"), (32, "dense")]
        n_fused = len(on_gpu)
        layer(x1), layer(torch.randn(17, 64, device=DEV)), layer(x20)  # decided: no more timing
        assert timer.calls == [(1, "fused"), (1, "dense"), (32, "fused"), (32, "dense")]
        assert len(on_gpu) == n_fused + 1  # batch 1 fused; bucket 32 on the dense copy
        assert kernels.select(layer, x20.device, 20, torch.float32).name == "dense"
        assert kernels.select(layer, x1.device, 1, torch.float32).name == "gemv"
        assert kernels.select(layer, x1.device, 1, torch.float16).pending  # another dtype is another decision
        monkeypatch.setattr(dispatch, "DECISIONS", {})
        timer.times[1] = {"fused": 5.0, "dense": 1.0}
        layer(x1)
        assert timer.calls[-1] == (1, "dense") and dispatch.DECISIONS[dispatch.key(kernels.layer_format(layer), 1, torch.float32,
                                                                                    x1.device)] == "dense"


def test_dense_copy_needs_memory_and_decisions_are_shared_by_shape(on_gpu, monkeypatch):
    monkeypatch.setattr(dispatch, "timer", FakeTimer({4: {"fused": 3.0, "dense": 1.0}}))
    first, second = make_layer("blockwise", 4, 40, 64, block_size=32), make_layer("blockwise", 4, 40, 64, block_size=32, seed=1)
    x = torch.randn(3, 64, device=DEV)
    with torch.no_grad():
        first(x)
        assert first._dispatch_dense is not None
        monkeypatch.setattr(dispatch, "free_memory", lambda device: 40 * 64 * 4 * 3)  # a copy would exceed a quarter
        n = len(on_gpu)
        assert rel_err(second(x), ref64(second, x)) < 1e-5  # decided "dense", no room: runs fused, not timed again
        assert second._dispatch_dense is None and len(on_gpu) == n + 1
        monkeypatch.setattr(dispatch, "DECISIONS", {})
        third = make_layer("blockwise", 4, 40, 64, block_size=32, seed=2)
        third(x)  # no room for a dense copy: only the fused path is timed
        assert dispatch.timer.calls[-1] == (4, "fused") and third._dispatch_dense is None
        first.to(torch.float32)  # .to() drops the dispatch's copy
        assert first._dispatch_dense is None


def test_training_dense_cache_and_env_override_the_measurement(on_gpu, monkeypatch):
    timer = FakeTimer({1: {"fused": 1.0, "dense": 2.0}})
    monkeypatch.setattr(dispatch, "timer", timer)
    layer, x = make_layer("palettize", 4, 32, 64), torch.randn(1, 64, device=DEV)
    layer.train()
    layer(x)  # grad enabled and the module in training mode: reference, nothing timed, nothing fused
    assert not on_gpu and not timer.calls
    assert kernels.select(layer, x.device, 1, torch.float32, training=True).reason == "training: the dense path"
    layer.eval()
    cached = make_layer("palettize", 4, 32, 64)
    cached.cache = True
    with torch.no_grad():
        cached(x)
        assert not on_gpu and not timer.calls and cached._dense is not None
        monkeypatch.setenv("QRECOVER_KERNELS", "1")  # forced: fused, even in training mode, never timed
        cached(x)
        layer.train()
        layer(x)
        assert len(on_gpu) == 2 and not timer.calls
        monkeypatch.setenv("QRECOVER_KERNELS", "0")
        layer.eval()
        layer(x)
        assert len(on_gpu) == 2 and not timer.calls
    monkeypatch.setenv("QRECOVER_KERNELS", "1")
    assert kernels.select(layer, x.device, 1, torch.float32, needs_grad=True).name == "reference"  # no backward


def test_recovery_training_step_makes_no_fused_call(on_gpu, monkeypatch, tiny_ckpt):
    """One recovery step (LoRA on the tiny compressed model, the recovery loss, backward, optimizer step): the
    dense path everywhere. The same model in inference does reach the fused kernel, so the count can fail."""
    monkeypatch.setattr(dispatch, "timer", lambda name, fn: {"fused": 1.0, "dense": 2.0}[name])
    model = attach_lora(load(tiny_ckpt).to(DEV), rank=4)
    cfg = RecoverConfig(objective="ce", loss_chunk=8)
    ids = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(0)).to(DEV)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model.train()
    loss = step_loss(model, None, ids, ids.clone(), cfg, contextlib.nullcontext)
    loss.backward()
    optimizer.step()
    assert torch.isfinite(loss) and not on_gpu
    model.eval()
    with torch.no_grad():
        model(input_ids=ids[:1, :1])
    assert len(on_gpu) >= 7  # every quantized projection of a layer, batch 1


def test_torch_int4_is_a_candidate_for_blockwise_4bit(on_gpu, monkeypatch):
    """Blockwise 4-bit in a geometry torch's int4 kernels take: timed too, kept when fastest, same numbers. On CUDA
    in bf16, the one activation dtype torch's CUDA int4 kernel takes (fp32 is dropped there, as the dispatch should:
    it failed so on an H100 before the test used bf16); the output's rounding sets the tolerance."""
    timer = FakeTimer({1: {"fused": 2.0, "dense": 3.0, "int4": 1.0}, 4: {"fused": 1.0, "dense": 3.0, "int4": 2.0}})
    monkeypatch.setattr(dispatch, "timer", timer)
    dtype, tol = (torch.bfloat16, 1e-2) if DEV == "cuda" else (torch.float32, 1e-5)
    layer = make_layer("blockwise", 4, 48, 256, block_size=64, symmetric=False)
    x = torch.randn(1, 256, device=DEV, dtype=dtype)
    with torch.no_grad():
        assert rel_err(layer(x), ref64(layer, x)) < tol
        assert (1, "int4") in timer.calls and layer._dispatch_int4 is not None and layer._dispatch_dense is None
        assert rel_err(timer.outputs[(1, "int4")], ref64(layer, x)) < tol
        n = len(on_gpu)
        layer(x)
        assert len(on_gpu) == n  # int4 kept: no fused call
        assert kernels.select(layer, x.device, 1, dtype).name == "int4"
        x4 = torch.randn(3, 256, device=DEV, dtype=dtype)
        assert rel_err(layer(x4), ref64(layer, x4)) < tol and len(on_gpu) > n  # bucket 4: fused was faster
        assert layer._dispatch_int4 is not None  # still serves bucket 1
        other = make_layer("blockwise", 4, 48, 256, block_size=64, seed=3)  # symmetric: another format, measured anew
        timer.times[1] = {"fused": 1.0, "dense": 3.0, "int4": 2.0}
        other(x)
        assert other._dispatch_int4 is None  # made only to be timed, then dropped


def test_training_and_dense_cache_answer_before_select(on_gpu, monkeypatch):
    """A training module or a dense cache takes the reference path without calling select (its logging, cache and
    decision table made torch.compile recompile per grad mode and autocast state on an H100); the same numbers."""
    def refuse(*a, **k):
        raise AssertionError("select called")

    layer, x = make_layer("palettize", 4, 32, 64), torch.randn(3, 64, device=DEV)
    layer.train()
    monkeypatch.setattr(kernels, "select", refuse)
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            assert rel_err(layer(x), ref64(layer, x)) < 1e-6
    layer.eval()
    layer.cache = True
    with torch.no_grad():
        assert rel_err(layer(x), ref64(layer, x)) < 1e-6 and layer._dense is not None
    assert not on_gpu
    monkeypatch.setenv("QRECOVER_KERNELS", "1")  # forced: select decides (fused), as before
    with pytest.raises(AssertionError, match="select called"), torch.no_grad():
        layer(x)


def test_tied_head_is_a_packed_linear_to_the_dispatch(on_gpu, monkeypatch):
    """A tied ``QuantLMHead`` on a GPU takes the measured path of a packed linear layer: the embedding's dense cache
    (made for lookups) does not send it to the dense matmul; the dense candidate it times is that cache (no second
    copy); in training it is the dense path again, and the CPU path is ``F.linear`` on the embedding's weight."""
    from qrecover.qlinear import QuantEmbedding, QuantLMHead
    from qrecover.schemes import get_quantizer

    timer = FakeTimer({1: {"fused": 1.0, "dense": 2.0}, 32: {"fused": 3.0, "dense": 1.0}})
    monkeypatch.setattr(dispatch, "timer", timer)
    w = torch.randn(96, 64, generator=torch.Generator().manual_seed(0))
    emb = QuantEmbedding(get_quantizer("blockwise", block_size=32, symmetric=False).quantize(w, 4, {}), cache=True).to(DEV)
    head = QuantLMHead(emb).eval()
    assert kernels.layer_format(head) == kernels.layer_format(emb) and head.shape == (96, 64)
    with torch.no_grad():
        emb(torch.tensor([[1, 5, 7]], device=DEV))  # lookups decode their rows: no dense table is made for them
        assert emb._dense is None
        emb.dequantize()  # a dense cache (e.g. made by code that read emb.weight): the head may use it, never copy it
        cache = emb._dense
        assert cache is not None and cache.dtype == torch.float32
        x1, x20 = torch.randn(1, 64, device=DEV), torch.randn(20, 64, device=DEV)
        w64 = emb._quantizer.dequantize(emb.packed, torch.float64)  # not emb.dequantize: that would replace its cache
        ref = lambda x: x.double() @ w64.T  # noqa: E731
        assert rel_err(head(x1), ref(x1)) < 1e-5
        assert on_gpu and timer.calls == [(1, "fused"), (1, "dense")]  # timed, not sent to the cache
        assert head._dispatch_dense is None and emb._dense is cache  # fused won; the cache is the embedding's still
        assert rel_err(head(x20), ref(x20)) < 1e-5
        # dense won at batch 20: its weight is the embedding's cache (the same memory), not a copy
        assert head._dispatch_dense.data_ptr() == cache.data_ptr() and emb._dense is cache
        n = len(on_gpu)
        head.train()
        assert rel_err(head(x1), ref(x1)) < 1e-5 and len(on_gpu) == n  # training: the dense path
    head.to(DEV)
    assert head._dispatch_dense is None  # a move drops what the kernels kept
    monkeypatch.setattr(kernels, "gpu_device", lambda device: False)
    monkeypatch.setattr(head.embedding, "dequantize", lambda dtype=None: cache.to(dtype or cache.dtype))
    assert torch.equal(head.eval()(x1), torch.nn.functional.linear(x1, cache)) and len(on_gpu) == n

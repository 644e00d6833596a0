"""The training step never waits on the device (issue 23): no host synchronisation between logging steps.

Runs real recovery training (distillation, chunked fused loss, 2 micro-batches per step) with every optimizer
step under :class:`~qrecover.recovery.host_sync.HostSyncCounter` (``Tensor.item``/``tolist``/``cpu``/``numpy``/
``__bool__``/``__float__``/``__int__``, ``torch.cuda.synchronize``, and at the dispatcher every value read and
data-dependent shape) and asserts that after the first step (the one-off head check) none reads the device; that
the logging steps do (their losses, in one transfer); that the counter itself catches each kind of read; that the
host prepares label positions equal to the boolean mask's; and that batches go through pinned memory with a
non-blocking copy when the device is CUDA (a stand-in device: this machine has none).
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from qrecover.recovery import objective as O
from qrecover.recovery import train as T
from qrecover.recovery.api import recover
from qrecover.recovery.config import RecoverConfig
from qrecover.recovery.host_sync import HostSyncCounter


def test_counter_catches_every_kind_of_read():
    x = torch.arange(6.0)
    reads = [lambda: x.sum().item(), lambda: float(x[0]), lambda: bool(x[1] > 0), lambda: x.tolist(),
             lambda: x[x > 2], lambda: torch.nonzero(x), lambda: x.numpy(), lambda: int(x[2]),
             lambda: x.masked_select(x > 1)]
    for read in reads:
        with HostSyncCounter() as c:
            read()
        assert c.syncs >= 1, read
    with HostSyncCounter() as c:
        y = (x * 2).index_select(0, torch.tensor([1, 3])).sum()
    assert c.syncs == 0 and c.dispatches >= 3 and y.shape == ()
    assert torch.Tensor.item is not None and float(x[1]) == 1.0  # restored: plain calls work after


def test_label_positions_equal_the_boolean_mask():
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 9, (3, 11), generator=g)
    labels[0, :4] = -100
    labels[2, 7] = -100
    hidden = torch.randn(3, 11, 5, generator=g, dtype=torch.float64)
    keep = O.label_positions(labels)
    mask = labels[:, 1:] != -100
    assert torch.equal(hidden[:, :-1].reshape(-1, 5).index_select(0, keep), hidden[:, :-1][mask])
    assert keep.numel() == int(mask.sum())


@pytest.mark.parametrize("loss_chunk,objective", [(16, "kd"), (0, "mix")])  # 0: the full logits' loss (no boolean index)
def test_no_device_read_between_logging_steps(tiny_ckpt, text_mix, tmp_path, monkeypatch, loss_chunk, objective):
    per_step: list[HostSyncCounter] = []
    reads: list[tuple[list[int], int]] = []
    real_step, real_read = T.optimizer_step, T._read_losses

    def counted_step(ctx, micro):
        with HostSyncCounter() as c:
            out = real_step(ctx, micro)
        per_step.append(c)
        return out

    def counted_read(pending, *a):
        with HostSyncCounter() as c:
            out = real_read(pending, *a)
        reads.append(([s for s, *_ in pending], c.syncs))
        return out

    monkeypatch.setattr(T, "optimizer_step", counted_step)
    monkeypatch.setattr(T, "_read_losses", counted_read)
    cfg = RecoverConfig(rank=4, tokens=32 * 2 * 2 * 7, seq_len=32, batch_size=2, grad_accum=2, objective=objective,
                        init="zero", loss_chunk=loss_chunk, log_every=3, lr=1e-3, decontaminate=False, checkpoint_every=0,
                        mix=str(text_mix))
    meta = recover(tiny_ckpt, tmp_path / "a", cfg, show_progress=False)
    assert len(per_step) == 7
    assert all(c.dispatches > 100 for c in per_step)  # the counter saw the step's work
    # step 1 checks the output head once per model (a comparison of logits); every later step reads nothing (on CUDA,
    # step 2 also captures the teacher's forward as a CUDA graph, which synchronises once: graphs.py)
    later = per_step[2:] if torch.cuda.is_available() else per_step[1:]
    assert [c.syncs for c in later] == [0] * len(later), [dict(c.sites) for c in later]
    # the reads: the warm-up steps 1 and 2 apart, then every 3rd step and the last, each batch of losses at once
    assert [s for s, _ in reads] == [[1], [2], [3], [4, 5, 6], [7]]
    assert all(n >= 1 for _, n in reads)
    rows = [json.loads(line) for line in (tmp_path / "a" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 8)) and all(math.isfinite(r["loss"]) for r in rows)
    assert meta["training"]["attention"] == "qrecover_causal_sdpa"  # SDPA, is_causal, no mask built
    assert meta["training"]["warmup"]["steps"] == 2 and meta["training"]["warmup"]["seconds"] > 0


def test_batches_are_pinned_and_copied_without_blocking_on_cuda(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **k: calls.append(("pin",)) or self)
    real_to = torch.Tensor.to

    def fake_to(self, *args, **kwargs):
        if args and isinstance(args[0], torch.device) and args[0].type == "cuda":
            calls.append(("to", str(args[0]), kwargs.get("non_blocking", False)))
            return self
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", fake_to)
    ids = torch.arange(12).reshape(2, 6)
    labels = ids.clone()
    labels[0, :3] = -100
    m = T.prepare_micro(ids, labels, torch.device("cuda", 0))
    assert calls == [("pin",), ("to", "cuda:0", True)] * 3  # ids, labels, label positions
    assert m.count == 2 * 5 - 2 and m.keep.tolist() == [2, 3, 4, 5, 6, 7, 8, 9]
    calls.clear()
    T.prepare_micro(ids, labels, torch.device("cpu"))
    assert calls == []  # on the CPU: no pinning, plain tensors


@pytest.mark.parametrize("value", [0, -1, True])
def test_bad_log_every_is_refused(value):
    with pytest.raises(Exception, match="--log-every"):
        RecoverConfig(log_every=value)


def test_teacher_device_is_per_process_on_several(monkeypatch):
    from qrecover.recovery.objective import teacher_target

    cpu = torch.device("cpu")
    assert teacher_target(None, cpu) == cpu and teacher_target("cuda:1", cpu) == torch.device("cuda", 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert teacher_target("cuda:4", cpu) == torch.device("cuda", 6)  # process 2 of 4: its own teacher GPU
    assert teacher_target("cuda", cpu) == torch.device("cuda")  # no index: the process's current device
    assert teacher_target("cpu", cpu) == cpu and teacher_target(None, torch.device("cuda", 2)) == torch.device("cuda", 2)


def test_compile_layers_compiles_every_decoder_layer_in_place_and_keeps_outputs():
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                                   num_attention_heads=2, num_key_value_heads=1)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 64, (2, 7))
    want = model(input_ids=ids, use_cache=False).logits
    names = [n for n, _ in model.named_parameters()]
    assert T.compile_layers(model, backend="eager") == 3  # eager: the wiring, without a C++ compiler
    assert all(layer._compiled_call_impl is not None for layer in model.model.layers)
    assert T.compile_layers(model, backend="eager") == 3 and [n for n, _ in model.named_parameters()] == names
    assert torch.allclose(model(input_ids=ids, use_cache=False).logits, want, atol=1e-6)


def test_log_steps_are_the_warmup_the_period_the_checkpoints_and_the_last():
    cfg = RecoverConfig(log_every=4, checkpoint_every=3)
    assert [s for s in range(1, 12) if T.is_log_step(s, 0, 11, cfg, False)] == [1, 2, 3, 4, 6, 8, 9, 11]
    assert [s for s in range(6, 12) if T.is_log_step(s, 5, 11, cfg, False)] == [6, 7, 8, 9, 11]  # resumed after 5
    assert all(T.is_log_step(s, 0, 11, cfg, True) for s in range(1, 12))  # a callback reads every step
    # every checkpoint is written at a read, so a non-finite loss is caught before it could be saved
    assert all(T.is_log_step(s, 0, 11, cfg, False) for s in range(1, 12) if T.is_checkpoint_step(s, 11, cfg))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_compiled_layers_make_few_graphs_whatever_each_layer_holds(tiny_ckpt, text_mix, tmp_path, monkeypatch, precision):
    """--compile-layers: one graph per kind of call, not per layer. The tiny checkpoint mixes 2/3/4-bit layers; a
    layer whose dense cache is filled at its first call (or whose bits differ) would be its own graph, and on an H100
    the 1B model hit dynamo's recompile limit (8) and fell back to eager. Counted with a backend that records each
    graph it is given."""
    import torch._dynamo

    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    real = T.compile_layers
    monkeypatch.setattr(T, "compile_layers", lambda model, backend="inductor": real(model, backend=counting))
    torch._dynamo.reset()
    cfg = RecoverConfig(rank=4, tokens=32 * 2 * 2 * 4, seq_len=32, batch_size=2, grad_accum=2, objective="kd",
                        init="zero", loss_chunk=16, log_every=3, lr=1e-3, decontaminate=False, checkpoint_every=0,
                        mix=str(text_mix), compile_layers=True, precision=precision,
                        base_dtype="bf16" if precision == "bf16" else "auto")
    meta = recover(tiny_ckpt, tmp_path / "a", cfg, show_progress=False)
    torch._dynamo.reset()
    assert math.isfinite(meta["training"]["final_loss"])
    # the teacher's layers (no gradient), the student's first layer (its input needs none) and the others; before:
    # 6 (one more for the layers' first calls, which filled their dense caches, and one for the head check at batch 1)
    assert len(graphs) == 3, len(graphs)

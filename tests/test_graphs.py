"""The teacher's forward as a CUDA graph (qrecover.recovery.graphs): eager warm-up calls, one capture per shape, replays
that copy the new ids in and give the captured output, eager for good after a failed capture (one warning), and
nothing graphed off CUDA. On the CPU, torch.cuda is replaced by a stand-in whose "graph" records the captured
function and reruns it at replay; on a GPU, the real graph gives the eager forward's hidden states exactly."""

from __future__ import annotations

import contextlib
import types
import warnings

import pytest
import torch

from qrecover.recovery import graphs as G
from qrecover.recovery import objective as O


class _FakeGraph:
    """Replays by rerunning what was captured and copying the result into the captured output, as a graph would."""

    capturing: "_FakeGraph | None" = None

    def __init__(self) -> None:
        self.replays = 0
        self.rerun = None

    def replay(self) -> None:
        self.replays += 1
        self.rerun()


def _fake_cuda(fail: bool = False):
    @contextlib.contextmanager
    def graph(g, capture_error_mode="global"):
        if fail:
            raise RuntimeError("operation not permitted when stream is capturing\nmore")
        _FakeGraph.capturing = g
        try:
            yield
        finally:
            _FakeGraph.capturing = None

    stream = types.SimpleNamespace(wait_stream=lambda other: None)
    return types.SimpleNamespace(device=lambda d: contextlib.nullcontext(), current_stream=lambda d=None: stream,
                                 Stream=lambda device=None: stream, stream=lambda s: contextlib.nullcontext(),
                                 CUDAGraph=_FakeGraph, graph=graph)


def _forward(table: torch.Tensor, calls: list):
    """A stand-in teacher: an embedding lookup into a fresh tensor; the fake graph reruns it into the captured output."""
    def fn(ids: torch.Tensor) -> torch.Tensor:
        calls.append(ids.clone())
        out = table[ids] * 2
        g = _FakeGraph.capturing
        if g is not None:  # captured: a replay recomputes from the (static) ids into this output
            g.rerun = lambda: out.copy_(table[ids] * 2)
        return out
    return fn


def test_graph_warms_up_captures_once_per_shape_and_replays_new_ids(monkeypatch):
    monkeypatch.setattr(G, "DEVICE_TYPE", "cpu")
    monkeypatch.setattr(G, "cuda", _fake_cuda())
    table, calls = torch.randn(50, 8, dtype=torch.float64), []
    g = G.GraphedForward(_forward(table, calls))
    gen = torch.Generator().manual_seed(0)
    outs = []
    for i in range(6):
        ids = torch.randint(0, 50, (2, 5), generator=gen)
        out = g(ids)
        assert torch.equal(out, table[ids] * 2), i  # each call's own ids, replayed or not
        outs.append(out)
    # eager warm-up call(s); at the next the side-stream call and the capture (which computes nothing on a GPU) and a
    # replay; then replays with no Python call
    assert len(calls) == G.WARMUP_CALLS + 2 and g.replays == 6 - G.WARMUP_CALLS
    assert outs[3] is outs[2] and outs[5] is outs[2]  # the captured output, overwritten by each replay
    assert len(g.graphs) == 1
    other = torch.randint(0, 50, (1, 7), generator=gen)  # another shape: its own warm-up
    assert torch.equal(g(other), table[other] * 2) and len(calls) == G.WARMUP_CALLS + 3 and len(g.graphs) == 1


def test_a_failed_capture_warns_once_and_stays_eager(monkeypatch):
    monkeypatch.setattr(G, "DEVICE_TYPE", "cpu")
    monkeypatch.setattr(G, "cuda", _fake_cuda(fail=True))
    table, calls = torch.randn(50, 8), []
    g = G.GraphedForward(_forward(table, calls))
    ids = torch.randint(0, 50, (2, 5))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(6):
            assert torch.equal(g(ids), table[ids] * 2)
    msgs = [str(w.message) for w in caught if "CUDA graph" in str(w.message)]
    assert len(msgs) == 1 and "RuntimeError: operation not permitted when stream is capturing" in msgs[0]
    assert "--no-teacher-graph" in msgs[0] and "more" not in msgs[0]  # the first line of the error only
    assert g.failed is not None and g.replays == 0 and not g.graphs


def test_nothing_is_graphed_off_cuda_and_the_registry_is_cleared():
    calls = []
    table = torch.randn(10, 4)
    teacher = torch.nn.Linear(1, 1)
    with G.teacher_graph(teacher, lambda t, ids: _forward(table, calls)(ids)) as g:
        assert G.graphed(teacher) is g
        for _ in range(5):
            g(torch.tensor([[1, 2]]))
        assert len(calls) == 5 and g.replays == 0 and not g.graphs  # CPU tensors: eager every time
    assert G.graphed(teacher) is None
    with G.teacher_graph(teacher, lambda t, ids: ids, enable=False) as g:
        assert g is None and G.graphed(teacher) is None


def test_the_trainer_replays_the_teacher_and_trains_as_eagerly(tiny_ckpt, text_mix, tmp_path, monkeypatch):
    """Recovery with the teacher's forward captured and replayed (the stand-in graph reruns the captured forward on the
    ids copied in) gives the eager run's losses: each micro-batch's loss reads its own teacher hidden states, though
    every replay writes the same output tensor. With --hidden-weight (forward hooks) the teacher stays eager."""
    import json

    from qrecover.recovery.api import recover
    from qrecover.recovery.config import RecoverConfig

    cfg = dict(rank=4, tokens=32 * 2 * 2 * 5, seq_len=32, batch_size=2, grad_accum=2, objective="kd", init="zero",
               loss_chunk=16, lr=1e-3, decontaminate=False, checkpoint_every=0, log_every=1, mix=str(text_mix))

    def losses(d):
        return [json.loads(line)["loss"] for line in (d / "train_log.jsonl").read_text().splitlines()]

    eager = recover(tiny_ckpt, tmp_path / "eager", RecoverConfig(**cfg, teacher_graph=False), show_progress=False)
    assert eager["training"]["teacher_graph"] is None
    monkeypatch.setattr(G, "DEVICE_TYPE", "cpu")
    monkeypatch.setattr(G, "cuda", _fake_cuda())
    real_capture = G.GraphedForward._capture

    def capture(self, key, ids):
        found = real_capture(self, key, ids)
        if found is not None:
            static_ids, out, graph = found
            graph.rerun = lambda: out.copy_(self.fn(static_ids))
        return found

    monkeypatch.setattr(G.GraphedForward, "_capture", capture)
    graphed = recover(tiny_ckpt, tmp_path / "graphed", RecoverConfig(**cfg), show_progress=False)
    assert graphed["training"]["teacher_graph"] == {"replays": 5 * 2 - G.WARMUP_CALLS, "failed": None}
    assert losses(tmp_path / "graphed") == losses(tmp_path / "eager")
    hooks = recover(tiny_ckpt, tmp_path / "hooks", RecoverConfig(**{**cfg, "tokens": 32 * 2 * 2}, hidden_weight=0.1),
                    show_progress=False)
    assert hooks["training"]["teacher_graph"] is None


def _tiny_llama(device: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128)
    return LlamaForCausalLM(cfg).to(device, torch.bfloat16).eval().requires_grad_(False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_gives_the_eager_hidden_states():
    from qrecover.recovery.attention import causal_sdpa

    teacher = _tiny_llama("cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    with causal_sdpa(teacher, 64), G.teacher_graph(teacher, O.hidden_states) as g, torch.no_grad(), \
            torch.autocast("cuda", dtype=torch.bfloat16):
        for i in range(6):
            ids = torch.randint(0, 256, (2, 64), device="cuda", generator=gen)
            got = g(ids).clone()
            assert torch.equal(got, O.hidden_states(teacher, ids)), i
    assert g.failed is None and g.replays == 6 - G.WARMUP_CALLS


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_teacher_gives_the_same_losses_and_gradients():
    """step_loss with the teacher's graph registered (as the trainer does) against the eager teacher, micro-batch after
    micro-batch, each with its backward: the replayed hidden states serve the loss before the next replay."""
    from qrecover.recovery.attention import causal_sdpa
    from qrecover.recovery.config import RecoverConfig

    teacher = _tiny_llama("cuda")
    student = _tiny_llama("cuda")
    with torch.no_grad():
        for p in student.parameters():
            p.add_(0.01 * torch.randn_like(p))
    student.requires_grad_(False)
    norm = student.model.norm.weight.requires_grad_(True)  # something to train: the final norm's weight
    cfg = RecoverConfig(objective="kd", loss_chunk=32, seq_len=64)
    gen = torch.Generator(device="cuda").manual_seed(0)
    batches = [torch.randint(0, 256, (2, 64), device="cuda", generator=gen) for _ in range(5)]

    def run(graph: bool):
        out = []
        with causal_sdpa(teacher, 64), causal_sdpa(student, 64), G.teacher_graph(teacher, O.hidden_states, enable=graph) as g:
            for ids in batches:
                norm.grad = None
                loss = O.step_loss(student, teacher, ids, ids.clone(), cfg,
                                   lambda: torch.autocast("cuda", dtype=torch.bfloat16), "bf16")
                loss.backward()
                out.append((loss.detach().clone(), norm.grad.clone()))
        return out, g

    eager, _ = run(False)
    graphed, g = run(True)
    assert g.failed is None and g.replays == len(batches) - G.WARMUP_CALLS
    for (l0, g0), (l1, g1) in zip(eager, graphed):
        assert torch.equal(l0, l1)  # the forward's kernels are deterministic
        assert torch.allclose(g0, g1, rtol=1e-2, atol=1e-6)  # flash attention's backward accumulates with atomics

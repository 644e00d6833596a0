"""benchmarks/decode_graph.py's static-cache greedy loop (the one a GPU replays as a CUDA graph), run eagerly on the
CPU: the same tokens as ``generate``'s greedy decoding, on a plain model and on a qrecover checkpoint."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).parents[1]))

from benchmarks.decode_graph import WARMUP, greedy_static  # noqa: E402


def _generate(model, ids, n):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)[0, ids.shape[1]:].tolist()


def test_static_greedy_matches_generate():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)).eval()
    ids = torch.tensor([[5, 17, 42, 7, 3]])
    for n in (1, WARMUP + 1, 12):
        out = greedy_static(model, ids, n, graph=True)  # graph=True on a CPU: eager, nothing captured
        assert out["tokens"] == _generate(model, ids, n), n
        assert not out["graph"] and out["graph_error"] is None
        assert (out["tok_per_s"] is None) == (n <= WARMUP + 1)


def test_static_greedy_on_a_checkpoint(tiny_ckpt):
    from qrecover.loading import load

    model = load(tiny_ckpt)
    ids = torch.tensor([[1, 2, 3, 4]])
    assert greedy_static(model, ids, 8)["tokens"] == _generate(model, ids, 8)


def test_compiled_static_greedy_matches_generate():
    """``compile=True`` (gpt-fast's protocol: the one-token step through ``torch.compile``, inductor on this CPU): the
    same greedy tokens as the eager loop and as ``generate`` (whose ``min_new_tokens`` forbids the config's EOS
    token 2: seed 0 never picks it)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)).eval()
    ids = torch.tensor([[5, 17, 42, 7, 3]])
    out = greedy_static(model, ids, WARMUP + 4, compile=True)
    assert out["compiled"] and out["tokens"] == greedy_static(model, ids, WARMUP + 4)["tokens"]
    assert out["tokens"] == _generate(model, ids, WARMUP + 4)


def test_packed_layers_are_opaque_to_torch_compile():
    """What a compiled decode step does at a packed layer (``qrecover.kernels.linear`` in inference): one graph break
    into the dispatch, which runs as it is (its tables, timing and triton launches are not traced); the result is the
    eager one. A training module still traces as one ``F.linear`` (compiled recovery layers), with no break."""
    import torch._dynamo

    from qrecover import kernels

    sys.path.insert(0, str(Path(__file__).parent))
    from kernel_helpers import make_layer

    layer = make_layer("palettize", 3, 32, 64).cpu()
    x = torch.randn(2, 64)

    def step(v):
        return torch.relu(kernels.linear(layer, torch.tanh(v))) * 2

    eager = step(x)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(step)(x)
    assert explained.graph_break_count == 1, explained.break_reasons
    assert "_dispatched" in str(explained.break_reasons[0].reason), explained.break_reasons
    torch._dynamo.reset()
    assert torch.allclose(torch.compile(step, backend="eager")(x), eager)
    layer.train()
    torch._dynamo.reset()
    assert torch._dynamo.explain(step)(x).graph_break_count == 0


def test_importing_the_kernels_package_imports_neither_triton_nor_dynamo():
    """``TRITON_INTERPRET`` is read when triton's kernels are defined, and benchmarks/kernels.py sets it after importing
    ``qrecover.kernels``: the package (with its dynamo-opaque dispatch, made at first use) must not import triton."""
    import subprocess

    code = "import sys, qrecover.kernels; print(sorted(m for m in ('triton', 'torch._dynamo') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).parents[1])
    assert out.stdout.strip() == "[]", out.stdout + out.stderr

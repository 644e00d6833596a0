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

"""Greedy decoding at batch 1 with a static KV cache, one-token steps replayed from a CUDA graph (issue 24, item 4).

transformers' ``generate`` launches every kernel of every layer from Python at each step; at batch 1 on a 1B model
that launch overhead, not the weights' bytes, bounds tokens/s. gpt-fast's answer, written out here: a static cache
(``transformers.StaticCache``: fixed-size key/value tensors written at ``cache_position``), the prompt run eagerly,
then each new token one forward of one token whose inputs live in fixed tensors (``static_ids``, ``static_pos``),
captured once as a CUDA graph and replayed. The first ``WARMUP`` steps run eagerly: the fused kernels' tuning and
the measured dispatch (``qrecover.kernels.dispatch``) decide there, before the capture (nothing is timed inside one).

``compile=True`` (gpt-fast's protocol) compiles the one-token step with ``torch.compile`` first (default mode, no
CUDA graphs of inductor's own: this loop captures one), so that the norms, rotary embeddings and residual adds between
the matmuls become a few fused kernels instead of dozens of small ones per layer; qrecover's packed layers stay
opaque calls (``qrecover.kernels._dispatched``: one graph break each). The warm-up steps compile it.

If the capture fails (a host read inside the model's forward, say), the row says why and the steady state is timed
eagerly with the same static cache. On a CPU the loop runs eagerly (``graph=False``), which is what
``tests/test_decode_graph.py`` checks against ``generate``'s greedy tokens.
"""

from __future__ import annotations

import time

import torch

#: eager one-token steps before the capture (tuning, dispatch measurement, allocator warm-up)
WARMUP = 3


def greedy_static(model, ids: torch.Tensor, new_tokens: int, graph: bool = True, compile: bool = False) -> dict:
    """``new_tokens`` greedy tokens after ``ids (1, L)``; returns ``{"tokens", "tok_per_s", "warmup_s", "graph",
    "graph_error"}``: tokens/s over the steps after the warm-up (the CUDA-graph replays when ``graph`` and the
    capture worked), the warm-up's seconds apart. ``compile``: the one-token step through ``torch.compile``."""
    from transformers import StaticCache

    device = ids.device
    cuda = device.type == "cuda"
    cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + new_tokens + 1)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def forward(tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        out = model(input_ids=tok, past_key_values=cache, cache_position=pos, use_cache=True)
        return out.logits[:, -1].argmax(-1, keepdim=True)

    one = torch.compile(forward, dynamic=False) if compile else forward  # the prompt runs uncompiled (another shape)
    result = {"graph": False, "graph_error": None, "compiled": compile}
    with torch.no_grad():
        t0 = time.perf_counter()
        nxt = forward(ids, torch.arange(ids.shape[1], device=device))
        tokens = [nxt]
        static_ids, static_pos = nxt.clone(), torch.tensor([ids.shape[1]], device=device)
        warm = min(WARMUP, new_tokens - 1)
        for _ in range(warm):
            nxt = one(static_ids, static_pos)
            tokens.append(nxt)
            static_ids.copy_(nxt)
            static_pos += 1
        step = lambda: one(static_ids, static_pos)  # noqa: E731
        if graph and cuda and len(tokens) < new_tokens:
            try:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    static_out = one(static_ids, static_pos)
                step = lambda: (g.replay(), static_out)[1]  # noqa: E731
                result["graph"] = True
            except Exception as e:  # noqa: BLE001 - reported in the row, and the steady state is timed eagerly
                result["graph_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                torch.cuda.synchronize()
        sync()
        result["warmup_s"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        steady = 0
        while len(tokens) < new_tokens:
            nxt = step().clone()
            tokens.append(nxt)
            static_ids.copy_(nxt)
            static_pos += 1
            steady += 1
        sync()
        elapsed = time.perf_counter() - t1
    result["tokens"] = torch.cat(tokens, dim=1)[0].tolist()
    result["tok_per_s"] = steady / elapsed if steady and elapsed > 0 else None
    return result

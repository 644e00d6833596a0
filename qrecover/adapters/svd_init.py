"""SVD initialisation of LoRA adapters from the quantization error (the maths; PEFT wiring in :mod:`.lora`).

PEFT starts B at zero, so the adapter first has to find the quantization
error by gradient descent. Instead, ``B A`` can start as the best rank-r approximation of the error itself,
``W - Q(W)`` (LoftQ, Li et al. 2023), weighted by the layer's calibration inputs so that the directions the
inputs actually excite come first (the norm ``E_x ||(W - Q - s B A) x||^2``; as in ASVD/CorDA). Training then
starts from a model whose layer outputs are already closer to the unquantized ones.

:func:`lowrank_correction` is the exact float64 solution, :func:`randomized_correction` the one for wide layers
(no decomposition larger than ``(rank + oversample)^2``), :func:`best_correction` picks; each is callable on a
bare error matrix and inputs, without a model. :func:`init_error_svd` runs them on every adapted layer as its
inputs appear in one forward of the unquantized model (:func:`each_layer_input`).
"""

from __future__ import annotations

import inspect
import os
from typing import Any

import torch
import torch.nn as nn

from ..errors import QRecoverError
from ..moe import expert_key
from ..transforms import model_level_names
from .lora import lora_modules

#: on a CPU, layers up to this width (rows and columns) take the exact float64 path of :func:`lowrank_correction`; wider
#: ones the randomized one (an eigendecomposition and a full SVD are cubic in the width: see benchmarks/svd_init.py)
EXACT_MAX_WIDTH = 2048
OVERSAMPLE = 8  # extra directions of the randomized range finder
POWER_ITERS = 4  # its subspace iterations on E H E^T


def lowrank_correction(error: torch.Tensor, gram: torch.Tensor | None, rank: int, scaling: float,
                       damp: float = 0.01) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B, A)`` with ``scaling * B @ A`` the rank-``rank`` matrix closest to ``error`` (out, in) in the
    norm its layer's inputs induce: it minimises ``||(error - scaling B A) S||_F`` with ``S = H^(1/2)``,
    ``H = gram + damp * mean(diag(gram)) * I`` the inputs' second moment ``E[x x^T]`` (``gram=None``: plain
    Frobenius norm). By Eckart-Young the minimiser is the truncated SVD of ``error @ S``, mapped back by
    ``S^-1``. B and A share the singular values evenly (both ``sqrt(sigma / scaling)``). Computed in float64.

    Exact, and cubic in the width (an eigendecomposition of ``H`` and a full SVD): :func:`randomized_correction`
    is the path for wide layers, :func:`best_correction` picks.
    """
    e = error.double()
    if gram is None:
        s_half = s_inv = torch.eye(e.shape[1], dtype=torch.float64, device=e.device)
    else:
        h = gram.double()
        h = h + damp * h.diagonal().mean().clamp_min(1e-12) * torch.eye(h.shape[0], dtype=torch.float64, device=h.device)
        ev, v = torch.linalg.eigh(h)
        ev = ev.clamp_min(1e-12)
        s_half, s_inv = (v * ev.sqrt()) @ v.T, (v / ev.sqrt()) @ v.T
    u, sigma, vh = torch.linalg.svd(e @ s_half, full_matrices=False)
    r = min(rank, sigma.numel())
    k = (sigma[:r] / scaling).sqrt()
    b = torch.zeros(e.shape[0], rank, dtype=torch.float64, device=e.device)
    a = torch.zeros(rank, e.shape[1], dtype=torch.float64, device=e.device)
    b[:, :r] = u[:, :r] * k
    a[:r] = (k[:, None] * vh[:r]) @ s_inv
    return b, a


def input_weighting(gram: torch.Tensor | None, inputs: torch.Tensor | None, damp: float, n_in: int, dtype: torch.dtype,
               device: torch.device):
    """``v (in, k) -> H v`` with ``H = E[x x^T] + damp * mean(diag) * I`` from ``gram (in, in)`` or from the inputs
    themselves, ``inputs (tokens, in)`` (``H v = X^T (X v) / tokens``: never forms the in x in matrix); identity
    when both are None."""
    if inputs is not None:
        x = inputs.to(device, dtype)
        lam = damp * max(float(x.square().sum()) / x.numel(), 1e-12)
        return lambda v: x.T @ (x @ v) / x.shape[0] + lam * v
    if gram is not None:
        h = gram.to(device, dtype)
        lam = damp * max(float(h.diagonal().mean()), 1e-12)
        return lambda v: h @ v + lam * v
    return lambda v: v


def randomized_correction(error: torch.Tensor, rank: int, scaling: float, gram: torch.Tensor | None = None,
                          inputs: torch.Tensor | None = None, damp: float = 0.01, oversample: int = OVERSAMPLE,
                          iters: int = POWER_ITERS, seed: int = 0, dtype: torch.dtype = torch.float32,
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`lowrank_correction`'s ``(B, A)`` by a randomized range finder, in ``dtype`` on ``error``'s device,
    with no square root, inverse or decomposition of anything larger than ``(rank + oversample)^2``.

    With ``M = E S`` (``S S^T = H``), the best rank-r approximation is ``P E`` with ``P`` the projector on the top
    r left singular vectors of ``M``, the top eigenvectors of ``M M^T = E H E^T``, which needs only products with
    ``E`` and ``H``. Subspace iteration (``iters`` rounds, ``rank + oversample`` directions, re-orthonormalised) on
    ``E H E^T`` from a seeded Gaussian start gives an orthonormal ``Q (out, k)``; within its span the best rank-r
    approximation is exact: ``Z = Q^T E``, the eigenvectors ``W`` of ``Z H Z^T (k, k)``, ``B A ~ Q W_r W_r^T Z``.
    Cost per round ``O(out in k)`` plus one product with ``H`` (``O(in^2 k)``, or ``O(tokens in k)`` from
    ``inputs (tokens, in)``), against ``O(in^3 + out in^2)`` for the exact path. Deterministic for a ``seed``.
    One layer of :func:`randomized_corrections`.
    """
    return randomized_corrections([error], [rank], [scaling], gram, inputs, damp, oversample, iters, seed, dtype)[0]


def randomized_corrections(errors: list[torch.Tensor], ranks: list[int], scalings: list[float],
                           gram: torch.Tensor | None = None, inputs: torch.Tensor | None = None, damp: float = 0.01,
                           oversample: int = OVERSAMPLE, iters: int = POWER_ITERS, seed: int = 0,
                           dtype: torch.dtype = torch.float32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """:func:`randomized_correction` for several layers that read the same inputs (q, k and v; gate and up), batched:
    each round's products with ``H`` (the costly ones, ``tokens x in x k`` from ``inputs``) run as one product of
    all the layers' ``(in, k_l)`` blocks side by side, so a group costs one pass over ``X`` per round instead of
    one per layer. ``errors[l] (out_l, in)``; each layer starts from the same seeded Gaussian as it would alone, so
    the result equals the per-layer one up to float32 summation order. Returns float64 ``(B, A)`` per layer."""
    dev = errors[0].device
    es = [e.to(dtype) for e in errors]
    in_f = es[0].shape[1]
    h = input_weighting(gram, inputs, damp, in_f, dtype, dev)
    ks = [min(r + oversample, e.shape[0], in_f) for r, e in zip(ranks, es)]

    def h_all(blocks: list[torch.Tensor]) -> list[torch.Tensor]:  # [(in, k_l)] -> [H @ block], one product
        return list(h(torch.cat(blocks, dim=1)).split([b.shape[1] for b in blocks], dim=1))

    ys = []
    for e, k in zip(es, ks):
        gen = torch.Generator(device=dev).manual_seed(seed)
        ys.append(torch.randn(e.shape[0], k, generator=gen, device=dev, dtype=dtype))
    for _ in range(iters + 1):
        qs = [torch.linalg.qr(y)[0] for y in ys]
        ys = [e @ hz for e, hz in zip(es, h_all([e.T @ q for e, q in zip(es, qs)]))]
    qs = [torch.linalg.qr(y)[0] for y in ys]
    zs = [q.T @ e for q, e in zip(qs, es)]  # (k_l, in)
    hzs = h_all([z.T for z in zs])
    return [_split_factors(q, z, z @ hz, r, s) for q, z, hz, r, s in zip(qs, zs, hzs, ranks, scalings)]


def _split_factors(q: torch.Tensor, z: torch.Tensor, g: torch.Tensor, rank: int, scaling: float
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B (out, rank), A (rank, in))`` float64 from the range ``q (out, k)``, ``z = q^T E (k, in)`` and
    ``g = z H z^T (k, k)``: the top ``rank`` eigenvectors ``W`` of ``g``, ``B A = q W W^T z`` with the singular
    values shared evenly."""
    dev, (out_f, k), in_f = q.device, q.shape, z.shape[1]
    g = g.double()
    evals, w = torch.linalg.eigh((g + g.T) / 2)
    r = min(rank, k)
    evals, w = evals.flip(0)[:r].clamp_min(0.0), w.flip(1)[:, :r]
    sigma = evals.sqrt()
    # directions with no error (below the float32 noise of the largest) get zero columns, as in the exact path
    live = sigma > (float(sigma.max()) * 1e-6 if r else 0.0)
    b = torch.zeros(out_f, rank, dtype=torch.float64, device=dev)
    a = torch.zeros(rank, in_f, dtype=torch.float64, device=dev)
    qw, wz = q.double() @ w, w.T @ z.double()
    b[:, :r] = torch.where(live, qw * (sigma / scaling).sqrt(), 0.0)
    a[:r] = torch.where(live[:, None], wz / torch.where(live, sigma * scaling, 1.0).sqrt()[:, None], 0.0)
    return b, a


def exact_here(error: torch.Tensor, method: str) -> bool:
    """Whether ``method`` takes the exact float64 path for ``error``: 'exact', or 'auto' on a CPU for a layer of at
    most ``EXACT_MAX_WIDTH`` rows and columns (cheap there, and the numbers the README reports). On a GPU 'auto' is
    always randomized: float64 decompositions run there at a small fraction of float32 matmul speed."""
    if method not in ("auto", "exact", "randomized"):
        raise QRecoverError(f"svd init method {method!r} must be auto, exact or randomized")
    return method == "exact" or (method == "auto" and error.device.type == "cpu" and max(error.shape) <= EXACT_MAX_WIDTH)


def best_correction(error: torch.Tensor, rank: int, scaling: float, gram: torch.Tensor | None = None,
                    inputs: torch.Tensor | None = None, damp: float = 0.01, method: str = "auto", seed: int = 0,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B, A)`` float64 by ``method``: 'exact' (:func:`lowrank_correction`, float64), 'randomized'
    (:func:`randomized_correction`, float32 on ``error``'s device) or 'auto' (:func:`exact_here`)."""
    return best_corrections([error], [rank], [scaling], gram, inputs, damp, method, seed)[0]


def best_corrections(errors: list[torch.Tensor], ranks: list[int], scalings: list[float], gram: torch.Tensor | None = None,
                     inputs: torch.Tensor | None = None, damp: float = 0.01, method: str = "auto", seed: int = 0,
                     ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """:func:`best_correction` for layers that read the same inputs: the exact ones one by one, the randomized ones
    batched (:func:`randomized_corrections`, one pass over the inputs per round for all of them)."""
    exact = [exact_here(e, method) for e in errors]
    out: list[Any] = [None] * len(errors)
    if any(exact) and gram is None and inputs is not None:
        x = inputs.double()
        gram = x.T @ x / x.shape[0]
    for i in (i for i, ex in enumerate(exact) if ex):
        out[i] = lowrank_correction(errors[i], gram, ranks[i], scalings[i], damp)
    rand = [i for i, ex in enumerate(exact) if not ex]
    if rand:
        got = randomized_corrections([errors[i] for i in rand], [ranks[i] for i in rand], [scalings[i] for i in rand],
                                     gram if inputs is None else None, inputs, damp, seed=seed)
        for i, ba in zip(rand, got):
            out[i] = ba
    return out


def init_device() -> torch.device:
    """Where the initialisation runs (the teacher's forward over the calibration windows and the linear algebra):
    this process's GPU when there is one (``LOCAL_RANK`` under torchrun: not every process on GPU 0), else the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())


def teacher_modules(model: nn.Module, teacher: nn.Module, names: list[str], fix: str) -> dict[str, nn.Module]:
    """``teacher``'s modules by name, once it is checked to compare layer by layer with the checkpoint ``model``: it has
    every layer of ``names`` (else an error ending in ``fix``), and it is in the checkpoint's basis, i.e. it has replayed
    the checkpoint's model-level transforms (``rot+``, ``r4+``; :func:`qrecover.recovery.api.in_checkpoint_basis`).
    An unrotated teacher of a rotated checkpoint would give ``W_teacher - W_quantized`` of two different bases: an
    'svd' initialisation from it wrecks the model (perplexity 1e13 on the default checkpoint) instead of failing."""
    modules = dict(teacher.named_modules())
    missing = sorted(set(names) - set(modules))
    if missing:
        raise QRecoverError(f"the unquantized model has no layers {missing[:3]}: it is not the model this checkpoint "
                            f"was compressed from; {fix}")
    manifest = getattr(model, "qrecover_manifest", None)
    want = model_level_names(manifest) if manifest is not None else []
    done = list(getattr(teacher, "qrecover_transforms", []))
    if done != want:
        raise QRecoverError(f"the unquantized model's transforms are {'+'.join(done) or 'none'} but the checkpoint's layers "
                            f"were quantized after {'+'.join(want) or 'none'}, so their weights cannot be compared layer by "
                            "layer; pass qrecover.recovery.api.in_checkpoint_basis(teacher, manifest) (as qrecover recover "
                            f"does), or {fix}")
    return modules


def each_layer_input(teacher: nn.Module, windows: torch.Tensor, names: list[str], fn, fix: str) -> None:
    """One no-grad forward of ``teacher`` over ``windows`` calling ``fn(name, input)`` once per layer of ``names``
    as its input appears (its first call), hooks removed after; a layer that sees no input is an error ending in
    ``fix``, except a mixture-of-experts expert no token was routed to: after the forward, ``fn(name, I)`` for it
    (the identity as its inputs: no input weighting, as plain rounding). Only the last position's logits are
    computed where the model allows it."""
    modules = dict(teacher.named_modules())
    seen: set[str] = set()

    def hook(name: str):
        def call(_mod, inputs, _out):
            if name not in seen:
                seen.add(name)
                fn(name, inputs[0])
        return call

    handles = [modules[n].register_forward_hook(hook(n)) for n in names]
    kw = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(teacher.forward).parameters else {}
    try:
        with torch.no_grad():
            teacher(input_ids=windows.to(next(teacher.parameters()).device), use_cache=False, **kw)
    finally:
        for h in handles:
            h.remove()
    never = [n for n in names if n not in seen]
    bad = [n for n in never if expert_key(n) is None]
    if bad:
        raise QRecoverError(f"layers {bad[:3]} of the unquantized model saw no input in its forward; {fix}")
    for n in never:
        w = modules[n].weight
        fn(n, torch.eye(w.shape[1], device=w.device))


def init_error_svd(peft_model: nn.Module, teacher: nn.Module, windows: torch.Tensor, damp: float = 0.01,
                   method: str = "auto", device: str | torch.device | None = None, seed: int = 0) -> dict[str, float]:
    """Set every adapter's ``B A`` to the input-weighted rank-r approximation of its layer's quantization error.

    ``teacher``: the unquantized model (same module names); ``windows``: ``(n, seq_len)`` calibration token ids,
    run through the teacher (one batch) to see each layer's inputs ``X (n * seq_len, in)``, ``H = X^T X / tokens``.
    The layers that read one input tensor (q/k/v, gate/up) are corrected together once their inputs have appeared
    (:func:`best_corrections` with ``method``, on ``device``, default :func:`init_device`: the randomized ones
    batched, one pass over the inputs per round for the group) and the inputs dropped after, so one group's inputs
    are held at a time; no ``in x in`` matrix is formed for the randomized path.
    Returns, per layer, the fraction of its output error on those inputs, ``tr(E H E^T)``, that the initial
    adapter removes, and under ``"_total"`` the same over all layers together.
    """
    layers = lora_modules(peft_model)
    modules = teacher_modules(peft_model, teacher, list(layers), "use --init zero")
    dev = torch.device(device) if device is not None else init_device()
    captured: dict[str, float] = {}
    sums = {"before": 0.0, "after": 0.0}
    group: dict[str, Any] = {"seen": None, "x": None, "names": []}  # layers reading one input tensor, corrected together

    @torch.no_grad()  # also after the teacher's forward (the last group)
    def flush() -> None:
        names, xs = group["names"], group["x"]
        if not names:
            return
        mods = [layers[n] for n in names]
        errors = []
        for n in names:
            w = modules[n].weight.detach().to(dev)
            dt = torch.float64 if exact_here(w, method) else torch.float32  # the randomized path runs in float32
            errors.append(w.to(dt) - layers[n].base_layer.weight.detach().to(dev, dt))
        found = best_corrections(errors, [m.lora_A["default"].weight.shape[0] for m in mods],
                                 [m.scaling["default"] for m in mods], inputs=xs, damp=damp, method=method, seed=seed)
        for n, mod, error, (b, a) in zip(names, mods, errors, found):
            a_w, b_w, scaling = mod.lora_A["default"].weight, mod.lora_B["default"].weight, mod.scaling["default"]
            b_w.copy_(b.to(b_w))
            a_w.copy_(a.to(a_w))
            # output errors on the inputs, tr(E H E^T) = ||X E^T||^2 / tokens, with the adapter as stored
            xe = xs @ error.float().T
            rest = xe - scaling * (xs @ a_w.detach().to(dev, torch.float32).T) @ b_w.detach().to(dev, torch.float32).T
            e0, e1 = float(xe.double().square().sum()) / xs.shape[0], float(rest.double().square().sum()) / xs.shape[0]
            captured[n] = 1.0 - e1 / e0 if e0 > 0 else 0.0
            sums["before"] += e0
            sums["after"] += e1
        group["names"] = []

    def correct(name: str, x: torch.Tensor) -> None:
        if group["seen"] is not x:  # a new input tensor: the layers of the previous one are complete
            flush()
            group["seen"], group["x"] = x, x.detach().reshape(-1, x.shape[-1]).to(dev, torch.float32)
        group["names"].append(name)

    try:
        each_layer_input(teacher, windows, list(layers), correct, "use --init zero")
        flush()
    finally:
        group.clear()
    before, after = sums["before"], sums["after"]
    captured = {n: captured[n] for n in layers}
    captured["_total"] = 1.0 - after / before if before > 0 else 0.0
    return captured


__all__ = ["EXACT_MAX_WIDTH", "lowrank_correction", "input_weighting", "randomized_correction", "randomized_corrections",
           "best_correction", "best_corrections", "exact_here", "init_device", "teacher_modules", "each_layer_input",
           "init_error_svd"]

"""LoRA on the frozen quantized model, through PEFT: attach, export in 16 bits, load with a base check.

A qrecover checkpoint's :class:`~qrecover.qlinear.QuantLinear` is an ``nn.Linear`` to PEFT, so the
adapter is plain PEFT: ``adapter_config.json`` + ``adapter_model.safetensors``, loadable with
``PeftModel.from_pretrained(qrecover.load(CHECKPOINT), DIR)``. PEFT wraps each ``QuantLinear`` in qrecover's
:class:`~qrecover.recovery.peft_quant.QuantLoraLinear` (whose merge re-quantizes the packed weights) when the
config is registered: :func:`attach_lora`, :func:`load_adapter` and ``qrecover.load(CKPT, adapter=DIR)`` do it;
with plain PEFT pass ``config=register_quant_lora(LoraConfig.from_pretrained(DIR))``, else ``merge_and_unload``
cannot change the packed weights. Merge with ``peft_quant.merge_and_unload(peft_model, calibration_windows)``: the
palettized layers re-quantize with calibration statistics (a bare ``merge_and_unload()`` refuses). Next to them qrecover writes
``qrecover_adapter.json``: which base it was trained on (the sha256 of the checkpoint's manifest and of its
weights file), its rank and exact size, and how it was trained. :func:`load_adapter` refuses an adapter
trained on another base unless told otherwise.

Initialisation (``init_error_svd``): PEFT starts B at zero, so the adapter first has to find the quantization
error by gradient descent. Instead, ``B A`` can start as the best rank-r approximation of the error itself,
``W - Q(W)`` (LoftQ, Li et al. 2023), weighted by the layer's calibration inputs so that the directions the
inputs actually excite come first (the norm ``E_x ||(W - Q - s B A) x||^2``; as in ASVD/CorDA). Training then
starts from a model whose layer outputs are already closer to the unquantized ones.

Sizes: each adapted layer ``W (out, in)`` gets ``A (r, in)`` and ``B (out, r)``, stored in 16 bits:
``2 * r * (in + out)`` bytes. Its cost in bits per weight of the base model is ``bytes * 8 / parameters``.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import re
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from peft import LoraConfig, PeftConfig, PeftModel, get_peft_model
from peft.utils import get_peft_model_state_dict
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..checkpoint import read_manifest
from ..errors import QRecoverError
from ..io_utils import read_json, sha256_file
from ..moe import expert_key
from ..qlinear import QuantLinear
from .adapter_int8 import INT8_FILE, save_int8
from .head_lora import head_config, register_head_lora
from .peft_quant import register_quant_lora

ADAPTER_META = "qrecover_adapter.json"
ADAPTER_FORMAT_VERSION = 1
SAVE_DTYPE = torch.float16  # adapters ship in 16 bits (AFM); training keeps fp32 master copies


def base_identity(checkpoint: str | Path) -> dict[str, str]:
    """What an adapter is bound to: the checkpoint's manifest and weights hashes (and its path, for people)."""
    checkpoint = Path(checkpoint)
    manifest = read_manifest(checkpoint)
    return {"path": str(checkpoint.resolve()), "manifest_sha256": sha256_file(checkpoint / "qrecover.json"),
            "weights_sha256": manifest["weights_file"]["sha256"]}


def quantized_targets(model: nn.Module, only: list[str] | None = None) -> list[str]:
    """Names of every :class:`QuantLinear` (attention and MLP projections), or the subset ``only``."""
    names = [n for n, m in model.named_modules() if isinstance(m, QuantLinear)]
    if not names:
        raise QRecoverError("the model has no quantized linear layers: recovery adapters train on a qrecover "
                            "checkpoint (the output of `qrecover compress`), not on an unquantized model")
    if only is not None:
        unknown = sorted(set(only) - set(names))
        if unknown:
            raise QRecoverError(f"adapter target layers {unknown[:3]} are not quantized layers of this model")
        names = [n for n in names if n in set(only)]
    return names


def attach_lora(model: nn.Module, rank: int, alpha: float | None = None, dropout: float = 0.0,
                targets: list[str] | None = None, head_rank: int = 0, ranks: dict[str, int] | None = None):
    """Wrap ``model`` in a PEFT LoRA model on its quantized projections; only the adapter trains.

    ``alpha`` defaults to ``2 * rank`` (scaling 2). B starts at zero, so the wrapped model's output equals
    the base model's at step 0. The LoRA layers are :class:`~qrecover.recovery.peft_quant.QuantLoraLinear`.
    ``head_rank > 0`` adds a rank-``head_rank`` LoRA on the tied output head (scaling 2 as well;
    :mod:`qrecover.recovery.head_lora`), a PEFT ``rank_pattern`` entry for ``lm_head``. ``ranks``: a rank per
    layer (``{name: rank > 0}``, :mod:`qrecover.recovery.rank_alloc`), the targets then being those layers; alpha
    follows each rank so that every layer keeps the scaling ``alpha / rank``.
    """
    if not (isinstance(rank, int) and rank > 0):
        raise QRecoverError(f"LoRA rank {rank!r} must be a positive integer, e.g. --rank 16")
    head, rank_pattern = head_config(model, head_rank)
    if ranks is not None:
        if not ranks or any(not isinstance(r, int) or r <= 0 for r in ranks.values()):
            raise QRecoverError(f"per-layer ranks must be positive integers on at least one layer (got {dict(list(ranks.items())[:3])})")
        targets = list(ranks)
        # PEFT matches a rank_pattern key as a regex against the end of a module's name: escape the dots
        rank_pattern = {**{re.escape(n): r for n, r in ranks.items()}, **rank_pattern}
    scaling = (alpha if alpha is not None else 2 * rank) / rank
    config = LoraConfig(r=rank, lora_alpha=float(alpha if alpha is not None else 2 * rank), lora_dropout=dropout,
                        target_modules=quantized_targets(model, targets) + head, bias="none", task_type="CAUSAL_LM",
                        rank_pattern=rank_pattern, alpha_pattern={k: float(scaling * r) for k, r in rank_pattern.items()})
    return get_peft_model(model, register_head_lora(register_quant_lora(config)))


def lora_modules(peft_model: nn.Module) -> dict[str, nn.Module]:
    """``{layer name in the base model: PEFT LoRA layer}`` for every layer with a 'default' adapter."""
    return {name.removeprefix("base_model.model."): mod for name, mod in peft_model.named_modules()
            if hasattr(mod, "lora_A") and "default" in getattr(mod, "lora_A", {})}


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


def _weighting(gram: torch.Tensor | None, inputs: torch.Tensor | None, damp: float, n_in: int, dtype: torch.dtype,
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
    h = _weighting(gram, inputs, damp, in_f, dtype, dev)
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
    modules = dict(teacher.named_modules())
    missing = sorted(set(layers) - set(modules))
    if missing:
        raise QRecoverError(f"the unquantized model has no layers {missing[:3]}: it is not the model this checkpoint "
                            "was compressed from; use --init zero")
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


def adapter_layers(peft_model: nn.Module) -> dict[str, tuple[int, int, int]]:
    """``{layer name: (rank, in_features, out_features)}`` for every adapted layer."""
    out = {}
    for name, mod in lora_modules(peft_model).items():
        a, b = mod.lora_A["default"].weight, mod.lora_B["default"].weight
        out[name] = (a.shape[0], a.shape[1], b.shape[0])
    return out


def expected_bytes(layers: dict[str, tuple[int, int, int]]) -> int:
    """16-bit bytes of the adapter tensors: ``2 * r * (in + out)`` per layer."""
    return sum(2 * r * (i + o) for r, i, o in layers.values())


def save_adapter(peft_model: nn.Module, out: Path, base: dict[str, str], parameters: int,
                 extra: dict[str, Any] | None = None, bits: int = 16) -> dict[str, Any]:
    """Write the PEFT adapter directory (16-bit tensors) and ``qrecover_adapter.json`` into ``out``.

    ``bits=8``: the adapter is ``adapter_model.int8.safetensors`` (per-row int8 + fp16 scales,
    :mod:`qrecover.recovery.adapter_int8`), its bytes the ones counted; ``adapter_model.safetensors`` then holds the
    same values expanded to fp16 for PEFT. ``out`` should be a fresh (temporary) directory; callers move it into
    place atomically.
    """
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu", SAVE_DTYPE).contiguous() for k, v in get_peft_model_state_dict(
        peft_model, save_embedding_layers=False).items()}  # never the base embedding (a head adapter targets lm_head)
    bad = [k for k, v in state.items() if not torch.isfinite(v).all()]
    if bad:
        raise QRecoverError(f"adapter tensors {bad[:3]} are not finite in 16 bits; lower the learning rate")
    int8_bytes = None
    if bits == 8:
        int8_bytes, state = save_int8(state, out / INT8_FILE)
    save_file(state, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = peft_model.peft_config["default"]
    config.base_model_name_or_path = base["path"]
    config.save_pretrained(str(out))
    layers = adapter_layers(peft_model)
    tensor_bytes = sum(v.numel() * v.element_size() for v in state.values()) if int8_bytes is None else int8_bytes
    file_bytes = (out / ("adapter_model.safetensors" if int8_bytes is None else INT8_FILE)).stat().st_size
    meta = {
        "format": "qrecover-adapter", "format_version": ADAPTER_FORMAT_VERSION, "base": base,
        "rank": config.r, "alpha": config.lora_alpha,
        "dtype": str(SAVE_DTYPE).removeprefix("torch.") if int8_bytes is None else "int8 per row + float16 scales",
        "layers": len(layers), "target_modules": sorted(layers),
        "bytes": {"tensors": tensor_bytes, "expected_16bit": expected_bytes(layers), "file": file_bytes},
        "base_parameters": parameters,
        "bpw_cost": tensor_bytes * 8 / parameters,
        **(extra or {}),
    }
    (out / ADAPTER_META).write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def check_adapter_files(adapter: str | Path) -> None:
    """Refuse, before any model is loaded, an adapter directory PEFT could not read: ``adapter_config.json``
    missing or not a JSON object, ``adapter_model.safetensors`` missing, truncated or with a corrupt header."""
    adapter = Path(adapter)
    fix = "re-export or copy the adapter again (the --out directory of `qrecover recover` / `qrecover finetune`)"
    if not (adapter / "adapter_config.json").is_file():
        raise QRecoverError(f"{str(adapter)!r} is not a PEFT adapter directory (no adapter_config.json); "
                            "pass the --out directory of `qrecover recover`")
    config = read_json(adapter / "adapter_config.json", "adapter config", "")
    if not isinstance(config, dict) or "peft_type" not in config:
        raise QRecoverError(f"adapter config {str(adapter / 'adapter_config.json')!r} is not a PEFT adapter config (a "
                            f"JSON object with a peft_type); {fix}")
    weights = adapter / "adapter_model.safetensors"
    if not weights.is_file():
        if (adapter / "adapter_model.bin").is_file():  # a foreign PEFT adapter in the old format: PEFT reads it
            return
        raise QRecoverError(f"adapter {str(adapter)!r} has no adapter_model.safetensors; {fix}")
    try:
        with safe_open(str(weights), framework="pt") as f:
            f.keys()
    except SafetensorError as e:
        raise QRecoverError(f"adapter weights {str(weights)!r} are truncated or corrupt ({e}); {fix}") from None


def read_adapter_meta(adapter: str | Path) -> dict[str, Any]:
    adapter = Path(adapter)
    if not (adapter / "adapter_config.json").is_file():
        raise QRecoverError(f"{str(adapter)!r} is not a PEFT adapter directory (no adapter_config.json); "
                            "pass the --out directory of `qrecover recover`")
    meta_path = adapter / ADAPTER_META
    if not meta_path.is_file():
        raise QRecoverError(f"{str(adapter)!r} has no {ADAPTER_META}: it was not written by qrecover, so its base "
                            "cannot be checked; pass --allow-foreign-adapter to load it anyway")
    return read_json(meta_path, "adapter record", "")


def check_base(adapter: str | Path, checkpoint: str | Path, allow_foreign: bool = False) -> dict[str, Any] | None:
    """Refuse an adapter trained on another checkpoint (compares manifest and weights hashes), or one whose
    files PEFT could not read (:func:`check_adapter_files`)."""
    check_adapter_files(adapter)
    try:
        meta = read_adapter_meta(adapter)
    except QRecoverError:
        if allow_foreign:
            return None
        raise
    here = base_identity(checkpoint)
    trained = meta.get("base", {})
    same = (trained.get("manifest_sha256") == here["manifest_sha256"]
            and trained.get("weights_sha256") == here["weights_sha256"])
    if not same and not allow_foreign:
        raise QRecoverError(
            f"adapter {str(adapter)!r} was trained on checkpoint {trained.get('path')!r} (manifest sha256 "
            f"{str(trained.get('manifest_sha256'))[:12]}...), not on {str(checkpoint)!r} (manifest sha256 "
            f"{here['manifest_sha256'][:12]}...): its corrections do not fit these weights. Use the adapter trained "
            "for this checkpoint, or pass --allow-foreign-adapter to load it anyway")
    return meta


def peft_from_pretrained(model: nn.Module, adapter: str | Path, trainable: bool = False):
    """``PeftModel.from_pretrained(model, adapter)`` with qrecover's LoRA layer on the quantized layers
    (:func:`~qrecover.recovery.peft_quant.register_quant_lora`), so that merging changes the packed weights."""
    config = PeftConfig.from_pretrained(str(adapter))
    if isinstance(config, LoraConfig):
        register_head_lora(register_quant_lora(config))
    return PeftModel.from_pretrained(model, str(adapter), is_trainable=trainable, config=config)


def load_adapter(model: nn.Module, adapter: str | Path, checkpoint: str | Path, allow_foreign: bool = False,
                 trainable: bool = False):
    """:func:`peft_from_pretrained` after checking the adapter belongs to ``checkpoint``."""
    check_base(adapter, checkpoint, allow_foreign)
    return peft_from_pretrained(model, adapter, trainable)


def adapter_summary(adapter: str | Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """``{path, rank, bpw_cost}`` of an adapter directory; the cost from the bytes of its stored tensors."""
    adapter = Path(adapter)
    config = json.loads((adapter / "adapter_config.json").read_text())
    size = {"F16": 2, "BF16": 2, "F32": 4, "I8": 1}
    weights = adapter / INT8_FILE if (adapter / INT8_FILE).is_file() else adapter / "adapter_model.safetensors"
    with safe_open(str(weights), framework="pt") as f:
        nbytes = sum(math.prod(f.get_slice(k).get_shape()) * size[f.get_slice(k).get_dtype()] for k in f.keys())
    return {"path": str(adapter), "rank": int(config["r"]), "bpw_cost": nbytes * 8 / manifest["parameters"]["model"]}

"""Orthogonal matrices for rotations: Hadamard matrices of any order built from known ones, block-diagonal
Hadamard matrices, and seeded random orthogonal matrices. Everything is float64 and deterministic.

Hadamard orders (a Hadamard matrix ``H`` of order ``n`` has entries +-1 and ``H H^T = n I``):

- Sylvester: every power of two, ``H_2k = [[H_k, H_k], [H_k, -H_k]]``;
- Paley I: ``q + 1`` for a prime ``q = 3 (mod 4)`` (4, 8, 12, 20, 24, 32, 44, 48, 60, ...), from the
  Jacobsthal matrix ``Q[i, j] = legendre(j - i, q)``: ``H = I + [[0, 1^T], [-1, Q]]``;
- Paley II: ``2 (q + 1)`` for a prime ``q = 1 (mod 4)`` (12, 28, 36, 60, 76, 108, ...), from the symmetric
  conference matrix ``C = [[0, 1^T], [1, Q]]``: ``H = C (x) [[1, 1], [1, -1]] + I (x) [[1, -1], [-1, -1]]``;
- Kronecker products of the above: ``H_a (x) H_b`` has order ``a b`` (576 = 12 x 48, 1536 = 12 x 128).

This is how QuaRot's and llm-compressor's Hadamard utilities reach non-power-of-two sizes (a stored matrix
of order 12, 20, 28, ... times a power of two); here the small factors are constructed instead of stored.

:func:`rotation` returns the orthogonal matrix a rotation uses, by ``kind``:

- ``hadamard``: ``diag(s) H / sqrt(n)`` with ``s`` seeded random signs (a randomised Hadamard, as QuaRot);
- ``block``: block-diagonal, each block a randomised Sylvester Hadamard of the largest power of two that
  divides ``n`` (576 -> 9 blocks of 64; 1536 -> 3 of 512): it only mixes within a block;
- ``random``: a seeded Haar-random orthogonal matrix (QR of a Gaussian matrix, signs fixed by ``R``'s diagonal);
- ``fwht``: ``diag(s) (H_p (x) H_b) / sqrt(n)`` with ``b`` the largest power of two such that ``p = n / b`` is 1 or a
  Paley order (1536 = 12 x 128, 576 = 36 x 16): the rotation an online transform applies, in
  ``O(n (log b + p))`` per row (:func:`rotate`: butterflies along ``b``, a ``p x p`` product) instead of ``n^2``.

:func:`rotate` applies ``x @ rotation(n, kind, seed)`` to rows: fast for ``fwht``, a dense product otherwise.
"""

from __future__ import annotations

import importlib.util
import math
import os
from functools import lru_cache

import torch

from ..errors import QRecoverError

KINDS = ("hadamard", "block", "random", "fwht")
_MAX_PRIME = 1024


def _is_prime(q: int) -> bool:
    return q >= 2 and all(q % d for d in range(2, int(math.isqrt(q)) + 1))


def _jacobsthal(q: int) -> torch.Tensor:
    """``(q, q)`` ``Q[i, j] = legendre(j - i, q)`` (0 on the diagonal) for a prime ``q``."""
    squares = {(x * x) % q for x in range(1, q)}
    chi = torch.tensor([0.0] + [1.0 if a in squares else -1.0 for a in range(1, q)], dtype=torch.float64)
    idx = (torch.arange(q)[None, :] - torch.arange(q)[:, None]) % q
    return chi[idx]


def paley_orders() -> dict[int, tuple[str, int]]:
    """Non-power-of-two orders the Paley constructions give (primes up to 1024): ``{order: (kind, q)}``."""
    out: dict[int, tuple[str, int]] = {}
    for q in range(3, _MAX_PRIME):
        if not _is_prime(q):
            continue
        n, kind = (q + 1, "paley1") if q % 4 == 3 else (2 * (q + 1), "paley2")
        if n & (n - 1):  # powers of two come from Sylvester
            out.setdefault(n, (kind, q))
    return out


def _paley(kind: str, q: int) -> torch.Tensor:
    Q = _jacobsthal(q)
    ones = torch.ones(q, dtype=torch.float64)
    if kind == "paley1":
        S = torch.zeros(q + 1, q + 1, dtype=torch.float64)
        S[0, 1:], S[1:, 0], S[1:, 1:] = ones, -ones, Q
        return torch.eye(q + 1, dtype=torch.float64) + S
    C = torch.zeros(q + 1, q + 1, dtype=torch.float64)
    C[0, 1:], C[1:, 0], C[1:, 1:] = ones, ones, Q
    a = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    b = torch.tensor([[1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
    return torch.kron(C, a) + torch.kron(torch.eye(q + 1, dtype=torch.float64), b)


def _sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


@lru_cache(maxsize=None)
def factors(n: int) -> tuple[int, ...] | None:
    """Orders whose Kronecker product is a Hadamard matrix of order ``n`` (a power of two last), or None."""
    if n < 1:
        return None
    if n & (n - 1) == 0:
        return (n,)
    for p in sorted(paley_orders(), reverse=True):
        if n % p == 0 and (rest := factors(n // p)) is not None:
            return (p, *rest)
    return None


@lru_cache(maxsize=32)
def _hadamard(n: int) -> torch.Tensor:
    fs = factors(n)
    if fs is None:
        raise QRecoverError(f"no Hadamard matrix of order {n} can be built here (orders: 1, 2, multiples of 4 that are a "
                            "power of two times products of Paley orders); use rotation kind 'random' or 'block'")
    orders = paley_orders()
    h = torch.ones(1, 1, dtype=torch.float64)
    for f in fs:
        h = torch.kron(h, _sylvester(f) if f & (f - 1) == 0 else _paley(*orders[f]))
    return h


def hadamard(n: int) -> torch.Tensor:
    """``(n, n)`` float64 Hadamard matrix (entries +-1, ``H H^T = n I``); QRecoverError for an order not built."""
    return _hadamard(n).clone()


def _signs(n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 2, (n,), generator=gen, dtype=torch.int64).to(torch.float64) * 2 - 1


def rotation(n: int, kind: str = "hadamard", seed: int = 0) -> torch.Tensor:
    """``(n, n)`` float64 orthogonal matrix of ``kind`` (see the module docstring), seeded by ``seed``."""
    gen = torch.Generator().manual_seed(int(seed))
    if kind == "hadamard":
        return _signs(n, gen)[:, None] * hadamard(n) / math.sqrt(n)
    if kind == "block":
        b = n & -n  # the largest power of two dividing n
        blocks = [_signs(b, gen)[:, None] * _sylvester(b) / math.sqrt(b) for _ in range(n // b)]
        return torch.block_diag(*blocks)
    if kind == "fwht":
        p, b = fast_factors(n)
        return _signs(n, gen)[:, None] * torch.kron(_small(p), _sylvester(b)) / math.sqrt(n)
    if kind == "random":
        q, r = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
        return q * torch.sign(torch.diagonal(r))[None, :]
    raise QRecoverError(f"unknown rotation kind {kind!r}; choose from {list(KINDS)}")


@lru_cache(maxsize=None)
def fast_factors(n: int) -> tuple[int, int]:
    """``(p, b)``, ``n = p b``: ``b`` the largest power of two leaving ``p`` 1 or a Paley order (the ``fwht`` kind's
    factors); QRecoverError where there is none."""
    b = n & -n if n > 0 else 0
    while b >= 1:
        if n // b == 1 or n // b in paley_orders():
            return n // b, b
        b //= 2
    raise QRecoverError(f"no fast Hadamard transform of order {n} (orders: a power of two times 1 or a Paley order); "
                        "use rotation kind 'random' or 'block'")


@lru_cache(maxsize=32)
def _small(p: int) -> torch.Tensor:
    return torch.ones(1, 1, dtype=torch.float64) if p == 1 else _paley(*paley_orders()[p])


@lru_cache(maxsize=64)
def fwht_operands(n: int, seed: int, device: str = "cpu", dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``fwht`` rotation's signs ``(n,)`` and small factor ``(p, p)`` over ``sqrt(n)``, in ``dtype`` on ``device``
    (cached: an online rotation copies nothing to the device per call, so it can run inside a CUDA graph)."""
    p, _ = fast_factors(n)
    s = _signs(n, torch.Generator().manual_seed(int(seed)))
    return s.to(device, dtype), (_small(p) / math.sqrt(n)).to(device, dtype)


def fwht(x: torch.Tensor) -> torch.Tensor:
    """``x @ H_b`` along the last dimension (``b`` a power of two, Sylvester's order, unnormalised): ``log2 b``
    butterfly stages of adds and subtracts."""
    b = x.shape[-1]
    lead = x.shape[:-1]
    y, h = x.reshape(-1, b), 1
    while h < b:
        y = y.view(-1, b // (2 * h), 2, h)
        y = torch.stack((y[:, :, 0] + y[:, :, 1], y[:, :, 0] - y[:, :, 1]), dim=2)
        h *= 2
    return y.reshape(*lead, b)


@lru_cache(maxsize=None)
def _has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def _kernel(n: int, p: int, b: int, dtype: torch.dtype) -> bool:
    """Whether a CUDA input takes the Triton kernel: triton installed, ``QRECOVER_KERNELS`` not ``0``, and the sizes
    served in this dtype (fp16/bf16: :func:`qrecover.kernels.fwht.supported`)."""
    if os.environ.get("QRECOVER_KERNELS", "auto") == "0" or not _has_triton():
        return False
    from ..kernels import fwht as kernel  # here: triton is optional

    return kernel.supported(n, p, b, dtype)


@lru_cache(maxsize=32)
def kernel_factor(n: int, device: str) -> torch.Tensor:
    """The kernel's ``A (P, P)`` float32 on ``device`` (:func:`qrecover.kernels.fwht.rotate_rows`): the ``fwht``
    rotation's Paley factor times Sylvester's order ``b / B``, over ``sqrt(n)`` (``B = min(b, 128)``)."""
    from ..kernels.fwht import split  # here: triton is optional

    p, b = fast_factors(n)
    _, B = split(n, p, b)
    return (torch.kron(_small(p), _sylvester(b // B)) / math.sqrt(n)).to(device, torch.float32).contiguous()


def rotate(x: torch.Tensor, n: int, kind: str, seed: int) -> torch.Tensor:
    """``x @ rotation(n, kind, seed)`` for rows ``x (..., n)``, in ``x``'s dtype: for ``fwht`` the signs, ``log2 b``
    butterfly stages and one ``p x p`` product (the torch reference of the online transform; a CUDA input takes the
    Triton kernel of :mod:`qrecover.kernels.fwht` where it serves the size); otherwise the dense product."""
    if kind != "fwht":
        return x @ rotation(n, kind, seed).to(x.device, x.dtype)
    p, b = fast_factors(n)
    if x.is_cuda and _kernel(n, p, b, x.dtype):
        from ..kernels import fwht as kernel  # here: triton is optional, and only a CUDA input needs it

        return kernel.rotate_rows(x, fwht_operands(n, seed, str(x.device), torch.float32)[0], kernel_factor(n, str(x.device)))
    s, small = fwht_operands(n, seed, str(x.device), x.dtype)
    y = fwht((x * s).reshape(*x.shape[:-1], p, b))
    y = torch.einsum("...kl,ki->...il", y, small)
    return y.reshape(x.shape)


__all__ = ["KINDS", "factors", "fast_factors", "fwht", "fwht_operands", "hadamard", "kernel_factor", "paley_orders", "rotate",
           "rotation"]

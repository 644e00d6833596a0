"""Rank per layer under an adapter budget (qrecover/adapters/rank_alloc.py): the spectra against float64 SVDs, the
greedy allocation against brute force, the budget, and an end-to-end recover run whose adapter plain PEFT reads."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from qrecover.adapters.lora import attach_lora, lora_modules
from qrecover.adapters.rank_alloc import allocate_ranks, damage_ranks, top_spectrum
from qrecover.adapters.svd_init import lowrank_correction
from qrecover.errors import QRecoverError
from qrecover.loading import load


def _weighted_svd(error: torch.Tensor, x: torch.Tensor, damp: float = 0.01) -> torch.Tensor:
    """Squared singular values of E S with S S^T = H = X^T X / n + damp * mean(diag) I, by a float64 full SVD."""
    h = x.double().T @ x.double() / x.shape[0]
    h = h + damp * h.diagonal().mean() * torch.eye(h.shape[0], dtype=torch.float64)
    s = torch.linalg.cholesky(h)
    return torch.linalg.svdvals(error.double() @ s).square()


@pytest.mark.parametrize("shape", [(24, 40), (40, 24)])
def test_top_spectrum_equals_the_weighted_error_svd(shape):
    g = torch.Generator().manual_seed(0)
    error = torch.randn(*shape, generator=g, dtype=torch.float64)
    x = torch.randn(300, shape[1], generator=g) @ torch.randn(shape[1], shape[1], generator=g)  # correlated inputs
    s2, total = top_spectrum(error, 10, x)
    ref = _weighted_svd(error, x)
    assert torch.allclose(s2, ref[:10], rtol=1e-9)
    assert total == pytest.approx(float(ref.sum()), rel=1e-9)


def test_top_spectrum_randomized_path_for_wide_layers():
    g = torch.Generator().manual_seed(1)
    # a wide layer (above EXACT_MAX_WIDTH) with a decaying spectrum, as quantization errors have
    u = torch.linalg.qr(torch.randn(2100, 40, generator=g, dtype=torch.float64))[0]
    v = torch.linalg.qr(torch.randn(64, 40, generator=g, dtype=torch.float64))[0]
    error = (u * torch.logspace(0, -3, 40, dtype=torch.float64)) @ v.T
    x = torch.randn(256, 64, generator=g)
    s2, total = top_spectrum(error, 8, x)
    ref = _weighted_svd(error, x)
    assert torch.allclose(s2, ref[:8], rtol=1e-3)
    assert total == pytest.approx(float(ref.sum()), rel=1e-4)


def test_the_spectrum_is_what_the_svd_init_removes():
    """A rank-k svd init (lowrank_correction) removes sum(s2[:k]) of tr(E H E^T): the allocator's objective is exact."""
    g = torch.Generator().manual_seed(2)
    error = torch.randn(30, 20, generator=g, dtype=torch.float64)
    x = torch.randn(200, 20, generator=g, dtype=torch.float64)
    s2, total = top_spectrum(error, 20, x)
    h = x.T @ x / x.shape[0]
    h = h + 0.01 * h.diagonal().mean() * torch.eye(20, dtype=torch.float64)
    for k in (1, 4, 9):
        b, a = lowrank_correction(error, x.T @ x / x.shape[0], k, scaling=2.0)
        rest = error - 2.0 * b @ a
        left = float(torch.trace(rest @ h @ rest.T))
        assert total - left == pytest.approx(float(s2[:k].sum()), rel=1e-8)


def _brute_force(spectra, damage, shapes, budget, step, max_rank):
    names = list(spectra)
    ladders = [range(0, min(max_rank, *shapes[n]) // step * step + 1, step) for n in names]
    best, best_value = None, -1.0
    for combo in itertools.product(*ladders):
        if sum(r * sum(shapes[n]) for n, r in zip(names, combo)) > budget:
            continue
        value = sum(damage[n] * float(spectra[n][0][:r].sum()) / spectra[n][1] for n, r in zip(names, combo))
        if value > best_value + 1e-12:
            best, best_value = dict(zip(names, combo)), value
    return best, best_value


@pytest.mark.parametrize("seed", range(4))
def test_greedy_allocation_is_the_brute_force_optimum_for_equal_shapes(seed):
    g = torch.Generator().manual_seed(seed)
    shapes = {f"l{i}": (16, 16) for i in range(4)}
    spectra = {}
    for n in shapes:
        s2 = torch.sort(torch.rand(16, generator=g, dtype=torch.float64) ** (1 + 4 * torch.rand(1, generator=g).item()),
                        descending=True).values
        spectra[n] = (s2, float(s2.sum()))
    damage = {n: float(torch.rand(1, generator=g)) for n in shapes}
    budget = 8 * 32 * 4 // 2  # rank 4 on average ... of 0..8 per layer in steps of 2
    ranks = allocate_ranks(spectra, damage, shapes, budget, step=2, max_rank=8)
    best, best_value = _brute_force(spectra, damage, shapes, budget, 2, 8)
    value = sum(damage[n] * float(spectra[n][0][:r].sum()) / spectra[n][1] for n, r in ranks.items())
    assert value == pytest.approx(best_value, rel=1e-12)
    assert sum(r * 32 for r in ranks.values()) <= budget


def test_allocation_follows_damage_and_spectrum_within_the_budget():
    flat = torch.ones(32, dtype=torch.float64)  # error spread evenly over 32 directions
    steep = torch.zeros(32, dtype=torch.float64)
    steep[:2] = 1.0  # all of it in 2 directions
    spectra = {"a": (flat, 32.0), "b": (flat, 32.0), "c": (steep, 2.0), "d": (torch.zeros(32, dtype=torch.float64), 0.0)}
    shapes = {"a": (32, 64), "b": (32, 64), "c": (32, 64), "d": (32, 64)}
    damage = {"a": 10.0, "b": 1.0, "c": 1.0, "d": 100.0}
    budget = 8 * 96 * 4
    ranks = allocate_ranks(spectra, damage, shapes, budget, step=2, max_rank=32)
    assert ranks["d"] == 0  # no error to remove, whatever its damage
    assert ranks["c"] == 2  # two directions hold all its error: more rank buys nothing
    assert ranks["a"] > ranks["b"]  # same spectrum, ten times the damage
    assert sum(r * 96 for r in ranks.values()) <= budget
    assert budget - sum(r * 96 for r in ranks.values()) < 2 * 96 or ranks["a"] == 32  # spent up to the last step
    with pytest.raises(QRecoverError, match="step"):
        allocate_ranks(spectra, damage, shapes, budget, step=0, max_rank=32)


def test_damage_ranks_on_a_checkpoint_keep_the_uniform_size_and_remove_more(tiny_ckpt, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = load(tiny_ckpt)
    teacher = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    names = [n for n, info in model.qrecover_manifest["layers"].items() if info["kind"] == "linear"]
    windows = torch.randint(0, 49152, (2, 64), generator=torch.Generator().manual_seed(0))
    out = damage_ranks(model, teacher, windows, names, rank=4)
    mods = dict(model.named_modules())
    uniform = 4 * sum(mods[n].in_features + mods[n].out_features for n in names)
    assert out["budget"] == uniform
    assert out["parameters"] == sum(r * (mods[n].in_features + mods[n].out_features) for n, r in out["ranks"].items())
    assert uniform - 4 * 64 * 3 < out["parameters"] <= uniform  # spent up to about one step of the widest layer
    assert len(set(out["ranks"].values())) > 1  # not uniform
    assert all(r % 1 == 0 and 0 < r <= 16 for r in out["ranks"].values())
    assert out["expected_removed"] >= out["uniform_removed"]
    # PEFT builds the adapter with exactly these ranks (escaped rank_pattern keys: layers.1 is not layers.11)
    peft_model = attach_lora(model, 4, ranks=out["ranks"])
    got = {n: m.lora_A["default"].weight.shape[0] for n, m in lora_modules(peft_model).items()}
    assert got == out["ranks"]
    assert all(m.scaling["default"] == 2.0 for m in lora_modules(peft_model).values())


def test_recover_with_damage_ranks_writes_a_plain_peft_adapter(tiny_ckpt, tiny_model_dir, text_mix, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from qrecover.recovery.api import recover
    from qrecover.recovery.config import RecoverConfig

    cfg = RecoverConfig(rank=4, rank_allocation="damage", tokens=128, seq_len=64, mix=str(text_mix), checkpoint_every=0)
    meta = recover(tiny_ckpt, tmp_path / "ad", cfg, show_progress=False)
    alloc = meta["rank_allocation"]
    config = json.loads((tmp_path / "ad" / "adapter_config.json").read_text())
    assert set(config["target_modules"]) == set(alloc["ranks"])
    assert meta["bytes"]["tensors"] == 2 * alloc["parameters"]  # fp16: the allocated parameters, no more
    plain = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), str(tmp_path / "ad"))
    got = {n.removeprefix("base_model.model."): m.lora_A["default"].weight.shape[0]
           for n, m in plain.named_modules() if hasattr(m, "lora_A") and "default" in m.lora_A}
    assert got == alloc["ranks"]


def test_bad_rank_allocation_is_a_one_line_error():
    from qrecover.recovery.config import RecoverConfig

    with pytest.raises(QRecoverError, match="--rank-allocation 'spectral' is unknown"):
        RecoverConfig(rank_allocation="spectral")

"""Shared fixtures: a tiny seeded Llama saved with the real SmolLM2 tokenizer, and one compressed checkpoint of it.

``tiny_model_dir``: a 2-layer, hidden-64 Llama with the real 49152-token vocabulary (tied embedding), so
the tokenizer, the python-docs calibration text and the embedding code paths are the real ones while a
full compression takes seconds. ``tiny_ckpt``: that model compressed at 5.0 bpw (every linear layer fits
at its best width; the smallest reachable whole-model bpw of this model is ~4.2 because the 49152x64
embedding dominates).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels (tests/test_kernels.py) run in its interpreter on CPU. Set before anything imports
    # triton: some of its state is read at import or decoration time, and other tests' imports may load it.
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The README's test command runs the suite in pytest-xdist workers (`-n auto`): one per core, at most 4 (a worker
# peaks near 4 GB compressing the default model). Most tests are short and single-threaded, so two workers on 2 cores
# took the suite from 21-26 to 16 min here (2026-11-29). Each worker takes its share of the cores: two workers at
# torch's default of every core would oversubscribe them (LAPACK 20-50x slower on 2 cores). Subprocesses the tests
# start (torchrun, the CLI) inherit the setting through OMP_NUM_THREADS.
_CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _threads = max(1, _CORES // _WORKERS)
    os.environ["OMP_NUM_THREADS"] = str(_threads)
    torch.set_num_threads(_threads)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: without xdist (`-p no:xdist`) pytest would refuse it
def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one worker per core, at most 4 (memory, above)."""
    return min(4, _CORES)


TINY_CONFIG = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=True,
    max_position_embeddings=512,
)


def build_tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY_CONFIG))
    model.eval()
    return model


@pytest.fixture(scope="session", autouse=True)
def _subprocess_tmpdir(tmp_path_factory):
    """The processes tests start write their temporary files under this session's pytest directory, not /tmp:
    torchrun makes a ``torchelastic_*`` log directory per launch and leaves it."""
    old = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(tmp_path_factory.mktemp("subprocess-tmp"))
    yield
    if old is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = old


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from transformers import AutoTokenizer

    from qrecover.models import default_model_dir

    d = tmp_path_factory.mktemp("tiny-llama")
    model = build_tiny_model()
    tok = AutoTokenizer.from_pretrained(default_model_dir())
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d


# the fixtures test mechanics on the menu they were written for (AFM's palettize:2,3,4, the default until 2026-11);
# the default menu (mixed-blocks) has its own tests
TINY_CKPT_CFG = dict(bpw=5.0, calib_samples=2, seq_len=64, bits=[2, 3, 4])


@pytest.fixture(scope="session")
def tiny_ckpt(tiny_model_dir, tmp_path_factory) -> Path:
    from qrecover.api import compress
    from qrecover.config import CompressConfig

    out = tmp_path_factory.mktemp("ckpt") / "tiny-5bpw"
    compress(CompressConfig(model=str(tiny_model_dir), **TINY_CKPT_CFG), out=out, show_progress=False)
    return out


@pytest.fixture(scope="session")
def tiny_prepared(tiny_model_dir):
    """The expensive stage of compression for the tiny model (bits 2,3,4, palettize), reused for several budgets."""
    from qrecover.api import prepare
    from qrecover.config import CompressConfig

    return prepare(CompressConfig(model=str(tiny_model_dir), bpw=5.0, calib_samples=2, seq_len=64, bits=[2, 3, 4]), show_progress=False)


@pytest.fixture(scope="session")
def text_mix(tmp_path_factory) -> Path:
    """A one-source recipe over a few real Python-docs files copied to a private dir (training tests)."""
    from qrecover.data.corpus import documents

    d = tmp_path_factory.mktemp("texts")
    for i, t in enumerate(documents("python-docs", "train")[:6]):
        (d / f"doc{i}.txt").write_text(t)
    recipe = d / "mix.toml"
    recipe.write_text(f'[[source]]\nname = "docs"\nkind = "text"\npath = "{d}/*.txt"\nweight = 1.0\n')
    return recipe


@pytest.fixture(scope="module")
def interp():
    """The Triton kernel modules, built for triton's interpreter when there is no GPU (tests/kernel_helpers.py)."""
    from kernel_helpers import interpreted_kernels

    yield from interpreted_kernels()

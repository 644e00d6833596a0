"""Chunked distillation (qrecover/recovery/objective.py): equal to the full-logits loss, with less memory.

Checks that :func:`chunked_loss` gives :func:`loss_fn`'s loss and gradients (float64 to 1e-10, float32 to 1e-5) for
ce/kd/mix, temperatures, masked labels, Gemma-style soft-capping and every chunk size, recomputing each chunk in
backward or fused (gradient in the forward pass); that :func:`step_loss` takes the hidden states and head of real
(tiny, random) Llama, Qwen2, Gemma-2/3 (and Gemma-3 multimodal), Phi-3 and Mistral models through PEFT and matches
the unchunked loss and gradients, and falls back to full logits for a model whose logits are something its head
does not give; that the peak memory of a 2 x 256 x 50k-vocabulary distillation step is several times
lower chunked (separate processes, peak resident memory); that a training run chunked ends with the adapter of
an unchunked one; and the teacher's placement and the settings' validation.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import transformers as T
from cli_helpers import run as cli
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from qrecover.errors import QRecoverError
from qrecover.loading import load
from qrecover.recovery import objective as O
from qrecover.recovery.api import recover
from qrecover.recovery.config import RecoverConfig


def _setup(dtype, softcap=None, seed=0, batch=3, seq=17, hidden=8, vocab=50):
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn(batch, seq, hidden, generator=g, dtype=dtype)
    ht = torch.randn(batch, seq, hidden + 3, generator=g, dtype=dtype)
    head_s, head_t = nn.Linear(hidden, vocab).to(dtype), nn.Linear(hidden + 3, vocab, bias=False).to(dtype)
    with torch.no_grad():
        for p in (*head_s.parameters(), head_t.weight):
            p.copy_(3 * torch.randn(p.shape, generator=g, dtype=dtype))
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    labels[0, :5] = -100  # a prompt
    labels[1, 9] = -100
    labels[2, -1] = -100
    return hs, ht, O._make_head(head_s, softcap), O._make_head(head_t, softcap), head_s, labels


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("objective", ["ce", "kd", "mix"])
@pytest.mark.parametrize("softcap, temperature", [(None, 1.0), (None, 2.0), (5.0, 1.0)])
def test_chunked_loss_and_gradients_equal_the_full_logits(dtype, tol, objective, softcap, temperature):
    hs, ht, f_s, f_t, head_s, labels = _setup(dtype, softcap)
    hs.requires_grad_(True)
    full = O.loss_fn(objective, f_s(hs), labels, f_t(ht), kd_weight=0.3, temperature=temperature)
    assert full.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    want = torch.autograd.grad(full, [hs, head_s.weight, head_s.bias])
    for chunk, fused in ((1, False), (7, False), (10_000, False), (1, True), (7, True), (10_000, True)):
        got_loss = O.chunked_loss(objective, hs, labels, f_s, ht, f_t, kd_weight=0.3, temperature=temperature, chunk=chunk,
                                  fused=fused)
        # fused: the gradient reaches the hidden states only (the heads are frozen where it is used)
        got = torch.autograd.grad(3.0 * got_loss, [hs] if fused else [hs, head_s.weight, head_s.bias])
        got = [g / 3.0 for g in got]  # backward scales by the incoming gradient
        got_loss, full_v = float(got_loss.detach()), float(full.detach())
        assert abs(got_loss - full_v) <= tol * abs(full_v), (chunk, got_loss, full_v)
        for g, w in zip(got, want):
            assert float((g - w).abs().max()) <= tol * float(w.abs().max()), chunk
    if objective == "ce":  # the teacher is not needed
        assert torch.equal(O.chunked_loss("ce", hs, labels, f_s, chunk=4), O.chunked_loss("ce", hs, labels, f_s, ht, f_t, chunk=4))


def test_softcapping_changes_the_loss():
    """The soft-capped head is really applied (else the softcap cases above would pass against the wrong loss)."""
    hs, ht, f_s, f_t, _, labels = _setup(torch.float64, softcap=5.0)
    _, _, g_s, g_t, _, _ = _setup(torch.float64, softcap=None)
    a = O.chunked_loss("mix", hs, labels, f_s, ht, f_t, chunk=8)
    b = O.chunked_loss("mix", hs, labels, g_s, ht, g_t, chunk=8)
    assert abs(float(a - b)) > 1e-2


def test_all_labels_masked_gives_nan_as_the_full_loss():
    hs, ht, f_s, f_t, _, labels = _setup(torch.float64)
    labels[:] = -100
    hs.requires_grad_(True)
    for fused in (False, True):
        got = O.chunked_loss("kd", hs, labels, f_s, ht, f_t, chunk=4, fused=fused)
        assert torch.isnan(got) and got.requires_grad
    assert torch.isnan(O.loss_fn("kd", f_s(hs), labels, f_t(ht)))


def test_chunked_loss_needs_the_teacher_for_distillation():
    hs, _, f_s, _, _, labels = _setup(torch.float64)
    with pytest.raises(ValueError, match="'kd' needs the teacher"):
        O.chunked_loss("kd", hs, labels, f_s)


# --- real architectures, through PEFT ---------------------------------------------------------------------

BASE = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.2)
ARCHS = {
    "llama": (T.LlamaConfig, dict(tie_word_embeddings=True), None),
    "qwen2": (T.Qwen2Config, dict(tie_word_embeddings=False), None),
    "gemma2": (T.Gemma2Config, dict(tie_word_embeddings=True, head_dim=8, sliding_window=8, final_logit_softcapping=3.0), "softcap"),
    "gemma3": (T.Gemma3TextConfig, dict(tie_word_embeddings=True, head_dim=8, sliding_window=8, final_logit_softcapping=3.0), "softcap"),
    "gemma3-vision": (lambda tie_word_embeddings, **text: T.Gemma3Config(
        text_config=text, tie_word_embeddings=tie_word_embeddings, mm_tokens_per_image=4, image_token_index=299,
        boi_token_index=298, eoi_token_index=297, vision_config=dict(
            hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14)),
        dict(tie_word_embeddings=True, head_dim=8, sliding_window=8), None),
    "phi3": (T.Phi3Config, dict(tie_word_embeddings=False, pad_token_id=0), None),
    "mistral": (T.MistralConfig, dict(tie_word_embeddings=False, sliding_window=8), None),
}


def _models(name):
    cls, extra, _ = ARCHS[name]
    torch.manual_seed(0)
    teacher = AutoModelForCausalLM.from_config(cls(**{**BASE, **extra}), dtype=torch.float64).eval()
    torch.manual_seed(1)
    student = AutoModelForCausalLM.from_config(teacher.config, dtype=torch.float64)
    student.load_state_dict(teacher.state_dict())
    with torch.no_grad():  # the "quantized" student: its weights a bit off
        for p in student.parameters():
            p.add_(0.05 * p.abs().mean() * torch.randn_like(p))
    targets = sorted({n.rsplit(".", 1)[-1] for n, m in student.named_modules() if isinstance(m, nn.Linear) and "layers" in n})
    peft = get_peft_model(student, LoraConfig(r=2, lora_alpha=4, target_modules=targets, init_lora_weights=False))
    peft.train()
    return peft, teacher


def NO_AUTOCAST():
    return torch.autocast("cpu", enabled=False)


def _cfg(objective, chunk, **kw):
    return RecoverConfig(objective=objective, loss_chunk=chunk, kd_weight=0.4, temperature=1.5, **kw)


@pytest.mark.parametrize("name", sorted(ARCHS))
def test_step_loss_on_real_architectures_equals_the_full_logits(name):
    peft, teacher = _models(name)
    ids = torch.randint(0, BASE["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(3))
    labels = ids.clone()
    labels[0, :6] = -100
    base = peft.get_base_model()
    head = O.output_head(peft, ids)
    assert head is not None  # not the fallback
    assert O._HEADS[base][0] == (ARCHS[name][2] or "none")
    params = [p for n, p in peft.named_parameters() if p.requires_grad and "vision" not in n]  # text input only
    for objective in ("ce", "mix"):
        results = []
        for chunk in (0, 5):  # 0: full logits, today's path
            loss = O.step_loss(peft, teacher, ids, labels, _cfg(objective, chunk), NO_AUTOCAST)
            results.append((float(loss), torch.autograd.grad(loss, params)))
        (l0, g0), (l1, g1) = results
        assert abs(l1 - l0) <= 1e-10 * abs(l0), (objective, l0, l1)
        for a, b in zip(g0, g1):
            assert float((a - b).abs().max()) <= 1e-10 * float(a.abs().max()), objective
    # and the loss is the model's: loss_fn on the full logits of each model
    with torch.no_grad():
        want = O.loss_fn("kd", peft(input_ids=ids).logits, labels, teacher(input_ids=ids).logits, temperature=1.5)
        got = O.step_loss(peft, teacher, ids, labels, _cfg("kd", 7), NO_AUTOCAST)
    assert abs(float(got - want)) <= 1e-10 * float(want)


class _ScaledLlama(T.LlamaForCausalLM):
    """Logits post-processed in a way objective.py does not know (as Cohere's logit_scale)."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 0.5
        return out


def test_unknown_logit_post_processing_falls_back_to_full_logits():
    torch.manual_seed(0)
    teacher = _ScaledLlama(T.LlamaConfig(**BASE)).double().eval()
    student = _ScaledLlama(teacher.config).double()
    student.load_state_dict(teacher.state_dict())
    ids = torch.randint(0, BASE["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(0))
    assert O.output_head(student, ids) is None
    got = O.step_loss(student, teacher, ids, ids, _cfg("kd", 4), NO_AUTOCAST)
    with torch.no_grad():
        want = O.loss_fn("kd", student(input_ids=ids).logits, ids, teacher(input_ids=ids).logits, temperature=1.5)
    assert abs(float(got - want)) <= 1e-12 * max(1.0, float(want)) and got.requires_grad


# --- memory: one chunk of vocabulary-sized tensors -----------------------------------------------------------

PEAK = textwrap.dedent("""
    import json, resource, sys, torch
    from qrecover.recovery import objective as O
    chunk = int(sys.argv[1])
    b, s, h, v = 2, 256, 32, 50_000
    g = torch.Generator().manual_seed(0)
    hs = torch.randn(b, s, h, generator=g, requires_grad=True)
    ht = torch.randn(b, s, h, generator=g)
    ws, wt = torch.randn(v, h, generator=g) * 0.3, torch.randn(v, h, generator=g) * 0.3
    labels = torch.randint(0, v, (b, s), generator=g)
    f_s, f_t = (lambda x: x @ ws.T), (lambda x: x @ wt.T)
    # one small step first: what the first call imports lazily (torch.utils.checkpoint's machinery, ~170 MB once
    # `import qrecover` stopped importing transformers) is not the loss's memory
    if chunk:
        O.chunked_loss("mix", hs[:, :6], labels[:, :6], f_s, ht[:, :6], f_t, chunk=2, fused=sys.argv[2] == "fused").backward()
    else:
        O.loss_fn("mix", f_s(hs[:, :6]), labels[:, :6], f_t(ht[:, :6])).backward()
    hs.grad = None
    # the live resident set now (not ru_maxrss: imports may have peaked higher than what stays resident)
    before = int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize() // 1024
    if chunk:
        loss = O.chunked_loss("mix", hs, labels, f_s, ht, f_t, chunk=chunk, fused=sys.argv[2] == "fused")
    else:
        loss = O.loss_fn("mix", f_s(hs), labels, f_t(ht))
    loss.backward()
    # VmHWM, this address space's own high-water mark (ru_maxrss survives fork + execve: a child of a large pytest
    # process starts at the parent's peak)
    peak = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
    print(json.dumps({"loss": loss.item(), "grad": hs.grad.double().norm().item(), "peak_mb": (peak - before) / 1024}))
""")


def _peak(chunk: int, how: str = "checkpoint") -> dict:
    # a fixed mmap threshold: glibc's dynamic one keeps freed chunk-sized blocks in the heap, and the resident peak
    # then counts fragmentation rather than live tensors
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    out = subprocess.run([sys.executable, "-c", PEAK, str(chunk), how], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1], env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_chunked_peak_memory_is_a_fraction_of_the_full_logits():
    """2 x 256 positions x 50k vocabulary: one logits tensor is 102 MB in fp32; unchunked, the step holds several
    (student and teacher logits, log-probabilities, gradients); chunked by 64 positions, one chunk's (measured: 877 MB, 90-100 MB)."""
    full = _peak(0)
    assert full["peak_mb"] > 400, full  # the full-logits step really is large
    for how in ("checkpoint", "fused"):
        # a real regression (full logits materialised) is high every time: take the lowest of up to three processes
        chunked = _peak(64, how)
        for _ in range(2):
            if chunked["peak_mb"] < full["peak_mb"] / 4:
                break
            chunked = min(chunked, _peak(64, how), key=lambda r: r["peak_mb"])
        assert abs(full["loss"] - chunked["loss"]) <= 1e-5 * abs(full["loss"])
        assert abs(full["grad"] - chunked["grad"]) <= 1e-5 * full["grad"]
        assert chunked["peak_mb"] < full["peak_mb"] / 4, (how, chunked, full)


# --- training: same adapter -------------------------------------------------------------------------------

def test_training_chunked_ends_with_the_unchunked_adapter(tiny_ckpt, text_mix, tmp_path):
    runs = {}
    for chunk in (0, 24):  # 2 x 63 predicted positions per micro-batch: 6 chunks
        cfg = RecoverConfig(rank=4, tokens=64 * 2 * 3, mix=str(text_mix), seq_len=64, batch_size=2, objective="mix",
                            lr=1e-2, decontaminate=False, checkpoint_every=0, precision="fp32", init="zero", loss_chunk=chunk)
        recover(tiny_ckpt, tmp_path / str(chunk), cfg, show_progress=False)
        model = load(tiny_ckpt, adapter=tmp_path / str(chunk))
        runs[chunk] = {n: p.detach().float() for n, p in model.named_parameters() if "lora_" in n}
        runs[chunk]["_losses"] = torch.tensor([json.loads(x)["loss"] for x in
                                               (tmp_path / str(chunk) / "train_log.jsonl").read_text().splitlines()])
    a, b = runs[0], runs[24]
    assert a.keys() == b.keys() and len(a) > 1
    assert torch.allclose(a["_losses"], b["_losses"], rtol=1e-5)
    for n in a:
        if n != "_losses":
            assert torch.allclose(a[n], b[n], rtol=1e-3, atol=1e-4), n  # 16-bit adapter files
    assert any(float(v.abs().max()) > 0 for n, v in a.items() if "lora_B" in n)  # it trained


# --- the teacher's placement, the settings -------------------------------------------------------------------

def test_teacher_on_cpu_keeps_fp32_under_bf16():
    _, teacher = _models("llama")
    teacher.float()
    dev = O.place_teacher(teacher, torch.device("cpu"), "bf16")
    assert dev == torch.device("cpu") and all(p.dtype == torch.float32 for p in teacher.parameters())
    missing = f"cuda:{torch.cuda.device_count() + 5}"
    with pytest.raises(QRecoverError, match=f"--teacher-device '{missing}' does not exist here"):
        O.place_teacher(teacher, torch.device("cpu"), "bf16", missing)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_teacher_on_cuda_is_cast_to_bf16_once_and_buffers_keep_their_dtype():
    _, teacher = _models("llama")
    teacher.float()
    buffers = {n: b.dtype for n, b in teacher.named_buffers()}
    dev = O.place_teacher(teacher, torch.device("cuda"), "bf16")
    assert dev.type == "cuda" and all(p.dtype == torch.bfloat16 and p.device == dev for p in teacher.parameters())
    assert {n: b.dtype for n, b in teacher.named_buffers()} == buffers
    first = next(teacher.parameters())
    assert O.place_teacher(teacher, torch.device("cuda"), "bf16") == dev and next(teacher.parameters()) is first
    # fp32 precision on CUDA: the teacher keeps its dtype
    _, t32 = _models("llama")
    t32.float()
    O.place_teacher(t32, torch.device("cuda"), "no")
    assert all(p.dtype == torch.float32 for p in t32.parameters())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_step_loss_on_cuda_bf16_tracks_fp32():
    peft, teacher = _models("llama")
    peft, teacher = peft.float().cuda(), teacher.float()
    ids = torch.randint(0, BASE["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(3)).cuda()
    fp32 = O.step_loss(peft, teacher, ids, ids, _cfg("kd", 5), lambda: torch.autocast("cuda", enabled=False))
    bf16 = O.step_loss(peft, teacher, ids, ids, _cfg("kd", 5), lambda: torch.autocast("cuda", dtype=torch.bfloat16), "bf16")
    assert next(teacher.parameters()).dtype == torch.bfloat16
    assert abs(float(bf16) - float(fp32)) < 0.05 * float(fp32) + 1e-3


@pytest.mark.parametrize("argv, message", [
    (["--loss-chunk", "-1"], "--loss-chunk -1 must be a number of positions >= 0"),
    (["--teacher-device", "gpu1"], "--teacher-device 'gpu1' is not a device"),
])
def test_bad_chunk_and_teacher_device_exit_2(tiny_ckpt, tmp_path, capsys, argv, message):
    code, out, err = cli(["recover", tiny_ckpt, "--out", tmp_path / "o", *argv], capsys)
    assert code == 2 and message in " ".join((out + err).split()), out + err
    assert not (tmp_path / "o").exists()


# --- --hidden-weight: the decoder layers' outputs matched ---------------------------------------------------


def test_hidden_error_is_the_relative_squared_error_per_token_in_float64():
    g = torch.Generator().manual_seed(0)
    s = [torch.randn(2, 5, 8, generator=g) for _ in range(3)]
    t = [torch.randn(2, 5, 8, generator=g) * (i + 1) for i in range(3)]
    t[1][0, 0] *= 100  # an outlier token weighs as much as any other
    want = sum(float(((a.double() - b.double()) ** 2).sum(-1).div((b.double() ** 2).sum(-1)).mean()) for a, b in zip(s, t)) / 3
    assert abs(float(O.hidden_error(s, t)) - want) <= 1e-6 * want
    assert float(O.hidden_error(t, t)) == 0.0
    with pytest.raises(QRecoverError, match="the student ran 2 decoder layers and the unquantized model 3"):
        O.hidden_error(s[:2], t)


@pytest.mark.parametrize("name", ["llama", "qwen2", "gemma2"])
def test_hidden_weight_adds_the_layer_outputs_error_to_the_loss(name):
    """loss(w) = loss(0) + w x the mean relative error of every decoder layer's output, the outputs read
    independently (transformers' output_hidden_states for all but the last layer, the final norm's input for the
    last), and its gradient is that sum's; the first step (the head check's extra forwards) included."""
    peft, teacher = _models(name)
    ids = torch.randint(0, BASE["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(3))
    params = [p for p in peft.parameters() if p.requires_grad]

    def outputs(model):
        last = []
        norm = O._unwrap(model).model.norm
        h = norm.register_forward_pre_hook(lambda m, args: last.append(args[0]))
        try:
            hs = model(input_ids=ids, output_hidden_states=True).hidden_states
        finally:
            h.remove()
        return [*hs[1:-1], last[-1]]

    with torch.no_grad():
        t = outputs(teacher)
    s = outputs(peft)
    assert len(s) == len(t) == BASE["num_hidden_layers"]
    ref = sum(((a - b) ** 2).sum(-1).div((b ** 2).sum(-1)).mean() for a, b in zip(s, t)) / len(s)
    for chunk in (5, 0):
        with_h = O.step_loss(peft, teacher, ids, ids, _cfg("kd", chunk, hidden_weight=0.7), NO_AUTOCAST)
        without = O.step_loss(peft, teacher, ids, ids, _cfg("kd", chunk), NO_AUTOCAST)
        assert float(ref.detach()) > 1e-4
        assert abs(float(with_h - without) - 0.7 * float(ref)) <= 1e-9 * float(ref), chunk
        g_with, g_without = torch.autograd.grad(with_h, params), torch.autograd.grad(without, params)
        g_ref = torch.autograd.grad(0.7 * ref, params, retain_graph=True)
        for a, b, r in zip(g_with, g_without, g_ref):
            assert float((a - b - r).abs().max()) <= 1e-6 * float(r.abs().max()) + 1e-15  # float64: the rotary tables are fp32


@pytest.mark.parametrize("argv, message", [
    (["--hidden-weight", "-1"], "--hidden-weight -1.0 must be >= 0 (0 = off)"),
    (["--hidden-weight", "1", "--objective", "ce"], "--hidden-weight 1 matches the unquantized model's hidden states, "
                                                    "which objective 'ce' does not run"),
])
@pytest.mark.parametrize("command", ["recover", "tune"])
def test_bad_hidden_weight_exits_2(tiny_ckpt, tmp_path, capsys, argv, message, command):
    code, out, err = cli([command, tiny_ckpt, "--out", tmp_path / "o", *argv], capsys)
    assert code == 2 and message in " ".join((out + err).split()), out + err
    assert not (tmp_path / "o").exists()

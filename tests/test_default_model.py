"""End to end on the real default model (SmolLM2-135M-Instruct), marked slow (~3 min on 2 CPU cores).

One compression at AFM's production budget with the quick start's menu (3.7 bpw, ``--encodings quick``, 4 x 128
calibration tokens; the full default menu took 11.6 min here, 2026-11-28, and its mechanics have tests of their own on
tiny models): the measured
whole-model bpw lands in [3.6, 3.7]; the checkpoint reloads; the reloaded model's logits on a short prompt
equal (1e-4) those of the original architecture with the checkpoint's dequantized weights and stored norms copied
in and its online final-norm rotation attached (the default menu rotates); greedy generation of 20 tokens from a
chat prompt decodes to non-empty text.
"""

from __future__ import annotations

import pytest
import torch

import qrecover
from qrecover.api import compress
from qrecover.config import CompressConfig
from qrecover.transforms.rotate import attach_online


@pytest.mark.slow
def test_default_model_end_to_end(tmp_path):
    from transformers import AutoTokenizer

    from qrecover.models import load_model

    out = tmp_path / "smollm2-3.7"
    manifest = compress(CompressConfig(bpw=3.7, encodings="quick", calib_samples=4, seq_len=128), out=out, show_progress=False)
    assert 3.6 <= manifest["measured_bpw"]["model"] <= 3.7, manifest["measured_bpw"]
    assert manifest["source"]["kind"] == "default"
    assert len({v["bits"] for v in manifest["layers"].values() if v["kind"] == "linear"}) > 1

    model = qrecover.load(out)
    tok = AutoTokenizer.from_pretrained(out)
    ref, _, _ = load_model(None)  # the float model with the checkpoint's weights: its dequantized layers, its
    stored = model.state_dict()  # remainder (the norms the rotation folded are ones), its online final-norm rotation
    with torch.no_grad():
        for name in manifest["layers"]:
            ref.get_submodule(name).weight.copy_(model.get_submodule(name).dequantize())
        params = dict(ref.named_parameters())
        for k in manifest["remainder"]:
            params[k].copy_(stored[k])
    attach_online(ref, manifest["transforms"]["online"])

    ids = tok("The quick brown fox jumps over the lazy dog. In Python, a list", return_tensors="pt").input_ids
    with torch.no_grad():
        got = model(input_ids=ids).logits
        want = ref(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    del ref

    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   add_generation_prompt=True, return_tensors="pt", return_dict=True)
    prompt = chat["input_ids"]
    with torch.no_grad():
        gen = model.generate(prompt, attention_mask=chat["attention_mask"], max_new_tokens=20, do_sample=False,
                             pad_token_id=tok.eos_token_id)
    new = gen[0, prompt.shape[1]:]
    assert 0 < new.numel() <= 20
    text = tok.decode(new, skip_special_tokens=True)
    assert text.strip(), tok.decode(new)

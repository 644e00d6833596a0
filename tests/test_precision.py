"""The frozen base in bf16 while training (qrecover.recovery.precision): what changes, what is put back, and the
casts it saves in a bf16-autocast step (the CPU's count of what a GPU step launches)."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from qrecover.errors import QRecoverError
from qrecover.recovery.config import RecoverConfig
from qrecover.recovery.host_sync import HostSyncCounter
from qrecover.recovery.precision import base_dtype, frozen_base_in


def _model():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64)
    return get_peft_model(LlamaForCausalLM(cfg), LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"]))


def _step(model, ids):
    """Loss, adapter gradients, and the copies/casts one bf16-autocast forward and backward dispatch."""
    model.zero_grad()
    with HostSyncCounter() as c:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return loss.detach().float(), grads, c.ops["_to_copy"], c.out_bytes["_to_copy"]


def test_frozen_base_in_bf16_casts_the_frozen_floats_and_puts_them_back():
    model = _model()
    before = {n: (p.data_ptr(), p.data.clone()) for n, p in model.named_parameters()}
    with frozen_base_in(model, torch.bfloat16) as n:
        frozen = [p for p in model.parameters() if not p.requires_grad]
        assert n == len(frozen) > 0 and all(p.dtype == torch.bfloat16 for p in frozen)
        assert all(p.dtype == torch.float32 for p in model.parameters() if p.requires_grad)  # adapters: fp32 masters
        ids = torch.randint(0, 128, (2, 16))
        assert model(input_ids=ids).logits.dtype == torch.bfloat16  # outside autocast: adapters cast as usual, and run
    for name, p in model.named_parameters():
        ptr, copy = before[name]
        assert p.data_ptr() == ptr and p.dtype == copy.dtype and torch.equal(p.data, copy), name  # the same storage
    assert all(m.cast_input_dtype_enabled for m in model.modules() if hasattr(m, "cast_input_dtype_enabled"))
    with frozen_base_in(model, None) as n:
        assert n == 0


def test_a_bf16_base_saves_the_casts_and_trains_the_same():
    model = _model()
    ids = torch.randint(0, 128, (2, 32))
    loss32, grads32, copies32, bytes32 = _step(model, ids)
    with frozen_base_in(model, torch.bfloat16):
        loss16, grads16, copies16, bytes16 = _step(model, ids)
    assert copies16 < 0.8 * copies32 and bytes16 < 0.6 * bytes32, (copies32, copies16, bytes32, bytes16)
    assert abs(loss16 - loss32) < 2e-2 * abs(loss32)
    for name, g in grads32.items():  # bf16 activations: the adapter gradients agree to bf16's precision
        assert torch.linalg.vector_norm(grads16[name] - g) <= 0.05 * torch.linalg.vector_norm(g) + 1e-8, name


def test_base_dtype_resolves_auto_and_refuses_bf16_with_a_sharded_base():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    auto = RecoverConfig()
    assert base_dtype(auto, "bf16", cuda, sharded=False) == torch.bfloat16
    assert base_dtype(auto, "bf16", cpu, sharded=False) is None  # the CPU's numerics unchanged
    assert base_dtype(auto, "no", cuda, sharded=False) is None
    assert base_dtype(auto, "bf16", cuda, sharded=True) is None
    assert base_dtype(auto, "bf16", cuda, sharded=False, callback=True) is None
    assert base_dtype(RecoverConfig(base_dtype="bf16"), "no", cpu, sharded=False) == torch.bfloat16
    assert base_dtype(RecoverConfig(base_dtype="fp32"), "bf16", cuda, sharded=False) is None
    with pytest.raises(QRecoverError, match="--base-dtype 'half' must be one of auto, bf16, fp32"):
        RecoverConfig(base_dtype="half")
    with pytest.raises(QRecoverError, match="--shard-base"):
        RecoverConfig(base_dtype="bf16", shard_base=True)

"""LoRA adapters (``llm/lora.py``): zero at the start, the only trainable weights, a reference with the adapters off
that equals the pretrained model, and an export with the adapters merged."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from ppo_objectives.llm.hf import HFCausalLMAdapter  # noqa: E402
from ppo_objectives.llm.lora import LORA_TARGETS, AdaptersOff, add_lora, has_lora, merged_hf_model  # noqa: E402
from ppo_objectives.llm.models import TinyCausalLM, TinyLMConfig  # noqa: E402
from ppo_objectives.llm.readouts import ResponseLogProbs, frozen_reference, make_actor_critic  # noqa: E402


def _lm(seed: int = 0) -> HFCausalLMAdapter:
    torch.manual_seed(seed)
    return HFCausalLMAdapter.from_config(transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16))


def _ids():
    g = torch.Generator().manual_seed(1)
    return torch.randint(32, (3, 10), generator=g), torch.ones(3, 10, dtype=torch.bool)


def _perturb_adapters(lm):
    with torch.no_grad():  # what training would do: the B matrices leave zero
        for name, p in lm.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.5)


def test_adapters_start_at_zero_and_are_the_only_trainable_weights():
    base, lm = _lm(), add_lora(_lm(), rank=4)
    ids, am = _ids()
    torch.testing.assert_close(lm(ids, am).logits, base(ids, am).logits, rtol=0, atol=0)
    trainable = [n for n, p in lm.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    projections = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trainable}
    assert projections == set(LORA_TARGETS)
    assert has_lora(lm) and not has_lora(base)
    actor_params = make_actor_critic(lm, 4, shared_trunk=True).actor_parameters()
    assert {id(p) for p in actor_params} == {id(p) for p in lm.parameters() if p.requires_grad}


def test_the_reference_with_adapters_off_is_the_pretrained_model_and_holds_no_weights():
    base, lm = _lm(), add_lora(_lm(), rank=4)
    _perturb_adapters(lm)
    lm.train()
    ids, am = _ids()
    ref = frozen_reference(AdaptersOff(lm), prompt_len=4, copy_model=False)
    want, _ = ResponseLogProbs(base.eval(), 4)(ids, am)
    got = ref(TensorDict(input_ids=ids, attention_mask=am, batch_size=[3]))["log_prob"]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    actor_lp, _ = ResponseLogProbs(lm, 4)(ids, am)
    assert (actor_lp - want).abs().max() > 1e-3  # the adapters are on again for the actor
    assert lm.training  # the reference's forward put the actor back in training mode
    assert list(ref.parameters()) == [] and ref.module.model.state_dict() == {}
    assert all(p.requires_grad for n, p in lm.named_parameters() if "lora_" in n)  # frozen_reference froze nothing


def test_the_merged_export_computes_what_the_adapted_model_computes():
    lm = add_lora(_lm(), rank=4)
    _perturb_adapters(lm)
    ids, am = _ids()
    merged = merged_hf_model(lm)
    assert type(merged) is transformers.LlamaForCausalLM
    assert not any("lora_" in n for n in merged.state_dict())
    torch.testing.assert_close(HFCausalLMAdapter(merged)(ids, am).logits, lm(ids, am).logits, rtol=1e-5, atol=1e-5)
    assert has_lora(lm)  # a copy was merged, not the actor
    plain = _lm()
    assert merged_hf_model(plain) is plain.hf_model


def test_add_lora_errors():
    with pytest.raises(TypeError, match="add_lora: lm must be an HFCausalLMAdapter .* got TinyCausalLM"):
        add_lora(TinyCausalLM(TinyLMConfig.preset("pico", vocab_size=8, block_size=8)), rank=2)
    with pytest.raises(ValueError, match="add_lora rank=0"):
        add_lora(_lm(), rank=0)
    with pytest.raises(ValueError, match=r"add_lora: no module of LlamaForCausalLM is named one of targets=\('c_attn',\)"):
        add_lora(_lm(), rank=2, targets=("c_attn",))
    with pytest.raises(ValueError, match="add_lora: lm has LoRA adapters already"):
        add_lora(add_lora(_lm(), rank=2), rank=2)
    with pytest.raises(ValueError, match=r"AdaptersOff: lm has no LoRA adapters \(add_lora\)"):
        AdaptersOff(_lm())
    bare = AdaptersOff.__new__(AdaptersOff)  # as copy and pickle make it: no lm to forward attributes to yet
    assert not hasattr(bare, "vocab_size")
    with pytest.raises(AttributeError, match="no_such_attribute"):
        AdaptersOff(add_lora(_lm(), rank=2)).no_such_attribute

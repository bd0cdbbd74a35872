"""The prompts' common prefix runs once: found by ``shared_prefix``, run by ``HFCausalLMAdapter(shared_prefix=k)``,
used by the read-outs; every number read is the full forward's."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

transformers = pytest.importorskip("transformers")

from ppo_objectives.llm.hf import HFCausalLMAdapter  # noqa: E402
from ppo_objectives.llm.readouts import make_actor_critic, shared_prefix  # noqa: E402
from ppo_objectives.llm.token_map import TokenMappedLM  # noqa: E402
from ppo_objectives.testing import assert_matches_reference  # noqa: E402

V, P, R = 32, 7, 4


def _tiny_llama() -> HFCausalLMAdapter:
    torch.manual_seed(0)
    return HFCausalLMAdapter.from_config(transformers.LlamaConfig(
        vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, attn_implementation="sdpa"))


def _batch() -> TensorDict:
    """Three left-padded prompts (widths 7, 6 and 5) that start with the same 3 tokens, then 4 response columns,
    the last one padding in every row."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(V, (3, P + R), generator=g)
    attention = torch.ones(3, P + R, dtype=torch.bool)
    for row, pads in enumerate((0, 1, 2)):
        attention[row, :pads] = False
        ids[row, pads : pads + 3] = torch.tensor([5, 6, 7])
    attention[:, -1] = False
    attention[2, -2] = False
    return TensorDict(input_ids=ids, attention_mask=attention, mask=attention[:, P:].clone(), batch_size=[3])


def test_shared_prefix_finds_the_common_start_and_puts_it_first():
    td = _batch()
    k, order = shared_prefix(td["input_ids"], td["attention_mask"], P)
    assert k == 3
    moved = td["input_ids"].gather(1, order)
    assert (moved[:, :3] == torch.tensor([5, 6, 7])).all()
    assert torch.equal(moved[:, P - 1 :], td["input_ids"][:, P - 1 :])  # from P - 1 on, each row's own columns
    assert torch.equal(td["attention_mask"].gather(1, order)[:, :3], torch.ones(3, 3, dtype=torch.bool))


def test_shared_prefix_stops_short_of_the_shortest_prompt_and_finds_nothing_where_there_is_nothing():
    ids = torch.tensor([[1, 2, 3, 9], [1, 2, 3, 8]])
    full = torch.ones(2, 4, dtype=torch.bool)
    assert shared_prefix(ids, full, prompt_len=3) == (2, None)  # one prompt token is each row's own
    assert shared_prefix(ids[:1], full[:1], prompt_len=3) == (0, None)  # one row: nothing to share
    assert shared_prefix(ids, None, prompt_len=3) == (0, None)
    assert shared_prefix(torch.tensor([[1, 2, 3, 9], [4, 2, 3, 8]]), full, prompt_len=3) == (0, None)
    holed = full.clone()
    holed[0, 1] = False  # a prompt with a hole is no left-padded prompt: left alone
    assert shared_prefix(ids, holed, prompt_len=3) == (0, None)


def test_hf_forward_with_a_shared_prefix_equals_the_full_forward_and_its_gradients():
    lm = _tiny_llama()
    ids = torch.randint(V, (4, 10), generator=torch.Generator().manual_seed(2))
    ids[:, :5] = ids[0, :5]
    mask = torch.ones(4, 10, dtype=torch.bool)
    mask[1, 8:] = False
    outs, grads = [], []
    for k in (0, 5):
        lm.zero_grad()
        out = lm(ids, mask, shared_prefix=k)
        (out.logits[mask].square().mean() + out.hidden[mask].square().mean()).backward()
        outs.append(out)
        grads.append([p.grad.clone() for p in lm.parameters()])
    assert_matches_reference(outs[1].logits[mask], outs[0].logits[mask], name="logits")
    assert_matches_reference(outs[1].hidden[mask], outs[0].hidden[mask], name="hidden")
    for got, want in zip(grads[1], grads[0]):
        assert_matches_reference(got, want, name="gradient", atol=1e-5, rtol=1e-3)


def test_hf_shared_prefix_refusals():
    lm = _tiny_llama()
    ids = torch.tensor([[1, 2, 3, 4], [1, 2, 5, 6]])
    mask = torch.ones(2, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"shared_prefix=4 leaves no column of the T=4 to run per row"):
        lm(ids, mask, shared_prefix=4)
    with pytest.raises(ValueError, match=r"the first 3 columns are not the same attended tokens in every row"):
        lm(ids, mask, shared_prefix=3)
    with pytest.raises(ValueError, match=r"with cache= pass shared_prefix=0"):
        lm(ids, mask, cache=lm.new_cache(2, 8), cache_slots=0, shared_prefix=2)
    if hasattr(lm.hf_model, "activation_checkpointing_enable"):  # transformers >= 5 (the older name warns)
        lm.hf_model.activation_checkpointing_enable({"use_reentrant": False})
    else:
        lm.hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert not lm.supports_shared_prefix
    with pytest.raises(ValueError, match=r"activation checkpointing is on\); pass shared_prefix=0"):
        lm(ids, mask, shared_prefix=2)


@pytest.mark.parametrize("mapped", [False, True])
def test_read_outs_run_the_common_prefix_once_and_read_the_full_forwards_numbers(mapped, monkeypatch):
    lm = _tiny_llama()
    model = TokenMappedLM(lm, torch.arange(V)) if mapped else lm
    ac = make_actor_critic(model, prompt_len=P, shared_trunk=True)
    torch.nn.init.normal_(ac.critic_head.weight, generator=torch.Generator().manual_seed(3))
    td = _batch()
    widths = []
    lm.hf_model.get_decoder().register_forward_hook(
        lambda m, args, kwargs, out: widths.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    shared = ac.critic(ac.actor(td.copy()))
    assert widths == [(1, 3), (3, P + R - 1 - 3)]  # the prefix on one row, then every row's other columns
    monkeypatch.setattr(HFCausalLMAdapter, "supports_shared_prefix", property(lambda self: False))
    widths.clear()
    full = ac.critic(ac.actor(td.copy()))
    assert widths == [(3, P + R - 1)]
    valid = td["mask"]
    for key in ("log_prob", "entropy", "state_value"):
        assert_matches_reference(shared[key][valid].detach(), full[key][valid].detach(), name=key)


class _ForwardingWrapper(torch.nn.Module):
    """Forwards attribute reads to the model it wraps, as FSDP's wrapper does."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.inner, name)

    def forward(self, *args, **kwargs):
        return self.inner(*args, **kwargs)


def test_a_wrapper_that_forwards_attribute_reads_runs_every_column():
    lm = _tiny_llama()
    wrapped = _ForwardingWrapper(lm)
    assert wrapped.supports_shared_prefix  # read through the wrapper, as FSDP's attribute forwarding gives it
    ac = make_actor_critic(wrapped, prompt_len=P, shared_trunk=True)
    widths = []
    lm.hf_model.get_decoder().register_forward_hook(
        lambda m, args, kwargs, out: widths.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    ac.critic(ac.actor(_batch().copy()))
    assert widths == [(3, P + R - 1)]  # one forward of every row: the wrapper's hooks see one call

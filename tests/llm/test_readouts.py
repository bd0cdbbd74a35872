"""The response read-outs run the columns some row attends, and read what a forward over every column reads."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from ppo_objectives.llm.models import TinyLMConfig
from ppo_objectives.llm.readouts import ResponseLogProbs, attended_end, make_actor_critic
from ppo_objectives.testing import assert_matches_reference, reference_response_log_probs

P, R = 3, 6


def _short_responses() -> TensorDict:
    """Three rows of a budget of R = 6 whose responses take 1, 2 and 4 columns (the last two columns: padding of
    every row), one of them with a hole (a column attended, not trained)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(16, (3, P + R), generator=g)
    attention = torch.zeros(3, P + R, dtype=torch.bool)
    attention[:, :P] = True
    for row, n in enumerate((1, 2, 4)):
        attention[row, P : P + n] = True
    mask = attention[:, P:].clone()
    mask[2, 1] = False  # an environment's token: attended, not trained
    return TensorDict(input_ids=ids, attention_mask=attention, mask=mask, batch_size=[3])


def test_attended_end_is_one_past_the_last_column_some_row_attends():
    assert attended_end(_short_responses()["attention_mask"], P) == P + 4
    assert attended_end(torch.ones(2, P + R, dtype=torch.bool), P) == P + R
    nothing = torch.zeros(2, P + R, dtype=torch.bool)
    nothing[:, :P] = True
    assert attended_end(nothing, P) == P + 1  # one response column: the read-outs keep their [B, >= 1] shape
    assert attended_end(None, P) is None


@pytest.mark.parametrize("shared_trunk", [True, False])
def test_read_outs_run_only_the_attended_columns_and_match_the_full_forward(shared_trunk):
    torch.manual_seed(0)
    ac = make_actor_critic(TinyLMConfig.preset("pico", vocab_size=16, block_size=16), P, shared_trunk=shared_trunk)
    td = _short_responses()
    widths = []
    ac.actor_model.register_forward_hook(lambda m, args, out: widths.append(args[0].shape[1]))
    if not shared_trunk:
        ac.critic.module.model.register_forward_hook(lambda m, args, out: widths.append(args[0].shape[1]))
    torch.nn.init.normal_(ac.critic_head.weight, generator=torch.Generator().manual_seed(1))
    out = ac.critic(ac.actor(td.copy()))
    assert widths == ([P + 4] if shared_trunk else [P + 4, P + 4])  # the two padding columns are not run
    assert out["log_prob"].shape == out["state_value"].shape == (3, R)

    with torch.no_grad():  # the independent reference: every column, one token at a time
        full = ac.actor_model(td["input_ids"], td["attention_mask"])
        want_lp = reference_response_log_probs(full.logits, td["input_ids"], torch.full((3,), P), R)
        want_v = ac.critic_head(full.hidden[:, P - 1 : -1]).squeeze(-1)
    valid = td["mask"]
    assert_matches_reference(out["log_prob"][valid].detach(), want_lp[valid].float(), name="log_prob")
    assert_matches_reference(out["state_value"][valid].detach(), want_v[valid], name="state_value")
    assert (out["log_prob"][:, 4:] == 0).all() and (out["state_value"][:, 4:] == 0).all()  # the columns cut


def test_hidden_state_path_cuts_the_same_columns():
    torch.manual_seed(0)
    from ppo_objectives.llm.models import TinyCausalLM

    lm = TinyCausalLM(TinyLMConfig.preset("pico", vocab_size=16, block_size=16))
    td = _short_responses()
    widths = []
    lm.register_forward_hook(lambda m, args, out: widths.append(args[0].shape[1]))
    lp, _ = ResponseLogProbs(lm, P, from_hidden=True)(td["input_ids"], td["attention_mask"])
    assert widths == [P + 4]
    with torch.no_grad():
        want = reference_response_log_probs(lm(td["input_ids"], td["attention_mask"]).logits, td["input_ids"],
                                            torch.full((3,), P), R)
    valid = td["attention_mask"][:, P:]
    assert_matches_reference(lp[valid].detach(), want[valid].float(), name="log_prob")
    assert (lp[~valid] == 0).all()

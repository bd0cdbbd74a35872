"""Regression tests for bugs that other LLM-RL stacks shipped in the same code (layouts, padding, masks).

Each test names the peer's issue and checks the property against a reference written here:
plain loops over Python floats, or arithmetic done by hand in the comments, never the
library function under test. ``ppo_objectives/llm/layouts.py`` states the layout contract
these tests hold the code to.
"""

from __future__ import annotations

import math

import pytest
import torch
from tensordict import TensorDict

from ppo_objectives import KLPenaltyTransform, MaskedGAE, TokenPPOLoss, functional as F
from ppo_objectives.llm.env import TokenLMEnv
from ppo_objectives.llm.layouts import trajectories_to_llm_batch
from ppo_objectives.llm.models import TinyCausalLM, TinyLMConfig
from ppo_objectives.llm.readouts import make_actor_critic
from ppo_objectives.testing import assert_matches_reference, make_mask, response_batch, tiny_actor_critic

NAN, INF = float("nan"), float("inf")

# --------------------------------------------------------------------------- #
# verl #1758, ROLL #3, minimind #541: positions under left and right padding
# --------------------------------------------------------------------------- #

# (prompt, response) pairs of different lengths: with P = 6 and R = 4 the rows get 4, 1, 0 and 5 columns of left
# padding, and 0, 2, 1 and 3 columns of right padding after the response
_ROWS = [
    ([3, 7], [5, 1, 9, 2]),
    ([4, 4, 8, 2, 6], [7, 3]),
    ([9, 1, 2, 3, 4, 5], [6, 6, 1]),
    ([2], [8]),
]
_P, _R = 6, 4


def _padded_batch(rows, P, R, V, seed=0):
    """The response layout of ``rows``: prompts left-padded to ``P``, responses right-padded to ``R``. The padding
    holds random token ids (not a pad id), so only ``attention_mask`` says what is real."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, V, (len(rows), P + R), generator=g)
    am = torch.zeros(len(rows), P + R, dtype=torch.bool)
    for b, (prompt, response) in enumerate(rows):
        ids[b, P - len(prompt) : P] = torch.tensor(prompt)
        ids[b, P : P + len(response)] = torch.tensor(response)
        am[b, P - len(prompt) : P + len(response)] = True
    return TensorDict(input_ids=ids, attention_mask=am, batch_size=[len(rows)])


def _unpadded_log_probs(logits_of, prompt, response):
    """log p(response[j] | prompt + response[:j]) from one forward of the unpadded sequence (positions 0, 1, ...)."""
    seq = torch.tensor([prompt + response])
    with torch.no_grad():
        logp = torch.log_softmax(logits_of(seq)[0].double(), -1)  # [L, V]
    # the logits at index len(prompt) - 1 + j predict the token at len(prompt) + j
    return [float(logp[len(prompt) - 1 + j, tok]) for j, tok in enumerate(response)]


def _check_rows_against_unpadded(actor, logits_of, V, rows=_ROWS):
    td = _padded_batch(rows, _P, _R, V)
    with torch.no_grad():
        got = actor(td)["log_prob"]
    assert got.shape == (len(rows), _R)
    for b, (prompt, response) in enumerate(rows):
        want = _unpadded_log_probs(logits_of, prompt, response)
        for j, w in enumerate(want):
            assert float(got[b, j]) == pytest.approx(w, abs=2e-5), (b, j)
    # right padding: other garbage after the responses changes nothing on them
    td2 = _padded_batch(rows, _P, _R, V, seed=1)
    td2["input_ids"][:, :_P] = td["input_ids"][:, :_P]
    for b, (_, response) in enumerate(rows):
        td2["input_ids"][b, _P : _P + len(response)] = torch.tensor(response)
    with torch.no_grad():
        got2 = actor(td2)["log_prob"]
    valid = td["attention_mask"][:, _P:]
    torch.testing.assert_close(got2[valid], got[valid], rtol=0, atol=1e-6)


@pytest.mark.parametrize("from_hidden", [False, True])
def test_left_padding_does_not_shift_learned_positions_verl_1758(from_hidden):
    # learned absolute positions: a prompt read at position 4 instead of 0 gives other log-probs, so a read-out
    # that counts left padding as positions (or attends to it) fails this
    torch.manual_seed(0)
    model = TinyCausalLM(TinyLMConfig.preset("pico", vocab_size=16, block_size=_P + _R)).eval()
    with torch.no_grad():  # make the position embedding matter as much as the token embedding
        model.wpe.weight.normal_(0.0, 1.0)
    ac = make_actor_critic(model, prompt_len=_P, from_hidden=from_hidden)
    _check_rows_against_unpadded(ac.actor, lambda seq: model(seq).logits, V=16)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    from ppo_objectives.testing import tiny_chat_checkpoint

    path = tiny_chat_checkpoint(tmp_path_factory.mktemp("tiny_llama"))
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True).eval()


@pytest.mark.parametrize("from_hidden", [False, True])
def test_left_padding_keeps_rope_positions_and_hides_the_pads_roll_3_minimind_541(tiny_llama, from_hidden):
    from ppo_objectives.llm.hf import HFCausalLMAdapter

    # RoPE: a Llama through the adapter against the Hugging Face model itself on the unpadded sequence (no mask,
    # positions 0..L-1); a read-out that attends to the pads (or mis-places the RoPE positions) fails this
    ac = make_actor_critic(HFCausalLMAdapter(tiny_llama), prompt_len=_P, from_hidden=from_hidden)
    V = tiny_llama.config.vocab_size
    rows = [([p + 30 for p in prompt], [r + 40 for r in response]) for prompt, response in _ROWS]
    _check_rows_against_unpadded(ac.actor, lambda seq: tiny_llama(input_ids=seq).logits, V=V, rows=rows)


# --------------------------------------------------------------------------- #
# ROLL #447: values and rewards at masked positions leaked into the advantages
# --------------------------------------------------------------------------- #


def _loop_gae(rewards, values, mask, gamma, lmbda):
    """GAE per row over its valid tokens only (``t + 1`` = the next valid token, 0 after the last): plain floats."""
    adv = [[0.0] * len(row) for row in mask]
    for b, row in enumerate(mask):
        next_v, next_a = 0.0, 0.0
        for t in reversed(range(len(row))):
            if not row[t]:
                continue
            delta = rewards[b][t] + gamma * next_v - values[b][t]
            adv[b][t] = delta + gamma * lmbda * next_a
            next_v, next_a = values[b][t], adv[b][t]
    return adv


def _loop_whiten(adv, mask):
    """``(A - mean) / sqrt(var + 1e-8)`` over the valid tokens of the whole batch (biased variance); 0 off the mask."""
    valid = [a for arow, mrow in zip(adv, mask) for a, m in zip(arow, mrow) if m]
    mean = sum(valid) / len(valid)
    var = sum((a - mean) ** 2 for a in valid) / len(valid)
    return [[(a - mean) / math.sqrt(var + 1e-8) if m else 0.0 for a, m in zip(arow, mrow)]
            for arow, mrow in zip(adv, mask)]


def _garbage_off_mask(x, mask):
    """``x`` with NaN, +-1e30 and inf at the masked positions, in turn."""
    junk = torch.tensor([NAN, 1e30, -1e30, INF]).repeat(x.numel() // 4 + 1)[: x.numel()].reshape(x.shape)
    return torch.where(mask, x, junk.to(x.dtype))


def _gae_case(seed=0, B=6, R=7):
    g = torch.Generator().manual_seed(seed)
    mask = make_mask(B, R, "mixed", generator=g)  # right / left padding, holes, an empty row, all valid
    rewards, values = torch.randn(B, R, generator=g), torch.randn(B, R, generator=g)
    return rewards, values, mask


@pytest.mark.parametrize("backend", ["torch", "loop"])
@pytest.mark.parametrize("average_gae", [False, True])
def test_masked_garbage_does_not_reach_the_advantages_roll_447(backend, average_gae):
    rewards, values, mask = _gae_case()
    assert (~mask).any() and (~mask.any(-1)).any()  # masked positions, and a row with none valid
    gamma, lmbda = 0.9, 0.8
    want = _loop_gae(rewards.tolist(), values.tolist(), mask.tolist(), gamma, lmbda)
    want_ret = [[a + v if m else 0.0 for a, v, m in zip(ar, vr, mr)]
                for ar, vr, mr in zip(want, values.tolist(), mask.tolist())]
    if average_gae:
        want = _loop_whiten(want, mask.tolist())
    clean = F.masked_gae(torch.where(mask, rewards, 0.0), torch.where(mask, values, 0.0), mask, gamma, lmbda,
                         average_gae=average_gae, backend=backend)
    dirty = F.masked_gae(_garbage_off_mask(rewards, mask), _garbage_off_mask(values, mask), mask, gamma, lmbda,
                         average_gae=average_gae, backend=backend)
    for (adv, ret) in (clean, dirty):
        assert_matches_reference(adv, torch.tensor(want, dtype=torch.float64), name="advantage", atol=1e-5, rtol=1e-5)
        assert_matches_reference(ret, torch.tensor(want_ret, dtype=torch.float64), name="returns", atol=1e-5,
                                 rtol=1e-5)
        assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
        assert (adv[~mask] == 0).all() and (ret[~mask] == 0).all()  # exactly 0, not just small
    torch.testing.assert_close(dirty[0], clean[0], rtol=0, atol=0)  # the garbage changes no bit


@pytest.mark.parametrize("average_gae", [False, True])
def test_masked_gae_module_ignores_garbage_off_the_mask_roll_447(average_gae):
    rewards, values, mask = _gae_case(seed=1)
    gamma, lmbda = 1.0, 0.95
    want = _loop_gae(rewards.tolist(), values.tolist(), mask.tolist(), gamma, lmbda)
    if average_gae:
        want = _loop_whiten(want, mask.tolist())
    td = TensorDict({("next", "reward"): _garbage_off_mask(rewards, mask),
                     "state_value": _garbage_off_mask(values, mask), "mask": mask}, batch_size=[mask.shape[0]])
    out = MaskedGAE(gamma=gamma, lmbda=lmbda, average_gae=average_gae)(td)
    adv = out["advantage"].reshape(mask.shape)
    assert_matches_reference(adv, torch.tensor(want, dtype=torch.float64), name="advantage", atol=1e-5, rtol=1e-5)
    assert (adv[~mask] == 0).all() and (out["value_target"].reshape(mask.shape)[~mask] == 0).all()


# --------------------------------------------------------------------------- #
# miles #1827: GAE across tool tokens inside a response
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("module", [False, True])
def test_gae_skips_tool_holes_and_discounts_valid_tokens_only_miles_1827(module):
    # tokens 0, 1 written by the model, 2, 3 a tool's output (hole), 4 the model's final token with reward 1.
    # gamma = 0.5, lambda = 1, values 0: A_t = sum of discounted rewards over the *valid* tokens after t
    #   A_4 = 1;  A_1 = 0.5 * A_4 = 0.5 (t=1 -> t=4 is one step, not three: 0.5**3 = 0.125 would be wrong);
    #   A_0 = 0.5 * A_1 = 0.25;  A_2 = A_3 = 0 (the tool tokens get nothing)
    # the hole's rewards (a tool "reward" of 100) must not be read either
    mask = torch.tensor([[True, True, False, False, True]])
    rewards = torch.tensor([[0.0, 0.0, 100.0, NAN, 1.0]])
    values = torch.tensor([[0.0, 0.0, NAN, 7.0, 0.0]])
    # second case, values (1, 2, -, -, 4), same lambda = 1:
    #   A_4 = 1 + 0 - 4 = -3;  A_1 = 0 + 0.5 * V_4 - V_1 + 0.5 * A_4 = 2 - 2 - 1.5 = -1.5
    #   A_0 = 0 + 0.5 * V_1 - V_0 + 0.5 * A_1 = 1 - 1 - 0.75 = -0.75;  value targets A + V: 0.25, 0.5, 1
    values2 = torch.tensor([[1.0, 2.0, NAN, 7.0, 4.0]])
    for v, want_adv, want_ret in (
        (values, [[0.25, 0.5, 0.0, 0.0, 1.0]], [[0.25, 0.5, 0.0, 0.0, 1.0]]),
        (values2, [[-0.75, -1.5, 0.0, 0.0, -3.0]], [[0.25, 0.5, 0.0, 0.0, 1.0]]),
    ):
        if module:
            td = TensorDict({("next", "reward"): rewards, "state_value": v, "mask": mask}, batch_size=[1])
            out = MaskedGAE(gamma=0.5, lmbda=1.0, average_gae=False)(td)
            adv, ret = out["advantage"].reshape(1, 5), out["value_target"].reshape(1, 5)
        else:
            adv, ret = F.masked_gae(rewards, v, mask, gamma=0.5, lmbda=1.0, average_gae=False)
        assert adv.tolist() == want_adv
        assert ret.tolist() == want_ret


# --------------------------------------------------------------------------- #
# TorchRL #3580: EOS and pad share an id; the generated EOS was masked as padding
# --------------------------------------------------------------------------- #

# eos_id == pad_id == 0. Env row n follows script n (the token at response index j), whatever its prompt:
# an EOS as the 3rd token, the 2nd token, never (truncated at M = 3), and as the very first token
_SCRIPTS = torch.tensor([[5, 6, 0], [7, 0, 9], [3, 3, 3], [0, 4, 4]])
# the response each script gives (EOS included), keyed by its first token
_RESPONSES = {5: [5, 6, 0], 7: [7, 0], 3: [3, 3, 3], 0: [0]}
# prompts holding the eos/pad id as a real token, even as their first token
_PROMPTS = [[4, 0, 5], [0, 4], [6]]


def test_eos_equal_to_pad_stays_in_the_response_mask_torchrl_3580():
    P, M, V, N = 3, 3, 10, 4

    def reward_fn(prompt, prompt_mask, response, response_mask):
        # what the env passes: 10 per response token (EOS included) plus 1 per prompt token
        return 10.0 * response_mask.sum(-1) + prompt_mask.sum(-1)

    env = TokenLMEnv(_PROMPTS, reward_fn, num_envs=N, prompt_len=P, max_new_tokens=M, vocab_size=V,
                     eos_id=0, pad_id=0, seed=0)

    def policy(td):
        j = (td["position"] - P).clamp(max=M - 1)
        td.set("action", _SCRIPTS[torch.arange(N), j])
        td.set("sample_log_prob", -0.25 * (j + 1).float())  # -0.25, -0.5, -0.75 for response index 0, 1, 2
        return td

    batch = env.rollout(M, policy, break_when_any_done=False)
    llm = trajectories_to_llm_batch(batch, P, M)
    # finished responses: row 0 once, row 1 once (its 2nd response is cut), row 2 once, row 3 three times
    firsts = llm["response_ids"][:, 0].tolist()
    assert sorted(firsts) == [0, 0, 0, 3, 5, 7]
    for b, first in enumerate(firsts):
        response = _RESPONSES[first]
        n = len(response)
        prompt = _PROMPTS[int(llm["prompt_id"][b])]
        assert llm["mask"][b].tolist() == [j < n for j in range(M)], (b, response)
        assert llm["response_ids"][b, :n].tolist() == response
        ended_with_eos = response[-1] == 0
        assert bool(llm["terminated"][b]) == ended_with_eos and bool(llm["truncated"][b]) == (not ended_with_eos)
        # the prompt: real where its tokens are, the eos/pad id inside it included; the response: its n tokens
        assert llm["input_ids"][b, P - len(prompt) : P].tolist() == prompt
        assert llm["attention_mask"][b].tolist() == [P - len(prompt) <= c < P + n for c in range(P + M)]
        # the score lands on the last generated token (the EOS when there is one), nowhere else
        score = 10.0 * n + len(prompt)
        assert float(llm["score"][b]) == score
        assert llm["token_reward"][b].tolist() == [score if j == n - 1 else 0.0 for j in range(M)]
        assert llm["sample_log_prob"][b].tolist() == [-0.25 * (j + 1) if j < n else 0.0 for j in range(M)]


# --------------------------------------------------------------------------- #
# KL under padding (NaN / inf log-probs at padding must not turn the KL into NaN, and the sequence score must
# land on the last valid token, not on the first pad slot after EOS): the KL-penalised reward
# --------------------------------------------------------------------------- #

# four rows: right padding, a one-token response, left padding, a hole inside the response. The masked positions
# hold garbage, positive "log-probs" and -inf included, which the log-prob checks would refuse on a valid token
_KL_MASK = torch.tensor([[True, True, True, False], [True, False, False, False], [False, True, True, False],
                         [True, False, True, False]])
_KL_LP = torch.tensor([[-1.0, -0.5, -2.0, NAN], [-0.3, 7.0, NAN, NAN], [NAN, -1.0, -0.2, -INF],
                       [-0.4, 0.5, -0.6, NAN]])
_KL_REF = torch.tensor([[-1.5, -0.5, -1.0, 3.0], [-0.1, NAN, -INF, NAN], [9.0, -1.25, -0.2, NAN],
                        [-0.5, -9.0, -0.1, INF]])
# k1 = lp - ref on the valid tokens: row 0 (0.5, 0, -1), row 1 (-0.2), row 2 (-, 0.25, 0), row 3 (0.1, -, -0.5)
_KL_WANT = [[0.5, 0.0, -1.0, 0.0], [-0.2, 0.0, 0.0, 0.0], [0.0, 0.25, 0.0, 0.0], [0.1, 0.0, -0.5, 0.0]]
_BETA = 0.1
_TOKEN_R = torch.tensor([[0.1, 0.2, 1.0, NAN], [0.5, NAN, 1e30, NAN], [NAN, 0.0, 3.0, INF], [0.3, 50.0, -0.2, NAN]])
# per-token rewards minus 0.1 * k1: row 0: 0.1 - 0.05, 0.2, 1 + 0.1;  row 1: 0.5 + 0.02;  row 2: -, -0.025, 3;
# row 3: 0.3 - 0.01, -, -0.2 + 0.05
_TOK_WANT = [[0.05, 0.2, 1.1, 0.0], [0.52, 0.0, 0.0, 0.0], [0.0, -0.025, 3.0, 0.0], [0.29, 0.0, -0.15, 0.0]]
_SCORES = torch.tensor([2.0, -1.0, 4.0, 1.0])
# the score on the last valid token (columns 2, 0, 2, 2), never on a pad slot, minus 0.1 * k1 on every valid token:
#   row 0: -0.05, 0, 2 + 0.1 = 2.1;  row 1: -1 + 0.02 = -0.98;  row 2: -, -0.025, 4;  row 3: -0.01, -, 1 + 0.05
_SEQ_WANT = [[-0.05, 0.0, 2.1, 0.0], [-0.98, 0.0, 0.0, 0.0], [0.0, -0.025, 4.0, 0.0], [-0.01, 0.0, 1.05, 0.0]]


def _penalised(rewards, via_transform):
    """``(rewards, kl)`` ``[B, R]`` of the functional core or of ``KLPenaltyTransform`` on a ``[B]`` batch."""
    if not via_transform:
        return F.kl_penalized_rewards(rewards, _KL_LP, _KL_REF, _KL_MASK, _BETA)
    td = TensorDict({"sample_log_prob": _KL_LP, "ref_log_prob": _KL_REF, "mask": _KL_MASK,
                     ("next", "reward"): rewards.clone()}, batch_size=[_KL_MASK.shape[0]])
    out = KLPenaltyTransform(coeff=_BETA)(td)
    return out["next", "reward"].reshape(_KL_MASK.shape), out["kl_penalty"].reshape(_KL_MASK.shape)


def _check_penalised(rewards, kl, want_rewards):
    assert_matches_reference(kl, torch.tensor(_KL_WANT, dtype=torch.float64), name="kl", atol=1e-6, rtol=1e-6)
    assert_matches_reference(rewards, torch.tensor(want_rewards, dtype=torch.float64), name="reward", atol=1e-6,
                             rtol=1e-6)
    assert (rewards[~_KL_MASK] == 0).all() and (kl[~_KL_MASK] == 0).all()  # exactly 0, and not NaN


@pytest.mark.parametrize("via_transform", [False, True], ids=["functional", "transform"])
def test_kl_penalty_ignores_garbage_log_probs_at_padding(via_transform):
    _check_penalised(*_penalised(_TOKEN_R, via_transform), _TOK_WANT)


@pytest.mark.parametrize("via_transform", [False, True], ids=["functional", "transform"])
def test_sequence_score_lands_on_the_last_valid_token(via_transform):
    _check_penalised(*_penalised(_SCORES, via_transform), _SEQ_WANT)


# --------------------------------------------------------------------------- #
# Minibatch invariance (a token mean averaged per micro-batch, or micro-batches without a valid sample counted
# in the normaliser, change the gradient): minibatch gradients with the whole batch's normaliser add up to the
# whole batch's
# --------------------------------------------------------------------------- #


def _grads(loss_module, td, params, normalizer=None):
    if td["mask"].any():
        out = loss_module(td, normalizer=normalizer)
    else:  # a minibatch of empty rows: the loss says so, and contributes exactly nothing
        with pytest.warns(UserWarning, match="no valid token"):
            out = loss_module(td, normalizer=normalizer)
    total = sum(out[k] for k in out.keys() if k.startswith("loss_"))
    if not total.requires_grad:
        assert float(total) == 0.0
        return [torch.zeros_like(p) for p in params]
    grads = torch.autograd.grad(total, params, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]


def _check_minibatch_invariance(aggregation, splits, seed):
    td = response_batch(batch_size=8, response_len=5, mask="mixed", with_advantage=True, seed=seed)
    mask = td["mask"]
    actor, critic = tiny_actor_critic(seed=1)
    with torch.no_grad():  # a sampler near the actor: ratios around 1, some of them clipped (log-probs stay <= 0)
        near = actor(td.clone())["log_prob"] + 0.2 * torch.randn(mask.shape, generator=torch.Generator().manual_seed(0))
    td["sample_log_prob"] = torch.where(mask, near.clamp(max=0.0), 0.0)
    loss = TokenPPOLoss(actor, critic, aggregation=aggregation, entropy_coeff=0.01, kl_to_ref_coeff=0.1)
    assert 0.0 < float(loss(td)["clip_fraction"]) < 1.0
    params = [*actor.parameters(), *critic.parameters()]
    norm = F.loss_normalizer(mask, aggregation)
    # the whole batch's count, by hand: its valid tokens, or its rows with a valid token
    rows = mask.tolist()
    assert float(norm) == (sum(map(sum, rows)) if aggregation == "token-mean" else sum(map(any, rows)))
    whole = _grads(loss, td, params)
    parts = [_grads(loss, td[idx], params, normalizer=norm) for idx in splits]
    for w, *mb in zip(whole, *parts):
        torch.testing.assert_close(sum(mb), w, rtol=1e-5, atol=1e-7)
    return td


def test_minibatch_token_mean_gradients_add_up_to_the_whole_batch():
    # uneven minibatches (3, 1 and 4 rows) with uneven valid-token counts
    td = _check_minibatch_invariance("token-mean", [slice(0, 3), slice(3, 4), slice(4, 8)], seed=3)
    counts = [int(td["mask"][s].sum()) for s in (slice(0, 3), slice(3, 4), slice(4, 8))]
    assert len(set(counts)) > 1  # per-minibatch means would weigh the tokens unevenly


def test_minibatch_seq_mean_gradients_with_an_empty_minibatch():
    td = response_batch(batch_size=8, response_len=5, mask="mixed", with_advantage=True, seed=3)
    empty = (~td["mask"].any(-1)).nonzero().flatten().tolist()
    assert empty  # a row without a valid token: alone in a minibatch, it must add nothing
    e = empty[0]
    splits = [torch.tensor([e]), torch.tensor([b for b in range(8) if b != e][:3]),
              torch.tensor([b for b in range(8) if b != e][3:])]
    _check_minibatch_invariance("seq-mean-token-mean", splits, seed=3)

"""Sampling temperature: the env policy samples from softmax(logits / T), stores the log-probs of that
distribution, and every loss-side read-out scores the same distribution (TRL issue #4159: a policy that
samples at T but is scored at 1 starts PPO with a ratio that is not 1)."""

import math

import pytest
import torch
from tensordict import TensorDict
from torchrl.collectors import Collector

from ppo_objectives.functional import response_log_probs, response_log_probs_from_hidden
from ppo_objectives.llm.chat import CausalLMTokenLogProbs
from ppo_objectives.llm.env import TokenLMEnv
from ppo_objectives.llm.models import TinyCausalLM, TinyLMConfig
from ppo_objectives.llm.policy import NextTokenLogits, make_actor, sample_with_kv_cache
from ppo_objectives.llm.readouts import ResponseLogProbs, frozen_reference, make_actor_critic
from ppo_objectives.loss import TokenPPOLoss
from ppo_objectives.train.digit import DigitTask
from ppo_objectives.train.rollout import rollout_batch
from ppo_objectives.transforms import FixedKLController, KLPenaltyTransform
from ppo_objectives.value.gae import MaskedGAE


def _lm(vocab=16, block=16, seed=0, scale=1.0):
    torch.manual_seed(seed)
    lm = TinyCausalLM(TinyLMConfig.preset("pico", vocab_size=vocab, block_size=block)).eval()
    if scale != 1.0:  # spread the logits (the head is tied to the embedding): temperatures then differ clearly
        with torch.no_grad():
            lm.wte.weight.mul_(scale)
    return lm


def _tiny_llama(vocab=16):
    transformers = pytest.importorskip("transformers")
    from ppo_objectives.llm.hf import HFCausalLMAdapter

    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    return HFCausalLMAdapter.from_config(cfg).eval()


def _scaled_log_probs(logits: torch.Tensor, tokens: torch.Tensor, T: float) -> torch.Tensor:
    """The test's own log_softmax(logits / T)[token], in float64."""
    return torch.log_softmax(logits.double() / T, -1).gather(-1, tokens[..., None]).squeeze(-1)


# ----------------------------------------------------------------------------- the rollout's stored log-probs


@pytest.mark.parametrize("T", [0.7, 1.5])
def test_stored_log_probs_use_the_sampling_temperature_trl_4159(T):
    env = TokenLMEnv.from_task(DigitTask("reverse", 3), num_envs=4, seed=0)
    lm = _lm(block=env.seq_len, scale=4.0)
    with torch.no_grad():
        roll = env.rollout(3, make_actor(lm, temperature=T), break_when_any_done=False)
    for t in range(3):
        step = roll[:, t]
        with torch.no_grad():
            logits = lm(step["tokens"], step["attention_mask"]).logits[torch.arange(4), step["position"] - 1]
        want = _scaled_log_probs(logits, step["action"], T).float()
        torch.testing.assert_close(step["sample_log_prob"], want, atol=1e-5, rtol=1e-5)
        # the trap of TRL #4159: the log-probs of the unscaled distribution are other numbers
        assert (step["sample_log_prob"] - _scaled_log_probs(logits, step["action"], 1.0)).abs().max() > 1e-3
        torch.testing.assert_close(step["logits"], logits / T)  # the logits written are those sampled from


@pytest.mark.parametrize("T", [0.5, 2.0])
def test_sample_with_kv_cache_returns_the_log_probs_of_the_scaled_distribution(T):
    lm = _lm(scale=4.0)
    prompts = torch.tensor([[0, 3, 4, 5], [6, 7, 8, 9]])
    mask = prompts != 0
    gen = torch.Generator().manual_seed(0)
    resp, logp, rmask = sample_with_kv_cache(lm, prompts, mask, 3, eos_id=15, generator=gen, temperature=T)
    ids = torch.cat([prompts, resp], 1)
    with torch.no_grad():
        logits = lm(ids, torch.cat([mask, rmask], 1)).logits[:, 3:-1]  # predicting the 3 response tokens
    want = torch.where(rmask, _scaled_log_probs(logits, resp, T), 0.0).float()
    torch.testing.assert_close(logp, want, atol=1e-5, rtol=1e-5)
    # greedy decoding does not depend on the temperature
    greedy = [sample_with_kv_cache(lm, prompts, mask, 3, eos_id=15, greedy=True, temperature=t)[0] for t in (T, 1.0)]
    assert torch.equal(greedy[0], greedy[1])


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs.double() * counts.sum()
    return float(((counts.double() - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("T", [0.5, 2.0])
def test_sampled_tokens_follow_softmax_of_logits_over_temperature(T):
    # 40,000 one-token draws from one prompt: the frequencies fit softmax(logits / T), not softmax(logits)
    V, n = 8, 40_000
    lm = _lm(vocab=V, block=8, scale=3.0)
    prompt = torch.tensor([[1, 2, 3]]).expand(n, 3)
    gen = torch.Generator().manual_seed(0)
    tok, _, _ = sample_with_kv_cache(lm, prompt, torch.ones_like(prompt, dtype=torch.bool), 1, eos_id=V - 1,
                                     generator=gen, temperature=T)
    counts = torch.bincount(tok[:, 0], minlength=V)
    with torch.no_grad():
        logits = lm(prompt[:1], None).logits[0, -1].double()
    # chi-square with V - 1 = 7 degrees of freedom: 24.3 is its 0.999 quantile
    assert _chi_square(counts, torch.softmax(logits / T, -1)) < 24.3
    assert _chi_square(counts, torch.softmax(logits, -1)) > 500  # the unscaled distribution is rejected


def test_env_policy_samples_the_scaled_distribution():
    # the TorchRL policy (Categorical over the written logits): one env step for many rows at T = 0.5
    V, n, T = 8, 20_000, 0.5
    lm = _lm(vocab=V, block=8, scale=3.0)
    head = NextTokenLogits(lm, temperature=T)
    td = TensorDict(tokens=torch.tensor([[1, 2, 3, 0]]).expand(n, 4), attention_mask=torch.tensor(
        [[True, True, True, False]]).expand(n, 4), position=torch.full((n,), 3), batch_size=[n])
    torch.manual_seed(0)
    with torch.no_grad():
        td = make_actor(lm, temperature=T)(td)
        logits = head(td["tokens"][:1], td["attention_mask"][:1], td["position"][:1])[0].double()  # already / T
    counts = torch.bincount(td["action"], minlength=V)
    assert _chi_square(counts, torch.softmax(logits, -1)) < 24.3
    assert _chi_square(counts, torch.softmax(logits * T, -1)) > 500


# ----------------------------------------------------------------------------- the PPO ratio on the first step


def _first_update_batch(lm, T, *, shared_trunk=False, num_envs=8, seed=0):
    """The job's pieces at temperature ``T``: a TorchRL collector batch of the env policy, scored with the
    reference's KL and GAE, and the loss of the actor / critic read-outs."""
    env = TokenLMEnv.from_task(DigitTask("reverse", 2, min_digits=1), num_envs=num_envs, seed=seed)
    ac = make_actor_critic(lm, env.prompt_len, shared_trunk=shared_trunk, temperature=T)
    ref = frozen_reference(ac.actor_model, env.prompt_len, temperature=T)
    kl = KLPenaltyTransform(ref, coeff=FixedKLController(0.02))
    gae = MaskedGAE(gamma=1.0, lmbda=0.95, average_gae=True)
    collector = Collector(env, ac.policy, frames_per_batch=num_envs * env.max_new_tokens, total_frames=-1,
                          reset_at_each_iter=True, auto_register_policy_transforms=False)
    try:
        llm = rollout_batch(iter(collector), ac, kl, gae, env.prompt_len, env.max_new_tokens)
    finally:
        collector.shutdown()
    loss = TokenPPOLoss(ac.actor, ac.critic, kl_to_ref_coeff=0.1, entropy_bonus=True, functional=False)
    return ac, llm, loss


@pytest.mark.parametrize("T", [0.7, 1.5])
@pytest.mark.parametrize("model, shared_trunk", [("tiny", False), ("tiny", True), ("llama", True)])
def test_ppo_ratio_is_one_on_the_first_step_at_any_temperature(T, model, shared_trunk):
    lm = _lm(block=16, scale=4.0) if model == "tiny" else _tiny_llama()
    ac, llm, loss = _first_update_batch(lm, T, shared_trunk=shared_trunk)
    m = llm["mask"]
    assert m.sum() > 8
    with torch.no_grad():
        scored = ac.actor(llm.clone())["log_prob"]
        out = loss(llm)
    torch.testing.assert_close(scored[m], llm["sample_log_prob"][m], atol=1e-6, rtol=0)
    torch.testing.assert_close(llm["ref_log_prob"][m], llm["sample_log_prob"][m], atol=1e-6, rtol=0)  # KL 0
    one = torch.tensor(1.0)
    torch.testing.assert_close(out["mean_ratio"], one, atol=1e-6, rtol=0)
    torch.testing.assert_close(out["max_ratio"], one, atol=1e-6, rtol=0)
    assert out["clip_fraction"].item() == 0.0
    assert out["kl_approx"].item() < 1e-10 and abs(out["kl_ref"].item()) < 1e-6
    # TRL #4159: the same rollout scored at temperature 1 is not on-policy
    mismatched = ResponseLogProbs(ac.actor_model, llm["input_ids"].shape[1] - m.shape[1])(
        llm["input_ids"], llm["attention_mask"])[0]
    assert (mismatched - llm["sample_log_prob"])[m].abs().max() > 1e-3


# ----------------------------------------------------------------------------- the read-outs and the kernels


@pytest.mark.parametrize("T", [0.6, 1.7])
def test_log_prob_kernels_at_a_temperature_match_autograd_of_the_scaled_softmax(T):
    g = torch.Generator().manual_seed(0)
    B, L, V, C, P = 2, 6, 11, 4, 2
    ids = torch.randint(V, (B, L), generator=g)
    prompt_lens = torch.tensor([P, P + 1])
    R = L - P - 1
    hidden = torch.randn(B, L, C, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, C, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(V, generator=g, dtype=torch.float64, requires_grad=True)
    w_lp, w_ent = torch.randn(B, R, generator=g, dtype=torch.float64), torch.randn(B, R, generator=g, dtype=torch.float64)

    def reference():
        logits = (hidden @ weight.T + bias) / T
        pos = prompt_lens[:, None] - 1 + torch.arange(R)
        logq = torch.log_softmax(logits.gather(1, pos[..., None].expand(-1, -1, V)), -1)
        lp = logq.gather(-1, ids.gather(1, pos + 1)[..., None]).squeeze(-1)
        return lp, -(logq.exp() * logq).sum(-1)

    def grads(lp, ent):
        return torch.autograd.grad((lp * w_lp).sum() + (ent * w_ent).sum(), (hidden, weight, bias))

    lp_ref, ent_ref = reference()
    g_ref = grads(lp_ref, ent_ref)
    logits = hidden @ weight.T + bias
    lp, ent = response_log_probs(logits, ids, prompt_lens, R, return_entropy=True, chunk_size=3, temperature=T)
    torch.testing.assert_close((lp, ent), (lp_ref, ent_ref))
    for a, b in zip(grads(lp, ent), g_ref):
        torch.testing.assert_close(a, b)
    lp, ent = response_log_probs_from_hidden(hidden, weight, ids, prompt_lens, R, lm_head_bias=bias,
                                             return_entropy=True, chunk_size=3, temperature=T)
    torch.testing.assert_close((lp, ent), (lp_ref, ent_ref))
    for a, b in zip(grads(lp, ent), g_ref):
        torch.testing.assert_close(a, b)


def test_temperature_one_is_bit_identical_to_no_temperature():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 7, 13, generator=g, requires_grad=True)
    hidden = torch.randn(2, 7, 5, generator=g, requires_grad=True)
    weight = torch.randn(13, 5, generator=g, requires_grad=True)
    ids, prompt_lens = torch.randint(13, (2, 7), generator=g), torch.tensor([2, 3])
    for fn, args in ((response_log_probs, (logits,)), (response_log_probs_from_hidden, (hidden, weight))):
        outs = []
        for kw in ({}, {"temperature": 1.0}, {"temperature": 1}):
            lp, ent = fn(*args, ids, prompt_lens, 3, return_entropy=True, **kw)
            outs.append((lp, ent, *torch.autograd.grad((lp + ent).sum(), args)))
        for other in outs[1:]:
            assert all(torch.equal(a, b) for a, b in zip(outs[0], other))
    lm = _lm(block=8)
    ids = torch.randint(16, (3, 7), generator=g)
    am = torch.ones(3, 7, dtype=torch.bool)
    for fh in (False, True):
        a, b = ResponseLogProbs(lm, 3, from_hidden=fh)(ids, am), ResponseLogProbs(lm, 3, from_hidden=fh,
                                                                                 temperature=1.0)(ids, am)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("from_hidden", [False, True])
def test_causal_lm_token_log_probs_recompute_at_the_sampling_temperature(from_hidden):
    transformers = pytest.importorskip("transformers")
    V, T = (4096 if from_hidden else 32), 0.8
    cfg = transformers.Qwen2Config(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    tokens = torch.randint(V, (2, 6))
    mask = torch.tensor([[False, False, True, True, True, False], [False, True, True, True, True, True]])
    readout = CausalLMTokenLogProbs(hf, from_hidden=from_hidden, temperature=T)
    assert readout.from_hidden is from_hidden
    with torch.no_grad():
        lp, ent = readout.log_probs(tokens, torch.ones_like(mask), mask)
        logits = hf(input_ids=tokens).logits
    want = torch.zeros(2, 6, dtype=torch.float64)
    want[:, 1:] = _scaled_log_probs(logits[:, :-1], tokens[:, 1:], T)
    torch.testing.assert_close(lp, torch.where(mask, want, 0.0).float(), atol=1e-5, rtol=1e-5)
    logq = torch.log_softmax(logits[:, :-1].double() / T, -1)
    want_ent = torch.zeros(2, 6, dtype=torch.float64)
    want_ent[:, 1:] = -(logq.exp() * logq).sum(-1)
    torch.testing.assert_close(ent, torch.where(mask, want_ent, 0.0).float(), atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- errors


_BAD = [(0.0, ValueError, r"temperature=0\.0 must be a finite number > 0.*greedy"),
        (-1.0, ValueError, r"temperature=-1\.0 must be a finite number > 0"),
        (math.nan, ValueError, r"temperature=nan must be a finite number > 0"),
        (math.inf, ValueError, r"temperature=inf must be a finite number > 0"),
        (True, TypeError, r"temperature must be a float > 0 \(the sampling temperature\), got bool"),
        ("0.7", TypeError, r"temperature must be a float > 0 \(the sampling temperature\), got str")]


@pytest.mark.parametrize("value, error, match", _BAD)
def test_bad_temperatures_are_refused_by_the_policy_and_the_read_outs(value, error, match):
    lm = _lm(block=8)
    prompts = torch.tensor([[1, 2]])
    builders = {
        "make_actor": lambda: make_actor(lm, temperature=value),
        "NextTokenLogits": lambda: NextTokenLogits(lm, temperature=value),
        "sample_with_kv_cache": lambda: sample_with_kv_cache(lm, prompts, prompts > 0, 2, eos_id=1,
                                                             temperature=value),
        "make_actor_critic": lambda: make_actor_critic(lm, 2, temperature=value),
        "ResponseLogProbs": lambda: ResponseLogProbs(lm, 2, temperature=value),
        "frozen_reference": lambda: frozen_reference(lm, 2, temperature=value),
        "CausalLMTokenLogProbs": lambda: CausalLMTokenLogProbs(lm, from_hidden=False, temperature=value),
    }
    for who, build in builders.items():
        with pytest.raises(error, match=f"{who}: {match}"):
            build()


def test_evaluate_refuses_a_bad_temperature():
    from ppo_objectives.train.text import evaluate

    with pytest.raises(ValueError, match=r"evaluate: temperature=0 must be a finite number > 0.*greedy=True"):
        evaluate(_lm(block=8), None, greedy=False, temperature=0)


@pytest.mark.parametrize("value, error, match", [
    (0.0, ValueError, r"temperature=0\.0 must be a finite number > 0\.0 \(the sampling temperature"),
    (-2, ValueError, r"temperature=-2\.0 must be a finite number > 0\.0"),
    (math.nan, ValueError, r"temperature=nan must be a finite number > 0\.0"),
    (True, TypeError, r"temperature must be a positive float, got bool"),
])  # fmt: skip
def test_bad_temperatures_are_refused_by_the_functional_read_outs(value, error, match):
    logits, ids, lens = torch.zeros(1, 4, 5), torch.zeros(1, 4, dtype=torch.long), torch.tensor([1])
    with pytest.raises(error, match=match):
        response_log_probs(logits, ids, lens, 2, temperature=value)
    with pytest.raises(error, match=match):
        response_log_probs_from_hidden(torch.zeros(1, 4, 3), torch.zeros(5, 3), ids, lens, 2, temperature=value)

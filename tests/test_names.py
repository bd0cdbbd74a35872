"""One name per concept: the renamed arguments and flags, and the earlier spellings that still work.

Every earlier keyword of the functional core and of ``TokenPPOLoss`` warns with a
``DeprecationWarning`` that names the new one and gives the same numbers; every earlier
CLI flag warns with a ``FutureWarning`` (shown to people who run the job) and sets the
same field; a checkpoint saved under the earlier flag names is read with the new ones.
"""

import inspect
import warnings

import pytest
import torch

from ppo_objectives import MINIMIND_PPO_DEFAULTS, TokenPPOLoss
from ppo_objectives import functional as F
from ppo_objectives import testing as T
from ppo_objectives.train.config import RENAMED_FLAGS, TrainConfig, build_parser, check_launch
from ppo_objectives.value.gae import MaskedGAE


def _batch():
    td = T.response_batch(batch_size=3, response_len=5, mask="holes", with_advantage=True, seed=3)
    new = td["sample_log_prob"] - 0.1  # log-probs stay <= 0 (kl_estimate, without a mask, reads every position)
    return td, new


def _calls():
    """(function, positional args, other keywords, {earlier keyword: value}) for each function of the functional
    core with renamed keywords."""
    td, new = _batch()
    m, old, ref, adv, r, v = td["mask"], td["sample_log_prob"], td["ref_log_prob"], td["advantage"], \
        td["next", "reward"], td["state_value"]  # fmt: skip
    return [
        (F.ppo_policy_loss, (), dict(advantages=adv, mask=m, clip_epsilon=0.2),
         dict(new_logps=new, old_logps=old, loss_agg_mode="seq-mean-token-mean")),
        (F.approx_kl, (), dict(mask=m), dict(new_logps=new, old_logps=old)),
        (F.kl_estimate, (), {}, dict(logps=new, ref_logps=ref, old_logps=old)),
        (F.reference_kl_penalty, (), dict(mask=m),
         dict(policy_logps=new, ref_logps=ref, old_logps=old, loss_agg_mode="token-sum")),
        (F.masked_kl_estimate, (), dict(mask=m), dict(logps=new, ref_logps=ref)),
        (F.kl_penalized_rewards, (r,), dict(mask=m), dict(logps=old, ref_logps=ref, kl_coeff=0.1)),
        (F.rollout_correction_weights, (), dict(mask=m), dict(old_logps=old, rollout_logps=new)),
        (F.aggregate_loss, (new, m), {}, dict(mode="seq-mean-token-sum")),
        (F.loss_normalizer, (m,), {}, dict(mode="seq-mean-token-sum")),
        (F.clipped_value_loss, (v + 0.1, v, v, m), {}, dict(cliprange_value=0.05, loss_agg_mode="token-sum")),
        (F.masked_gae, (r, v, m, 1.0), {}, dict(lam=0.9, normalize=False)),
        (F.masked_gae_reference, (r, v, m, 1.0), {}, dict(lam=0.9, normalize=False)),
    ]


@pytest.mark.parametrize("index", range(12), ids=lambda i: _calls()[i][0].__name__)
def test_an_earlier_keyword_warns_with_the_new_name_and_gives_the_same_numbers(index):
    fn, args, others, earlier = _calls()[index]
    renames = fn.renamed_arguments
    assert set(earlier) == set(renames), "the case must exercise every renamed keyword of the function"
    current = {renames[name]: value for name, value in earlier.items()}
    assert set(current) | set(others) <= set(inspect.signature(fn).parameters)
    want = fn(*args, **others, **current)
    for name in earlier:  # one earlier keyword at a time, the others spelled as now
        mixed = {**current, name: earlier[name]}
        del mixed[renames[name]]
        with pytest.warns(DeprecationWarning, match=rf"{fn.__name__}\({name}=\.\.\.\) is deprecated: the argument "
                                                    rf"is now {renames[name]}="):
            got = fn(*args, **others, **mixed)
        for a, b in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_an_earlier_and_a_current_keyword_together_are_refused():
    td, new = _batch()
    with pytest.raises(TypeError, match=r"approx_kl\(\) got new_logps= and log_prob=; new_logps is the earlier name of "
                                        r"log_prob: give log_prob"):
        F.approx_kl(log_prob=new, new_logps=new, sample_log_prob=td["sample_log_prob"], mask=td["mask"])


def test_the_loss_takes_its_earlier_keywords_with_a_warning():
    actor, critic = T.tiny_actor_critic()
    with pytest.warns(DeprecationWarning, match=r"TokenPPOLoss\(kl_coeff=\.\.\.\) is deprecated: the argument is now "
                                                r"kl_to_ref_coeff="):
        loss = TokenPPOLoss(actor, critic, kl_coeff=0.3)
    assert float(loss.kl_to_ref_coeff) == pytest.approx(0.3)
    with pytest.warns(DeprecationWarning, match=r"TokenPPOLoss.minimind\(loss_agg_mode=\.\.\.\) is deprecated: the "
                                                r"argument is now aggregation="):
        loss = TokenPPOLoss.minimind(actor, critic, loss_agg_mode="token-sum")
    assert loss.aggregation == "token-sum"
    with pytest.raises(TypeError, match=r"TokenPPOLoss.minimind\(\) got unknown overrides \['clip_epsilon_high'\]"):
        TokenPPOLoss.minimind(actor, critic, clip_epsilon_high=0.3)


def test_the_clip_range_is_one_argument_and_two_schedulable_buffers():
    actor, critic = T.tiny_actor_critic()
    loss = TokenPPOLoss(actor, critic, clip_epsilon=(0.2, 0.28))
    assert (float(loss.clip_epsilon_low), float(loss.clip_epsilon_high)) == pytest.approx((0.2, 0.28))
    assert {"clip_epsilon_low", "clip_epsilon_high"} <= loss._schedulable_buffers
    td, new = _batch()
    pair = F.ppo_policy_loss(new, td["sample_log_prob"], td["advantage"], td["mask"], (0.2, 0.28))
    T.assert_matches_reference(pair, T.reference_ppo_policy_loss(new, td["sample_log_prob"], td["advantage"],
                                                                 td["mask"], (0.2, 0.28)))  # fmt: skip


@pytest.mark.parametrize("old", sorted(RENAMED_FLAGS))
def test_an_earlier_flag_warns_with_the_new_one_and_sets_the_same_field(old):
    new = RENAMED_FLAGS[old]
    value = {"loss_agg_mode": "token-sum", "kl_loss_coef": "0.3", "policy_lam": "0.5"}.get(old, "0.7")
    earlier = ["--" + old.replace("_", "-")] + ([] if old == "whiten" else [value])
    current = ["--" + new.replace("_", "-")] + ([] if old == "whiten" else [value])
    flag = "--" + new.replace("_", "-")
    with pytest.warns(FutureWarning, match=rf"{earlier[0]} is deprecated: the flag is now {flag}"):
        got = vars(build_parser().parse_args(earlier))
    assert got == vars(build_parser().parse_args(current))


def test_the_negative_of_an_earlier_boolean_flag_warns_with_the_new_negative():
    with pytest.warns(FutureWarning, match=r"--no-whiten is deprecated: the flag is now --no-average-gae"):
        args = build_parser().parse_args(["--no-whiten"])
    assert TrainConfig(**vars(args)).average_gae is False


def test_a_resume_reads_an_earlier_checkpoint_with_the_new_flag_names(tmp_path):
    config = {"kl_coef": 0.5, "lam": 0.95, "whiten": True}  # saved under the earlier names
    torch.save({"iteration": 2, "config": config}, tmp_path / "checkpoint.pt")
    cfg = TrainConfig(out=str(tmp_path), resume=True, iterations=5)
    with pytest.raises(ValueError, match=r"--kl-reward-coeff 0\.02 \(the checkpoint's: 0\.5\).*--allow-change "
                                         r"kl-reward-coeff$"):
        check_launch(cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # --allow-change takes the earlier spelling without a warning
        check_launch(TrainConfig(out=str(tmp_path), resume=True, iterations=5, allow_change="kl-coef"))


def test_the_job_takes_its_defaults_from_the_modules_it_configures():
    loss, gae = inspect.signature(TokenPPOLoss).parameters, inspect.signature(MaskedGAE).parameters
    cfg = TrainConfig()
    for name in ("clip_epsilon", "clip_value", "critic_coeff", "entropy_coeff"):
        assert getattr(cfg, name) == loss[name].default, name
    assert cfg.gamma == gae["gamma"].default
    # MiniMind's values, where the modules' defaults are MiniMind's too
    for name in ("clip_epsilon", "critic_coeff", "clip_value", "entropy_coeff", "normalize_advantage", "aggregation",
                 "kl_estimator", "kl_to_ref_coeff"):
        assert loss[name].default == MINIMIND_PPO_DEFAULTS[name], name
    assert (gae["gamma"].default, gae["lmbda"].default) == (MINIMIND_PPO_DEFAULTS["gamma"], MINIMIND_PPO_DEFAULTS["lmbda"])

"""Side by side with TorchRL's own LLM pieces, where they differ from ours on padded batches and sequence rewards.

- The in-loss reference KL: ``TokenPPOLoss(kl_to_ref_coeff=...)`` averages the per-token k3 over
  the valid tokens, so padding the same responses further changes nothing. ``GRPOLoss`` (the term
  its ``forward`` adds as ``loss_kl_to_ref``, computed by its ``_kl_to_ref``) zeroes the padded
  positions and then averages over every position: the same responses padded twice as far give
  half the KL.
- The KL in the reward: ``KLPenaltyTransform`` puts a sequence score on the last valid token of
  its response; TorchRL's ``KLComputation`` (the reward step of ``RetrieveKL``, the same
  arithmetic as the legacy ``KLRewardTransform``'s ``rew.expand``) copies it onto every token, so
  a response's rewards sum to ``length * score - beta * sum(kl)``.

``benchmarks/side_by_side_torchrl.py`` prints the figures quoted in docs/comparison.md, and measures
``GRPOLoss``'s in-loss KL through its private ``_kl_to_ref`` (a measurement, not a pin of TorchRL's internals).
"""

import math

import pytest
import torch
from tensordict import TensorDict, lazy_stack
from tensordict.nn import TensorDictModule
from torchrl.envs.llm.transforms.kl import KLComputation

from ppo_objectives import KLPenaltyTransform, TokenPPOLoss

LENGTHS = (2, 4)  # two responses, their valid tokens
POLICY, REF = math.log(0.5), math.log(0.25)  # d = ref - policy = log(0.5): k3 = exp(d) - d - 1 = 0.1931 per token
K3 = math.exp(REF - POLICY) - (REF - POLICY) - 1


def _padded(R: int) -> TensorDict:
    """The two responses right-padded to ``R`` tokens (garbage in the padding)."""
    mask = torch.arange(R) < torch.tensor(LENGTHS)[:, None]
    garbage = torch.full((2, R), -7.0)
    return TensorDict(
        {
            "lp_in": torch.where(mask, POLICY, garbage),
            "sample_log_prob": torch.where(mask, POLICY, garbage),
            "ref_log_prob": torch.where(mask, REF, garbage),
            "advantage": torch.zeros(2, R),
            "mask": mask,
        },
        batch_size=[2],
    )


def ours_kl(R: int) -> float:
    actor = TensorDictModule(torch.nn.Identity(), in_keys=["lp_in"], out_keys=["log_prob"])
    loss = TokenPPOLoss(actor, None, kl_to_ref_coeff=1.0, functional=False)
    return float(loss(_padded(R))["loss_kl_ref"])


def test_the_in_loss_kl_is_a_mean_over_valid_tokens_whatever_the_padding():
    # TorchRL's GRPOLoss averages over every position instead (its private _kl_to_ref, measured side by side in
    # benchmarks/side_by_side_torchrl.py): the same responses padded twice as far give it half the KL
    assert ours_kl(4) == pytest.approx(K3, rel=1e-6)
    assert ours_kl(8) == pytest.approx(K3, rel=1e-6)  # padding further changes nothing


def _scored(beta: float, scores=(1.0, 3.0)):
    """Per response: its tokens' log-probs under the policy and the reference, and one score."""
    return [(torch.full((n,), POLICY), torch.full((n,), REF), s) for n, s in zip(LENGTHS, scores)]


def ours_rewards(beta: float) -> list[torch.Tensor]:
    rows = _scored(beta)
    R = max(LENGTHS)
    mask = torch.arange(R) < torch.tensor(LENGTHS)[:, None]
    pad = lambda xs: torch.stack([torch.cat([x, torch.full((R - len(x),), -7.0)]) for x in xs])  # noqa: E731
    td = TensorDict(
        {
            "sample_log_prob": pad([lp for lp, _, _ in rows]),
            "ref_log_prob": pad([ref for _, ref, _ in rows]),
            "mask": mask,
            ("next", "reward"): torch.tensor([s for _, _, s in rows]),
        },
        batch_size=[2],
    )
    out = KLPenaltyTransform(coeff=beta)(td)["next", "reward"]
    return [out[i, :n] for i, n in enumerate(LENGTHS)]


def torchrl_rewards(beta: float) -> list[torch.Tensor]:
    rows = [
        TensorDict({"next": TensorDict({("log_probs", "full"): lp, ("ref_log_probs", "full"): ref,
                                        "reward": torch.tensor([[s]])}, [])}, [])
        for lp, ref, s in _scored(beta)
    ]  # fmt: skip
    out = KLComputation(coeff=beta)(lazy_stack(rows))
    return [r.squeeze(-1) for r in out["next"].get("reward", as_list=True)]


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage:UserWarning")
def test_a_sequence_score_lands_on_the_last_token_and_torchrls_is_copied_onto_every_token():
    beta, kl = 0.5, POLICY - REF  # k1 per token
    for n, score, ours, theirs in zip(LENGTHS, (1.0, 3.0), ours_rewards(beta), torchrl_rewards(beta)):
        want = torch.full((n,), -beta * kl)
        want[-1] += score
        torch.testing.assert_close(ours, want)
        torch.testing.assert_close(theirs, torch.full((n,), score - beta * kl))
        assert float(ours.sum()) == pytest.approx(score - beta * kl * n)
        assert float(theirs.sum()) == pytest.approx(n * score - beta * kl * n)  # the score counted n times

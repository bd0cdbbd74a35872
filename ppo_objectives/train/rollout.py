"""One rollout: collect episodes, score them (values, reference KL penalty), estimate advantages.

:func:`rollout_batch` is :func:`collect_batch` (the collector's per-token rows into
the response layout) followed by :func:`score_batch` (the critic's values, the
KL-penalised rewards of :class:`~ppo_objectives.transforms.KLPenaltyTransform`,
then the advantage estimator); :func:`rollout_stats` reduces what is logged over ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from tensordict import TensorDictBase
from torch import Tensor

from ppo_objectives import functional as F
from ppo_objectives.llm.layouts import trajectories_to_llm_batch
from ppo_objectives.llm.readouts import ActorCritic
from ppo_objectives.train.distributed import all_reduce
from ppo_objectives.transforms import KLPenaltyTransform
from ppo_objectives.value.gae import MaskedGAE

#: Where a critic-free group estimator reads each response's return: the sum of its (KL-penalised) per-token
#: rewards, which is the task score when the in-reward KL coefficient is 0.
RETURN_KEY = "penalized_score"


# --------------------------------------------------------------------------- #
# The algorithm: rollout, then the PPO update with its trust region
# --------------------------------------------------------------------------- #


def rollout_batch(collector_iter, ac: ActorCritic, kl_transform: KLPenaltyTransform, gae: MaskedGAE, P: int,
                  M: int):
    """One collector batch -> the response-layout batch the loss trains on (advantages included).

    Under data parallelism ``gae`` whitens over the valid tokens of every rank
    (``MaskedGAE(..., average_gae=True, process_group=pg)``).
    """
    device = next(ac.actor_model.parameters()).device
    return score_batch(collect_batch(collector_iter, device, P, M), ac, kl_transform, gae)


def collect_batch(collector_iter, device: torch.device, P: int, M: int, *,
                  policy_version: int | None = None) -> TensorDictBase:
    """The first half of :func:`rollout_batch`: the collector's next batch ``[N, T]`` in the response layout
    (:func:`response_layout`; ``policy_version``: the version its frames must carry)."""
    return response_layout(next(collector_iter), device, P, M, policy_version=policy_version)


def response_layout(batch: TensorDictBase, device: torch.device, P: int, M: int, *,
                    policy_version: int | None = None) -> TensorDictBase:
    """One collector batch of per-token steps ``[N, T]`` (``[workers, N, T]`` from workers) as the response layout
    ``[B]``, with the env's per-token reward copied where ``MaskedGAE`` reads it. With ``policy_version``, every
    frame must first carry it (:func:`check_policy_version`).

    Example:
        >>> from torchrl.collectors import Collector
        >>> from ppo_objectives.train.digit import DigitTask
        >>> from ppo_objectives.llm.env import TokenLMEnv
        >>> from ppo_objectives.llm.models import TinyCausalLM, TinyLMConfig
        >>> from ppo_objectives.llm.policy import make_actor
        >>> env = TokenLMEnv.from_task(DigitTask("reverse", 2), num_envs=4, seed=0)
        >>> actor = make_actor(TinyCausalLM(TinyLMConfig.preset("pico", vocab_size=16, block_size=6)))
        >>> collector = Collector(env, actor, frames_per_batch=4 * 3, total_frames=12, reset_at_each_iter=True,
        ...                       auto_register_policy_transforms=False, track_policy_version=True)
        >>> batch = next(iter(collector))  # [N=4, T=3] steps, every frame at version 0
        >>> collector.shutdown()
        >>> llm = response_layout(batch, torch.device("cpu"), env.prompt_len, env.max_new_tokens, policy_version=0)
        >>> llm["next", "reward"].shape, llm["mask"].shape
        (torch.Size([4, 3]), torch.Size([4, 3]))
        >>> response_layout(batch, torch.device("cpu"), env.prompt_len, env.max_new_tokens, policy_version=1)
        Traceback (most recent call last):
        ...
        RuntimeError: policy version: 12 of 12 frames were sampled with version(s) [0], ...
    """
    if policy_version is not None:
        check_policy_version(batch, policy_version)
    llm = trajectories_to_llm_batch(batch.to(device), P, M)
    llm.set(("next", "reward"), llm.get("token_reward").clone())  # the env's per-token reward
    return llm


def check_policy_version(batch: TensorDictBase, expected: int) -> None:
    """Every frame of a workers' ``batch`` was sampled with the learner's latest weights: its ``"policy_version"``
    (TorchRL's ``PolicyVersion``, bumped on each worker by every weight push) is ``expected``, the learner's count of
    pushes.

    Example:
        >>> from tensordict import TensorDict
        >>> batch = TensorDict(policy_version=torch.tensor([[3, 3], [3, 2]]), batch_size=[2, 2])
        >>> check_policy_version(batch, 3)
        Traceback (most recent call last):
        ...
        RuntimeError: policy version: 1 of 4 frames were sampled with version(s) [2], ...
    """
    if "policy_version" not in batch.keys():
        raise KeyError("the collector's batch has no 'policy_version' entry to check the workers' weights by: build "
                       "the workers' collectors with track_policy_version=True (make_collector does)")
    seen = batch.get("policy_version")
    stale = seen != expected
    if bool(stale.any()):
        versions = sorted(set(seen[stale].tolist()))
        raise RuntimeError(f"policy version: {int(stale.sum())} of {seen.numel()} frames were sampled with version(s) "
                           f"{versions}, and the learner's latest weights are version {expected}: a weight push did "
                           "not reach every worker, so the batch is not on-policy")


def score_batch(llm: TensorDictBase, ac: ActorCritic, kl_transform: KLPenaltyTransform | None,
                gae: MaskedGAE) -> TensorDictBase:
    """The second half of :func:`rollout_batch`: ``V_old`` (unless the env policy wrote it), the reference
    log-probs and the KL penalty (none when ``kl_transform`` is ``None``), then GAE; returns ``llm`` with these
    entries."""
    with torch.no_grad():
        critic_free = getattr(gae, "critic_free", False)
        if "state_value" not in llm.keys() and not critic_free:  # a critic on the actor's trunk: the policy wrote it
            ac.critic(llm)  # V_old: "state_value" [B, R]
        if kl_transform is not None:  # None: no KL term, no reference
            kl_transform(llm)  # "ref_log_prob", "kl_penalty"; reward -= beta * k1 on every token
        if critic_free:  # a group estimator reads each response's (penalised) return
            llm.set(RETURN_KEY, F.masked_sum(llm.get(("next", "reward")), llm.get("mask"), dim=-1))
        if getattr(gae, "holes", "skip") == "cut":  # a turn before a hole bootstraps from the value after it
            llm.set(("next", "state_value"), next_valid_values(llm.get("state_value"), llm.get("mask")))
        gae(llm)  # "advantage" (whitened over valid tokens), "value_target" = raw advantage + V_old
    return llm


def next_valid_values(values: Tensor, mask: Tensor) -> Tensor:
    """``[B, R]``: at each position the value of the row's next valid token (0 where none follows): the value of
    the state after the environment's turn, for the token before it (``MaskedGAE(holes="cut")``'s bootstrap).

    Example:
        >>> next_valid_values(torch.tensor([[1.0, 9.0, 3.0, 4.0]]), torch.tensor([[True, False, True, True]]))
        tensor([[3., 3., 4., 0.]])
    """
    R = mask.shape[-1]
    index = torch.where(mask, torch.arange(R, device=mask.device), R)  # a valid position's own index, else R
    after = torch.cat([index[..., 1:], torch.full_like(index[..., :1], R)], dim=-1)
    nxt = after.flip(-1).cummin(-1).values.flip(-1)  # the first valid index after each position, or R
    return torch.cat([values, torch.zeros_like(values[..., :1])], dim=-1).gather(-1, nxt)


def rollout_stats(llm: TensorDictBase, kl_transform: KLPenaltyTransform | None, pg) -> dict:
    """The rollout's metrics, over the responses of every rank (one all-reduce under torchrun); ``kl_ref`` and
    ``seq_kl`` are nan without a ``kl_transform`` (no reference)."""
    score, B, mask = llm["score"], llm.batch_size[0], llm["mask"]
    n_tok = mask.sum()
    previous = torch.cat([torch.zeros_like(mask[:, :1]), mask[:, :-1]], dim=1)
    n_turns = (mask & ~previous).sum()  # the assistant's turns: the runs of the mask
    nan = torch.tensor(float("nan"), device=score.device)
    last_kl, last_seq_kl = (nan, nan) if kl_transform is None else (kl_transform.last_kl, kl_transform.last_seq_kl)
    if pg is None:
        return dict(
            reward=float(score.mean()), exact=float((score >= 1.0).float().mean()),
            response_len=int(n_tok) / max(B, 1), episodes=B, kl_ref=float(last_kl),
            seq_kl=float(last_seq_kl), seq_kl_t=last_seq_kl, tokens=int(n_tok),
            turns=int(n_turns) / max(B, 1), turn_tokens=int(n_tok) / max(int(n_turns), 1),
        )  # fmt: skip
    v = torch.stack([
        score.sum(), (score >= 1.0).sum(), n_tok, torch.tensor(B, device=score.device),
        last_kl.to(score.device), last_seq_kl.to(score.device) * B, n_turns,
    ]).to(torch.float64)  # fmt: skip
    total = all_reduce(v, pg).tolist()
    episodes = max(total[3], 1.0)
    seq_kl = total[5] / episodes
    return dict(
        reward=total[0] / episodes, exact=total[1] / episodes, response_len=total[2] / episodes,
        episodes=int(total[3]), kl_ref=total[4] / dist.get_world_size(pg), seq_kl=seq_kl,
        seq_kl_t=torch.tensor(seq_kl, dtype=torch.float32, device=last_seq_kl.device),
        tokens=int(total[2]), turns=total[6] / episodes, turn_tokens=total[2] / max(total[6], 1.0),
    )  # fmt: skip

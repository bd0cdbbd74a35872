"""Tutorial 4: KLPenaltyTransform, the reference-KL penalty in the reward, where TorchRL runs transforms.

Run it:  python tutorials/04_kl_penalty_transform.py

RLHF-style PPO (Ziegler et al. 2019) keeps the policy near a frozen reference
by paying, per token, ``reward_t - coeff * kl_t`` with ``kl_t = logp_t -
ref_logp_t`` (the k1 estimator: unbiased when tokens are sampled from the
policy). MiniMind instead adds a k3 KL to the loss (tutorial 3); you can do
either or both. Four things to see:

1. a batch of responses: per-token penalty, and a sequence score that stays on
   the last valid token (copying it onto every token would count it R times);
2. a replay buffer: the penalty is applied once, on ``extend``, never again on ``sample``
   (for PPO the penalty belongs before ``MaskedGAE``, since it is part of the reward GAE
   reads: in the env, a collector ``postproc`` or on the batch; a buffer of already
   penalised data is what this section shows, not where the penalty goes in PPO);
3. inside a ``TransformedEnv`` where one step is one token;
4. the adaptive coefficient of Ziegler et al., steering the KL towards a target.
"""

import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn
from torchrl.data import Bounded, Categorical, Composite, LazyTensorStorage, ReplayBuffer
from torchrl.envs import EnvBase, TransformedEnv

from ppo_objectives import AdaptiveKLController
from ppo_objectives import KLPenaltyTransform

torch.set_printoptions(precision=3, sci_mode=False)

# --------------------------------------------------------------------------- #
# 1. Two responses (R = 4, row 1 has 2 tokens), one score each.
# --------------------------------------------------------------------------- #
batch = TensorDict(
    {
        "sample_log_prob": torch.tensor([[-1.0, -0.5, -2.0, -1.0], [-0.2, -0.3, 0.0, 0.0]]),
        "ref_log_prob": torch.tensor([[-1.2, -0.5, -1.0, -1.5], [-0.2, -1.3, 0.0, 0.0]]),
        "mask": torch.tensor([[True, True, True, True], [True, True, False, False]]),
        ("next", "reward"): torch.tensor([1.0, -1.0]),  # one score per response
    },
    batch_size=[2],
)
transform = KLPenaltyTransform(coeff=0.1)  # k1 by default
out = transform(batch.clone())
print("== 1. a batch of responses (coeff 0.1, k1)")
print("kl_penalty = logp - ref_logp =\n", out["kl_penalty"])
print("reward =\n", out["next", "reward"])
print("look: each score sits on its response's last token (row 0: 1 - 0.1 * 0.5 = 0.95); padding is 0;")
print("      a negative k1 (row 0, token 2: the reference likes that token more) adds to the reward")
print(f"total reward row 0 = {out['next', 'reward'][0].sum():.3f}; a score copied onto 4 tokens would give ~4")
print(f"last_kl (mean per token) = {transform.last_kl:.3f}, last_seq_kl (mean per response) = {transform.last_seq_kl:.3f}")

# --------------------------------------------------------------------------- #
# 2. In a replay buffer: inv() on extend applies it; forward() on sample sees
#    kl_penalty already there and leaves the data alone. (In PPO, penalise before
#    MaskedGAE instead: the advantages are computed once per rollout, so a penalty
#    applied later, in the minibatches' buffer, would never reach them.)
# --------------------------------------------------------------------------- #
dense = batch.clone().exclude(("next", "reward"))  # the same responses, now with per-token rewards
dense[("next", "reward")] = torch.tensor([[0.0, 0.0, 0.0, 1.0], [0.0, -1.0, 0.0, 0.0]])
dense.batch_size = [2, 4]
rb = ReplayBuffer(storage=LazyTensorStorage(2), batch_size=2, transform=KLPenaltyTransform(coeff=0.1))
rb.extend(dense)
sample, info = rb.sample(return_info=True)
expected = KLPenaltyTransform(coeff=0.1)(dense.clone())["next", "reward"][info["index"]]
print("\n== 2. replay buffer: penalised once")
print("sampled reward equals a single application:", torch.allclose(sample["next", "reward"], expected))


# --------------------------------------------------------------------------- #
# 3. One token per env step (plumbing: a 5-token toy env, a scripted policy
#    emitting token + 1 with log-prob -0.5, a reference that dislikes even tokens).
# --------------------------------------------------------------------------- #
class ToyTokenEnv(EnvBase):
    def __init__(self):
        super().__init__(batch_size=[1])
        self.observation_spec = Composite(token=Categorical(5, shape=(1,)), shape=(1,))
        self.action_spec = Categorical(5, shape=(1,))
        self.reward_spec = Bounded(0.0, 1.0, shape=(1, 1))

    def _reset(self, td):
        return TensorDict(token=torch.zeros(1, dtype=torch.long), batch_size=[1])

    def _step(self, td):
        done = torch.zeros(1, 1, dtype=torch.bool)
        reward = (td["action"] == 1).float().unsqueeze(-1)
        return TensorDict(token=td["action"], reward=reward, done=done, terminated=done, batch_size=[1])

    def _set_seed(self, seed):
        return seed


class Scripted(nn.Module):
    def forward(self, token):
        return (token + 1) % 5, torch.full(token.shape, -0.5)


class Reference(nn.Module):
    def forward(self, action):
        return torch.where(action % 2 == 0, -1.0, -0.5)


policy = TensorDictModule(Scripted(), in_keys=["token"], out_keys=["action", "sample_log_prob"])
reference = TensorDictModule(Reference(), in_keys=["action"], out_keys=["log_prob"])
env = TransformedEnv(ToyTokenEnv(), KLPenaltyTransform(reference, coeff=0.1))
rollout = env.rollout(4, policy)
print("\n== 3. TransformedEnv, one token per step")
print("tokens    =", rollout["action"][0].tolist())  # rollout is [env batch 1, time 4]
print("kl        =", rollout["next", "kl_penalty"][0].tolist())
print("reward    =", [round(x, 3) for x in rollout["next", "reward"][0, :, 0].tolist()])
print("look: even tokens cost 0.1 * 0.5 = 0.05; the reward spec is now", type(env.reward_spec).__name__)

# --------------------------------------------------------------------------- #
# 4. Adaptive coefficient (Ziegler et al. 2019): beta grows while the KL is above
#    target, shrinks while below, at most 20% of n_steps / horizon per update.
# --------------------------------------------------------------------------- #
controller = AdaptiveKLController(init_coeff=0.1, target=6.0, horizon=1000)
print("\n== 4. AdaptiveKLController (target 6 nats per response, horizon 1000, 64 responses per batch)")
for observed in (12.0, 12.0, 9.0, 6.0, 3.0, 1.0):
    beta = controller.update(torch.tensor(observed), n_steps=64)
    print(f"observed KL {observed:5.1f} -> coeff {beta.item():.4f}")
print("look: pass it as KLPenaltyTransform(coeff=controller) and feed it transform.last_seq_kl each iteration")

"""Tutorial 3: TokenPPOLoss, PPO's update as a TorchRL loss module, and what its diagnostics mean.

Run it:  python tutorials/03_token_ppo_loss.py

The loss needs two networks with a simple interface:

* the actor, a TensorDict module that reads the token entries and writes
  ``log_prob`` ``[B, R]`` (log-probability of each response token under the
  current policy) and optionally ``entropy`` ``[B, R]``;
* the critic, a TensorDict module that writes ``state_value`` ``[B, R]``.

Here both are tiny (an embedding of the previous token and a linear layer) so
the script runs in seconds; a causal LM plugs in the same way. The toy task:
responses of up to 6 tokens from a vocabulary of 8, scored by the fraction of
tokens equal to 3. We run MiniMind's recipe: rollout, reference KL in the loss,
GAE with whitening, a few PPO epochs over minibatches, early stop on
``kl_approx``.
"""

import copy
import os

import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn
from torchrl.data import LazyTensorStorage, ReplayBuffer
from torchrl.data.replay_buffers import SamplerWithoutReplacement

from ppo_objectives import TokenPPOLoss

SMOKE = os.environ.get("PPO_TUTORIAL_SMOKE") == "1"
ITERATIONS = 3 if SMOKE else 12
V, B, R, MB, EPOCHS = 8, 32, 6, 8, 4
EARLY_STOP_KL = 0.25  # MiniMind's --early_stop_kl: the loop's, not the loss's (the loss never stops)
torch.manual_seed(0)


# --------------------------------------------------------------------------- #
# The networks (plumbing): previous token -> next-token logits / value.
# --------------------------------------------------------------------------- #
class Policy(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(V, 32), nn.Linear(32, V)

    def logits(self, prev_tokens):  # [B, R] -> [B, R, V]
        return self.head(self.emb(prev_tokens))

    def forward(self, prev_tokens, tokens):  # -> log_prob [B, R], entropy [B, R]
        logp_all = torch.log_softmax(self.logits(prev_tokens), -1)
        return logp_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), -(logp_all.exp() * logp_all).sum(-1)


class Critic(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(V, 32), nn.Linear(32, 1)

    def forward(self, prev_tokens):  # -> state_value [B, R]
        return self.head(self.emb(prev_tokens)).squeeze(-1)


policy = Policy()
actor = TensorDictModule(policy, in_keys=["prev_tokens", "tokens"], out_keys=["log_prob", "entropy"])
critic = TensorDictModule(Critic(), in_keys=["prev_tokens"], out_keys=["state_value"])
reference = copy.deepcopy(actor).requires_grad_(False)  # the frozen reference policy


def rollout() -> TensorDict:
    """Sample B responses; the score goes on each response's last token (plumbing)."""
    prev = torch.zeros(B, dtype=torch.long)
    tokens, prevs = [], []
    with torch.no_grad():
        for _ in range(R):
            nxt = torch.multinomial(torch.softmax(policy.logits(prev), -1), 1).squeeze(-1)
            prevs.append(prev)
            tokens.append(nxt)
            prev = nxt
    tokens, prevs = torch.stack(tokens, 1), torch.stack(prevs, 1)
    lengths = torch.randint(2, R + 1, (B,))
    mask = torch.arange(R) < lengths[:, None]
    score = ((tokens == 3) & mask).float().sum(-1) / lengths
    reward = torch.zeros(B, R)
    reward[torch.arange(B), lengths - 1] = score
    td = TensorDict({"prev_tokens": prevs, "tokens": tokens, "mask": mask, ("next", "reward"): reward}, [B, R])
    with torch.no_grad():
        td["sample_log_prob"] = actor(td.copy())["log_prob"]
        td["ref_log_prob"] = reference(td.copy())["log_prob"]
        td["state_value"] = critic(td.copy())["state_value"]
    return td


# --------------------------------------------------------------------------- #
# The algorithm: MiniMind's defaults in one call, then the PPO loop.
# --------------------------------------------------------------------------- #
loss_module = TokenPPOLoss.minimind(actor, critic)  # clip 0.2, vf 0.5, kl 0.02 (k3), value clip 0.2, GAE(1.0, 0.95)
optimizer = torch.optim.Adam(loss_module.parameters(), lr=2e-3)
buffer = ReplayBuffer(storage=LazyTensorStorage(B), sampler=SamplerWithoutReplacement(), batch_size=MB)
print(
    f"MiniMind preset: clip {float(loss_module.clip_epsilon_low):.2f}, critic_coeff {float(loss_module.critic_coeff):.2f}, "
    f"kl_to_ref_coeff {float(loss_module.kl_to_ref_coeff):.2f}, value clip {float(loss_module.clip_value):.2f}, "
    f"early stop at kl_approx > {EARLY_STOP_KL}"
)

for it in range(ITERATIONS):
    batch = rollout()
    loss_module.value_estimator(batch)  # MaskedGAE: advantages (whitened over the batch) and value targets
    buffer.empty()
    buffer.extend(batch)
    logs, stop = [], False
    for epoch in range(EPOCHS):
        for _ in range(B // MB):
            out = loss_module(buffer.sample())
            if out["kl_approx"] > EARLY_STOP_KL:  # MiniMind's early stop (a host sync, once per step)
                stop = True
                break
            logs.append(out.detach())
            loss = out["loss_objective"] + out["loss_critic"] + out["loss_kl_ref"] + out["loss_entropy"]
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        if stop:
            break
    if it % 2 == 0 or it == ITERATIONS - 1:
        out = torch.stack(logs).mean()  # each diagnostic averaged over this iteration's minibatches
        score = batch["next", "reward"].sum(-1).mean()
        print(
            f"iter {it:2d}  score {score:.3f}  objective {out['loss_objective'].item():+.4f}  "
            f"critic {out['loss_critic'].item():.4f}  kl_ref {out['kl_ref'].item():.4f}  "
            f"kl_approx {out['kl_approx'].item():.4f}  clip_frac {out['clip_fraction'].item():.3f}  "
            f"ESS {out['ESS'].item():.3f}  expl_var {out['explained_variance'].item():+.3f}"
        )

print("""
What to look at (all diagnostics are masked to the real response tokens):
  score              mean sequence score of the rollout: should rise towards 1 (every token a 3)
  loss_objective     clipped surrogate; near 0 at the first minibatch (ratio 1, whitened advantages)
  loss_critic        0.5 * critic_coeff * clipped squared error: falls as the critic learns the returns
  kl_ref             k3 KL to the frozen reference: grows slowly, held back by kl_to_ref_coeff = 0.02
  kl_approx          mean 0.5 (logp - sample_logp)^2 within the PPO epochs; above 0.25 they stop
  clip_fraction      share of tokens whose ratio left [0.8, 1.2]: a few percent to a few tens is healthy
  ESS                effective sample size of the ratios, 1 = all equal; a drop means one policy step went far
  explained_variance 1 - var(G - V)/var(G): 1 is a perfect critic, <= 0 no better than a constant
                     (it swings wildly once nearly every return is the same and var(G) is tiny)
""")

"""Tutorial 1: the five functions of PPO's update, on a toy batch you can check by hand.

Run it:  python tutorials/01_functional_core.py

PPO for language models treats every generated token as an action. After a
rollout we hold, for each response token: the log-prob under the policy that
sampled it, the critic's value, and a reward (the sequence's score sits on its
last token). The update needs five pieces, all in ``ppo_objectives.functional``:

1. ``response_logp_positions``: which logits predict which response token;
2. ``masked_gae``: advantages and returns, skipping padding;
3. ``ppo_policy_loss``: the clipped surrogate objective;
4. ``reference_kl_penalty``: how far the policy drifted from the frozen reference;
5. ``clipped_value_loss``: the critic's regression loss.

Each prints below with what to look at. The numbers are the ones MiniMind's
``trainer/train_ppo.py`` would compute on the same tensors.
"""

import torch

from ppo_objectives.functional import (
    clipped_value_loss,
    masked_gae,
    ppo_policy_loss,
    reference_kl_penalty,
    response_log_probs,
    response_logp_positions,
)

torch.manual_seed(0)
torch.set_printoptions(precision=3, sci_mode=False)


def show(title, **tensors):
    print(f"\n== {title}")
    for name, t in tensors.items():
        print(f"{name} =\n{t}" if t.dim() else f"{name} = {t.item():.4f}")


# --------------------------------------------------------------------------- #
# A toy batch: 2 sequences, vocabulary of 6 tokens.
#   row 0: prompt [3, 4]     response [1, 2, 5]      (5 = EOS, 3 tokens)
#   row 1: prompt [2]        response [4, 5] + pad   (2 tokens, then padding)
# Sequences are laid out prompt-then-response; row 1 is right-padded with 0.
# --------------------------------------------------------------------------- #
V, R = 6, 3
input_ids = torch.tensor([[3, 4, 1, 2, 5], [2, 4, 5, 0, 0]])
prompt_lens = torch.tensor([2, 1])
mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)  # True = a real response token

# 1. Positions: logits at index p predict the token at p + 1.
positions = response_logp_positions(prompt_lens, R)
show("1. response_logp_positions: logits index for each response token", positions=positions)
print("row 0: response starts at index 2, predicted by the logits at index 1 -> [1, 2, 3]")

# A random policy, a slightly different reference, and the log-probs of the sampled tokens.
logits = torch.randn(2, 5, V)
ref_logits = logits + 0.3 * torch.randn(2, 5, V)
old_logp = response_log_probs(logits, input_ids, prompt_lens, R)
ref_logp = response_log_probs(ref_logits, input_ids, prompt_lens, R)
show("log-probs of the response tokens (old policy, reference)", old_logp=old_logp, ref_logp=ref_logp)

# 2. GAE: the reward (1 for row 0, -1 for row 1) sits on the last valid token.
values = torch.tensor([[0.2, 0.4, 0.6], [0.1, -0.3, 99.0]])  # 99 at padding: never read
token_rewards = torch.zeros(2, R)
token_rewards[0, 2], token_rewards[1, 1] = 1.0, -1.0
adv_raw, returns = masked_gae(token_rewards, values, mask, gamma=1.0, lmbda=0.95, average_gae=False)
advantages, _ = masked_gae(token_rewards, values, mask, gamma=1.0, lmbda=0.95)
show("2. masked_gae (gamma=1, lmbda=0.95)", raw_advantages=adv_raw, returns=returns, whitened=advantages)
print("look: row 0's last token has A = 1 - 0.6 = 0.4; padding stays 0 even though its value was 99;")
print("      returns = raw advantages + values; whitened advantages have mean 0, variance 1 over the 5 tokens")

# 3. Policy loss: pretend one optimisation step moved the log-probs.
new_logp = old_logp + torch.tensor([[0.3, -0.1, 0.05], [0.0, -0.4, 0.0]])
loss_pi, stats = ppo_policy_loss(new_logp, old_logp, advantages, mask, clip_epsilon=0.2, return_stats=True)
show("3. ppo_policy_loss (clip 0.2)", ratio=torch.exp(new_logp - old_logp) * mask, loss=loss_pi)
print(f"clip_fraction = {stats['clip_fraction']:.3f} (ratios outside [0.8, 1.2]: e^0.3 = 1.35 and e^-0.4 = 0.67)")
print(f"kl_approx = {stats['kl_approx']:.4f} (MiniMind stops the PPO epochs when this exceeds 0.25)")

# 4. KL to the reference (k3 estimator: exp(d) - d - 1 with d = ref - policy, always >= 0).
kl = reference_kl_penalty(new_logp, ref_logp, mask)
show("4. reference_kl_penalty (k3)", kl_ref=kl)
print("MiniMind's actor loss is  policy_loss + 0.02 * kl_ref")

# 5. Value loss: the critic moved; clipping keeps it within 0.2 of the rollout's values.
new_values = values + torch.tensor([[0.5, 0.1, -0.1], [0.0, 0.3, 0.0]])
loss_v, vstats = clipped_value_loss(new_values, values, returns, mask, clip_value=0.2, return_stats=True)
show("5. clipped_value_loss (clip 0.2)", loss=loss_v)
print(f"value_clip_fraction = {vstats['value_clip_fraction']:.3f} (tokens whose clipped branch is the larger)")

total = loss_pi + 0.02 * kl + 0.5 * loss_v
print(f"\nMiniMind's total loss = policy + 0.02 * kl_ref + 0.5 * value = {total.item():.4f}")

"""Tutorial 2: MaskedGAE, advantages as a TorchRL value estimator, in both data layouts.

Run it:  python tutorials/02_masked_gae.py

``MaskedGAE`` reads TensorDict entries, calls ``functional.masked_gae`` (or its
segmented variant for collector data) and writes ``advantage`` and
``value_target``. Three things to see:

1. the LLM layout ``[B, R]``: one response per row, padding skipped, the end of
   each response is terminal;
2. the collector layout ``[N, T]``: several episodes back to back in one row,
   restarting at ``done``, bootstrapping truncated ones from
   ``("next", "state_value")``; on unmasked data this is TorchRL's own GAE;
3. a mask inside a collector row (e.g. tool or prompt tokens): those steps are
   skipped, as if they were not there;
4. what the critic's levers change in the advantages of one batch: lambda, a lambda of
   the policy's own (decoupled, length-adaptive), a step per turn instead of per token,
   and a critic that has trained more.
"""

import torch
from tensordict import TensorDict
from torchrl.objectives.value import GAE

from ppo_objectives import MaskedGAE
from ppo_objectives import functional as F

torch.set_printoptions(precision=3, sci_mode=False)

# --------------------------------------------------------------------------- #
# 1. LLM layout: 2 responses, R = 4 tokens; row 1 has 2 tokens and then padding.
#    The sequence score (1.0 and -1.0) sits on each response's last token.
# --------------------------------------------------------------------------- #
llm = TensorDict(
    {
        "state_value": torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.5, -0.2, 99.0, 99.0]]),  # 99 at padding: never read
        "mask": torch.tensor([[True, True, True, True], [True, True, False, False]]),
        ("next", "reward"): torch.tensor([[0.0, 0.0, 0.0, 1.0], [0.0, -1.0, 0.0, 0.0]]),
    },
    batch_size=[2, 4],
)
gae = MaskedGAE(gamma=1.0, lmbda=0.95)  # MiniMind's gamma and lambda
gae(llm)
print("== 1. LLM layout [B, R] (gamma=1, lambda=0.95)")
print("advantage =\n", llm["advantage"])
print("value_target =\n", llm["value_target"])
print("look: row 0's last token has A = 1 - 0.4 = 0.6; row 1's padding stays exactly 0;")
print("      value_target = raw advantage + value (what the critic regresses on)")

whitened = MaskedGAE(gamma=1.0, lmbda=0.95, average_gae=True)(llm.clone())["advantage"]
valid = whitened[llm["mask"]]
print(f"with average_gae=True (MiniMind): mean {valid.mean():.3f}, var {valid.var(unbiased=False):.3f} over the 6 valid tokens")

# --------------------------------------------------------------------------- #
# 2. Collector layout: one row of T = 6 steps holding three episodes:
#    [a a a | b b | c]: a terminated (next value 0), b truncated (bootstrap 2.0),
#    c cut by the end of the batch (bootstrap from its next value 1.0).
# --------------------------------------------------------------------------- #
done = torch.tensor([[False, False, True, False, True, False]])
terminated = torch.tensor([[False, False, True, False, False, False]])
collector = TensorDict(
    {
        "state_value": torch.zeros(1, 6, 1),
        ("next", "state_value"): torch.tensor([[0.0, 0.0, 0.0, 0.0, 2.0, 1.0]]).unsqueeze(-1),
        ("next", "reward"): torch.ones(1, 6, 1),
        ("next", "done"): done.unsqueeze(-1),
        ("next", "terminated"): terminated.unsqueeze(-1),
        ("next", "truncated"): (done & ~terminated).unsqueeze(-1),
    },
    batch_size=[1, 6],
)
ours = MaskedGAE(gamma=1.0, lmbda=1.0)(collector.clone())["advantage"].squeeze(-1)
theirs = GAE(gamma=1.0, lmbda=1.0, value_network=None)(collector.clone())["advantage"].squeeze(-1)
print("\n== 2. collector layout [N, T] (gamma = lambda = 1, reward 1 per step, V = 0)")
print("advantage      =", ours)
print("TorchRL's GAE  =", theirs)
print("look: a counts its remaining rewards [3, 2, 1]; b adds the bootstrap 2 -> [4, 3];")
print("      c is cut by the batch boundary and bootstraps 1 -> [2]; both estimators agree")

# --------------------------------------------------------------------------- #
# 3. A mask inside the row: step 1 is not the agent's (think: a tool's token).
# --------------------------------------------------------------------------- #
masked = collector.clone()
masked["mask"] = torch.tensor([[True, False, True, True, True, True]])
adv = MaskedGAE(gamma=1.0, lmbda=1.0)(masked)["advantage"].squeeze(-1)
print("\n== 3. a masked step inside episode a")
print("advantage =", adv)
print("look: the masked step is 0 and skipped: episode a now has two steps -> [2, 0, 1]")

# --------------------------------------------------------------------------- #
# 4. What the critic's levers change, on one batch. Three responses, R = 8:
#    row 0 is a conversation, a turn of 3 tokens, a tool's reply (2 holes), a turn of 3, reward 1;
#    row 1 a short answer (2 tokens, reward 0); row 2 a long one (8 tokens, reward 1).
#    The critic is young: its values are a rough 0.5 everywhere.
# --------------------------------------------------------------------------- #
mask = torch.tensor([[1, 1, 1, 0, 0, 1, 1, 1], [1, 1, 0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)
reward = torch.zeros(3, 8)
reward[0, 7], reward[2, 7] = 1.0, 1.0
young = torch.tensor([[0.5, 0.4, 0.6, 9.0, 9.0, 0.5, 0.7, 0.6], [0.5, 0.6, 9, 9, 9, 9, 9, 9],
                      [0.5, 0.4, 0.5, 0.6, 0.5, 0.4, 0.6, 0.5]])  # 9 at holes and padding: never read


def advantages(value, **kw):
    td = TensorDict({"state_value": value, "mask": mask, ("next", "reward"): reward}, batch_size=[3, 8])
    return MaskedGAE(gamma=1.0, **kw)(td)["advantage"]


print("\n== 4. the critic's levers on one batch (raw advantages, gamma = 1)")
print("lambda 1 (Monte Carlo: reward-to-go minus value) =\n", advantages(young, lmbda=1.0))
print("lambda 0.5 (leans on the young critic's next value) =\n", advantages(young, lmbda=0.5))
print("look: with lambda < 1 the first tokens see less of the final reward and more of the critic's guesses;")
print("      that is why VAPO trains the critic on lambda 1 (value_target) and the policy on its own lambda")
print("      (MaskedGAE(lmbda=1.0, policy_lmbda=0.95), the job's --policy-lmbda)")
print("length-adaptive lambda per row (length_alpha=0.5): 1 - 1 / (0.5 * length) =",
      F.length_adaptive_lmbda(mask, 0.5))
print("look: the short row gets lambda 0 (its advantage is one TD step), the long one 0.75; the job's --length-alpha")
print("turn level (one step per assistant turn, --gae-level turn) =\n", advantages(young, lmbda=1.0, level="turn"))
print("look: row 0's two turns get one advantage each, 1 - 0.5 and 1 - 0.5 from the value at each turn's first token;")
print("      the tokens inside a turn no longer pay for the critic's token-to-token noise")
# A critic that has trained more (critic warm-up, --critic-steps, a critic of its own) is closer to the returns:
# its advantages are the part of the reward it could not predict, so their spread shrinks.
returns = torch.where(mask, torch.tensor([[1.0], [0.0], [1.0]]).expand(3, 8), torch.tensor(9.0))
for name, value in (("young (about 0.5)", young), ("trained (0.9 of the way to the returns)", 0.1 * young + 0.9 * returns)):
    adv = advantages(value, lmbda=1.0)[mask]
    print(f"critic {name}: advantage spread (std over the valid tokens) {adv.std(unbiased=False):.3f}")
print("look: the same rewards, a better critic, a quieter advantage: what critic warm-up and more critic steps buy,")
print("      where the critic can learn the task faster than the policy changes it")

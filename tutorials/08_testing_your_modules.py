"""Tutorial 8: unit-testing your own modules with ``ppo_objectives.testing``.

Run it:  python tutorials/08_testing_your_modules.py

You wrote a piece that sits between the package's modules: a reward shaper
that runs before ``MaskedGAE``, or a loss of your own. Before it meets a
language model, test it on small seeded batches. The kit gives you:

1. batch factories for the package's layouts (``response_batch``,
   ``full_sequence_batch``, ``collector_batch``) with any mask kind;
2. ``assert_mask_invariant``: garbage and NaN at masked positions (padding,
   prompt or tool tokens) must not change a single valid output, and per-token
   outputs must stay exactly 0 there (the package's convention, docs/design.md);
3. plain-loop references (``reference_gae_tensordict``,
   ``reference_ppo_policy_loss``, ``reference_kl``) and
   ``assert_matches_reference``, whose message says how far off and where;
4. a tiny deterministic actor and critic (``tiny_actor_critic``), so a loss can
   be run and trained without a language model.

Every check below is a plain function call that raises ``AssertionError``; in a
pytest file the same calls are your tests, and the batches come as fixtures
(section 5).
"""

import os

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import TensorDictModuleBase
from torchrl.objectives import LossModule

from ppo_objectives import MaskedGAE
from ppo_objectives import functional as F
from ppo_objectives import testing as T

SMOKE = os.environ.get("PPO_TUTORIAL_SMOKE") == "1"
torch.set_printoptions(precision=3, sci_mode=False)


def first_line(err: Exception, width: int = 150) -> str:
    text = str(err)
    return text if len(text) <= width else text[:width] + " ..."


# --------------------------------------------------------------------------- #
# 1. A batch in the response layout (what trajectories_to_llm_batch produces):
#    [B] rows, [B, P + R] input_ids, [B, R] per-token entries, 0 off the mask.
# --------------------------------------------------------------------------- #
batch = T.response_batch(batch_size=4, response_len=6, prompt_len=3, mask="right", seed=0)
print("== 1. a seeded response batch")
print("keys:", sorted(k if isinstance(k, str) else "/".join(k) for k in batch.keys(True, True)))
print("mask =\n", batch["mask"].int())
print("token_reward =\n", batch["next", "reward"])
print("same seed, same batch:", bool((T.response_batch(batch_size=4, response_len=6, prompt_len=3, seed=0) == batch).all()))

# --------------------------------------------------------------------------- #
# 2. A custom reward shaper: a cost per generated token, then the rewards
#    centred per response. Three versions; the kit tells them apart.
# --------------------------------------------------------------------------- #


class LengthCostV1(TensorDictModuleBase):
    """First try: subtract the cost from the tokens of the mask, centre with a plain mean over the row."""

    in_keys = [("next", "reward"), "mask"]
    out_keys = [("next", "reward")]

    def __init__(self, cost: float = 0.05):
        super().__init__()
        self.cost = cost

    def forward(self, td: TensorDictBase) -> TensorDictBase:
        r, m = td["next", "reward"], td["mask"]
        r = r - self.cost * m  # padding keeps whatever it held
        td["next", "reward"] = r - r.mean(-1, keepdim=True)  # the mean counts the padding too
        return td


class LengthCostV2(LengthCostV1):
    """Second try: a masked mean, but the padding still carries what was there."""

    def forward(self, td: TensorDictBase) -> TensorDictBase:
        r, m = td["next", "reward"], td["mask"]
        r = r - self.cost * m
        td["next", "reward"] = r - F.masked_mean(r, m, dim=-1, keepdim=True)
        return td


class LengthCost(LengthCostV1):
    """Right: only valid tokens are read (torch.where, masked_mean), and the padding is written as 0."""

    def forward(self, td: TensorDictBase) -> TensorDictBase:
        r, m = td["next", "reward"], td["mask"]
        r = torch.where(m, r - self.cost, 0.0)
        centred = r - F.masked_mean(r, m, dim=-1, keepdim=True)
        td["next", "reward"] = torch.where(m, centred, 0.0)
        return td


print("\n== 2. a reward shaper under assert_mask_invariant")
for shaper in (LengthCostV1(), LengthCostV2()):
    try:
        T.assert_mask_invariant(shaper, batch)
    except AssertionError as err:
        print(f"{type(shaper).__name__}: caught ->", first_line(err))
    else:
        raise RuntimeError(f"{type(shaper).__name__} should have failed")
report = T.assert_mask_invariant(LengthCost(), batch)
print("LengthCost passes:", report)

# the same check on every mask kind, empty rows and holes included
for kind in T.MASK_KINDS:
    if kind != "all_valid":  # no masked position: nothing to corrupt
        T.assert_mask_invariant(LengthCost(), T.response_batch(mask=kind, seed=1))
print("LengthCost is mask-invariant on every mask kind:", [k for k in T.MASK_KINDS if k != "all_valid"])

# Its numbers, against a reference you write as a loop over the valid tokens of each row.
shaped = LengthCost(cost=0.05)(batch.clone())["next", "reward"]
want = torch.zeros(batch["mask"].shape, dtype=torch.float64)
for b, (row, valid) in enumerate(zip(batch["next", "reward"].tolist(), batch["mask"].tolist())):
    kept = [x - 0.05 for x, v in zip(row, valid) if v]
    mean = sum(kept) / len(kept)
    for t, v in enumerate(valid):
        want[b, t] = row[t] - 0.05 - mean if v else 0.0
T.assert_matches_reference(shaped, want, name="shaped reward")
print("LengthCost matches the loop reference")

# What a wrong number looks like: the cost applied twice on one token.
wrong = shaped.clone()
wrong[2, 1] -= 0.05
try:
    T.assert_matches_reference(wrong, want, name="shaped reward")
except AssertionError as err:
    print("a wrong number is reported with where it is:\n   ", first_line(err, 400))

# Composed with MaskedGAE: the advantages still equal the plain-loop GAE of the shaped rewards.
composed = MaskedGAE(gamma=1.0, lmbda=0.95, average_gae=True)(LengthCost()(batch.clone()))
adv, target = T.reference_gae_tensordict(composed, gamma=1.0, lmbda=0.95, average_gae=True)
T.assert_matches_reference(composed["advantage"], adv, name="advantage")
T.assert_matches_reference(composed["value_target"], target, name="value_target")
T.assert_mask_invariant(lambda td: MaskedGAE(gamma=1.0, lmbda=0.95)(LengthCost()(td)), batch)
print("LengthCost -> MaskedGAE matches the reference GAE, and the pipeline is mask-invariant")

# --------------------------------------------------------------------------- #
# 3. A custom loss: dual-clip PPO with a per-row length normalisation, as a
#    small LossModule over the functional core. The tiny actor stands in for
#    the language model.
# --------------------------------------------------------------------------- #


class DualClipLoss(LossModule):
    """``loss_objective``: clipped PPO with dual clip, averaged per row then over rows; ``kl_approx``."""

    def __init__(self, actor, clip_epsilon: float = 0.2, dual_clip: float = 3.0):
        super().__init__()
        self.actor = actor
        self.clip_epsilon, self.dual_clip = clip_epsilon, dual_clip

    def forward(self, td: TensorDictBase) -> TensorDict:
        new = self.actor(td.exclude("log_prob", "entropy"))["log_prob"]
        old, adv, m = td["sample_log_prob"], td["advantage"], td["mask"]
        loss, stats = F.ppo_policy_loss(new, old, adv, m, self.clip_epsilon, dual_clip=self.dual_clip,
                                        aggregation="seq-mean-token-mean", return_stats=True)  # fmt: skip
        return TensorDict({"loss_objective": loss, "kl_approx": stats["kl_approx"]})


print("\n== 3. a custom loss")
actor, critic = T.tiny_actor_critic(seed=0)
data = T.response_batch(batch_size=6, response_len=6, mask="mixed", with_advantage=True, seed=2)
with torch.no_grad():  # let the sampling policy differ from the current one, so that clipping happens
    data["sample_log_prob"] = torch.where(data["mask"], actor(data.clone())["log_prob"] + 0.4 * torch.randn(6, 6), 0.0)
loss_fn = DualClipLoss(actor)
out = loss_fn(data)

# the reference is token-mean; seq-mean-token-mean is the mean over non-empty rows of per-row references
with torch.no_grad():
    new_logp = actor(data.clone())["log_prob"]
rows = [b for b in range(6) if data["mask"][b].any()]
want = sum(
    T.reference_ppo_policy_loss(new_logp[b : b + 1], data["sample_log_prob"][b : b + 1], data["advantage"][b : b + 1],
                                data["mask"][b : b + 1], 0.2, dual_clip=3.0)  # fmt: skip
    for b in rows
) / len(rows)
T.assert_matches_reference(out["loss_objective"], want, name="loss_objective")
print(f"loss_objective {out['loss_objective'].item():.4f} = per-row loop reference {want.item():.4f}")
report = T.assert_mask_invariant(loss_fn, data)
print("DualClipLoss passes:", report)


class LeakyLoss(DualClipLoss):
    """A plain mean over every token: the padding joins the average."""

    def forward(self, td: TensorDictBase) -> TensorDict:
        ratio = torch.exp(self.actor(td.exclude("log_prob", "entropy"))["log_prob"] - td["sample_log_prob"])
        return TensorDict({"loss_objective": (-td["advantage"] * ratio).mean()})


try:
    T.assert_mask_invariant(LeakyLoss(actor), data)
except AssertionError as err:
    print("LeakyLoss: caught ->", first_line(err))

# It trains the tiny actor: the surrogate goes down.
optim = torch.optim.Adam(actor.parameters(), lr=0.05)
before = loss_fn(data)["loss_objective"].item()
for _ in range(5 if SMOKE else 50):
    optim.zero_grad()
    loss_fn(data)["loss_objective"].backward()
    optim.step()
after = loss_fn(data)["loss_objective"].item()
assert after < before
print(f"a few Adam steps on the tiny actor: loss_objective {before:.4f} -> {after:.4f}")

# --------------------------------------------------------------------------- #
# 4. The other layouts: full-sequence rows with holes (LLMToTokenBatch) and
#    TorchRL collector rows with done / terminated / truncated flags.
# --------------------------------------------------------------------------- #
print("\n== 4. the other layouts")
full = T.full_sequence_batch(batch_size=3, seq_len=10, seed=3)
print("full-sequence mask (holes are prompt / user / tool tokens) =\n", full["mask"].int())
print(T.assert_mask_invariant(MaskedGAE(gamma=1.0, lmbda=0.95, average_gae=True), full))
rows = T.collector_batch(num_envs=2, steps=8, mask="holes", seed=4)
adv, _ = T.reference_gae_tensordict(rows, gamma=0.99, lmbda=0.95)
T.assert_matches_reference(MaskedGAE(gamma=0.99, lmbda=0.95)(rows.clone())["advantage"], adv, name="advantage")
print("collector rows: MaskedGAE matches the loop over trajectories (done flags, bootstraps, holes)")

# --------------------------------------------------------------------------- #
# 5. In pytest: the fixtures come with the package. Installing it installs a
#    pytest plugin (the pytest11 entry point "ppo_objectives") that pytest loads
#    by itself: no import and nothing in conftest.py; it imports torch only when
#    a test asks for a fixture. `pytest -p no:ppo_objectives` switches it off.
# --------------------------------------------------------------------------- #
print("\n== 5. the same checks as a pytest file (fixtures from the ppo_objectives plugin, no conftest.py)")
print('''
    def test_length_cost_ignores_padding(ppo_masked_response_batch, ppo_testing):   # runs once per mask kind
        ppo_testing.assert_mask_invariant(LengthCost(), ppo_masked_response_batch)

    def test_dual_clip_loss_runs(ppo_response_batch, ppo_tiny_actor_critic):
        actor, _ = ppo_tiny_actor_critic
        assert DualClipLoss(actor)(ppo_response_batch)["loss_objective"].isfinite()
''')

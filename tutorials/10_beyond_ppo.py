"""Tutorial 10: PPO with a critic next to GRPO, Dr. GRPO, RLOO and REINFORCE++, on one task and one layout.

The five methods differ in one place: where the per-token advantage comes from. Everything else is
the same pipeline (``TokenLMEnv`` -> TorchRL collector -> ``ToLLMBatch`` -> ``KLPenaltyTransform`` ->
advantage -> ``TokenPPOLoss``'s clipped objective):

- **PPO** (``MaskedGAE``): a critic predicts the value of every prefix; GAE turns the critic's
  values and the rewards into per-token advantages, whitened over the batch.
- **GRPO** (``GroupAdvantage("grpo")``): no critic; G responses per prompt, each response's
  advantage is its score minus the group mean, divided by the group std, on every token. KL to the
  reference in the loss (k3, 0.04), per-sequence token means.
- **Dr. GRPO** (``"dr_grpo"``): the group mean only (no std), summed token losses over a constant
  (no length bias), no KL.
- **RLOO** (``"rloo"``): each response against the mean of the *other* responses of its prompt.
- **REINFORCE++** (``ReinforcePlusPlus``): the discounted return of every token (KL penalty
  included), whitened over the batch; no group.

The groups come from the data: ``TokenLMEnv(group_size=G)`` gives each prompt to G rows and writes a
``group`` id that ``ToLLMBatch`` keeps per response and ``GroupAdvantage`` reads; in the job,
``--advantage grpo`` sets ``--group-size 4`` and the method's aggregation and KL.

Run it: ``python tutorials/10_beyond_ppo.py`` (5 methods x 3 seeds x 150 iterations of the toy reverse
task: 15 training runs, 21 minutes on 2 CPU cores shared with the test suite; ``PPO_TUTORIAL_ITERATIONS=300`` runs the
job's full length, ``PPO_TUTORIAL_SMOKE=1`` runs 2 iterations of one seed). It draws the reward
curves, the median over seeds and the min-max band, into ``beyond_ppo.png`` and prints each
method's last-10 reward.

What it printed on a 2-core AMD EPYC (torch 2.13.0, CPU), last-10 reward of seeds 0, 1, 2 at
iteration 150:

- PPO (GAE + critic): 0.351, 0.970, 0.582
- GRPO: 0.398, 0.602, 0.429
- Dr. GRPO: 0.551, 0.341, 0.525
- RLOO: 0.327, 0.450, 0.414
- REINFORCE++: 0.725, 0.745, 0.459

Every method sits on the reward-0.32 plateau of a wrong answer for the first 60 to 100 iterations
and is still rising at 150, so these are snapshots of the climb, not final levels (the PPO job's 16
seeds pass 0.9 between iterations 109 and 261; ``benchmarks/learning.png``). In the plot the
medians of PPO and REINFORCE++ leave the plateau first, around iterations 80 to 90, and the
group methods later. Read it as one run of three seeds: the spread between seeds of one method
(PPO: 0.35 to 0.97) is larger than the gaps between the methods' medians. One thing differs by
design, not by method: with ``--group-size 4`` a group method's 64 rows are 16 prompts answered 4
times each, where PPO and REINFORCE++ see 64 prompts.
"""

import os
import statistics
import tempfile

import torch

from ppo_objectives import GroupAdvantage
from ppo_objectives import ReinforcePlusPlus
from ppo_objectives import TokenPPOLoss
from ppo_objectives import testing as K
from ppo_objectives import train as T

SMOKE = os.environ.get("PPO_TUTORIAL_SMOKE") == "1"
SEEDS = [0] if SMOKE else [0, 1, 2]
ITERATIONS = 2 if SMOKE else int(os.environ.get("PPO_TUTORIAL_ITERATIONS", "150"))
METHODS = {"PPO (GAE + critic)": "gae", "GRPO": "grpo", "Dr. GRPO": "dr_grpo", "RLOO": "rloo",
           "REINFORCE++": "reinforce++"}

# ---------------------------------------------------------------- 1. one batch, five advantages
# A response batch of the kit: 8 responses, 2 prompts x 4 samples (group ids 0 and 1), scores in [0, 1].
td = K.response_batch(batch_size=8, response_len=4, seed=0)
td.set("score", torch.tensor([1.0, 0.0, 0.5, 0.5, 0.0, 0.0, 0.0, 1.0]))
td.set("group", torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]))
for kind in ("grpo", "dr_grpo", "rloo"):
    adv = GroupAdvantage(kind)(td.clone())["advantage"][:, 0]  # one number per response, on each valid token
    print(f"{kind:8s} first-token advantages: {[round(a, 2) for a in adv.tolist()]}")
rpp = ReinforcePlusPlus(gamma=1.0)(td.clone())["advantage"]
print(f"reinforce++ per-token advantages of response 0: {[round(a, 2) for a in rpp[0].tolist()]}")
# a critic-free estimator goes with a loss without a critic (a critic would be regressed onto advantages)
actor, _ = K.tiny_actor_critic()
TokenPPOLoss(actor, None, aggregation="token-sum-norm", kl_to_ref_coeff=0.0).make_value_estimator(GroupAdvantage("dr_grpo"))

# ---------------------------------------------------------------- 2. the five methods on the toy task
curves: dict[str, list[list[float]]] = {}
with tempfile.TemporaryDirectory() as tmp:
    for name, mode in METHODS.items():
        curves[name] = []
        for seed in SEEDS:
            cfg = T.TrainConfig(advantage=mode, seed=seed, iterations=ITERATIONS, out=f"{tmp}/{mode}-{seed}",
                                no_progress=True, no_plot=True, save_every=ITERATIONS,
                                **(dict(preset="pico", num_envs=8, warmup_steps=5) if SMOKE else {}))
            rows = T.train(cfg)
            curves[name].append([r["reward"] for r in rows])
        last = [statistics.fmean(c[-10:]) for c in curves[name]]
        print(f"{name:20s} last-10 reward over seeds: " + ", ".join(f"{x:.3f}" for x in last))

# ---------------------------------------------------------------- 3. the curves, side by side
import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

fig, ax = plt.subplots(figsize=(9, 5))
for name, runs in curves.items():
    its = range(1, len(runs[0]) + 1)
    by_it = list(zip(*runs))
    ax.plot(its, [statistics.median(v) for v in by_it], label=name, lw=1.5)
    ax.fill_between(its, [min(v) for v in by_it], [max(v) for v in by_it], alpha=0.15)
ax.set_xlabel("iteration")
ax.set_ylabel("mean reward of the rollout")
ax.set_ylim(0, 1.02)
ax.set_title(f"reverse 3 digits: median and min-max over {len(SEEDS)} seeds")
ax.grid(alpha=0.3)
ax.legend()
fig.tight_layout()
fig.savefig("beyond_ppo.png", dpi=80)
print("curves in beyond_ppo.png")

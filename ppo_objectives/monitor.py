"""Watching a PPO run: a collapse guard over the logged metrics, and the plot that shows a failing run.

A token-level PPO run on a language model fails in a few recognisable ways, each
visible in one logged metric of :mod:`ppo_objectives.train` (one row per iteration):

=============== ================================================================== =====================
flag            what it means                                                      metric, default limit
=============== ================================================================== =====================
``min_len``     responses stuck at their shortest (EOS first)                      ``response_len <= min_response_len + 0.5``
``zero_reward`` the task score is gone                                             ``reward < 0.05``
``entropy``     the policy became deterministic without solving the task           ``entropy < 0.05 and exact < 0.5``
``kl_spike``    one step jumped far past the trust region                          ``kl_approx_max > 1.0``
=============== ================================================================== =====================

The first three are *bad iterations*; ``patience`` bad iterations in a row make a
**collapse** (the run is not learning any more and will not recover by itself in
time). A ``kl_spike`` is reported on its own: one optimizer step took the minibatch's
mean approx-KL to the rollout policy past 1 nat (four times the default limit of
0.25). With the trust-region rollback of :func:`ppo_objectives.train.ppo_update`
that step was undone, so it is a warning about the optimizer (the learning rate
is too large for the model), not yet a failure; without the rollback it is how a
collapse starts. The per-token maximum ``kl_token_max`` is shown with it but
raises no flag: it is routinely large on tokens that were sampled with a small
probability and pushed lower, which moves almost no probability mass.

:class:`CollapseGuard` turns a metrics row into these flags, keeps the streak and
writes one line per event (a streak starting, a collapse, a recovery);
:func:`plot_metrics` draws every signal on its own axis with the flagged
iterations shaded, so a collapse is the first thing one sees.

Example:
    >>> guard = CollapseGuard(patience=2)
    >>> guard.update(dict(iteration=1, reward=0.3, exact=0.0, response_len=4.0, entropy=1.7, kl_approx_max=0.1))
    []
    >>> guard.update(dict(iteration=2, reward=0.0, exact=0.0, response_len=1.0, entropy=0.01, kl_approx_max=0.0))
    ['iteration 2: min_len (response_len 1.00), zero_reward (reward 0.000), entropy (entropy 0.010 at exact 0.00)']
    >>> guard.update(dict(iteration=3, reward=0.0, exact=0.0, response_len=1.0, entropy=0.01, kl_approx_max=0.0))
    ['iteration 3: COLLAPSE: 2 bad iterations in a row (min_len, zero_reward, entropy); the run is not learning']
    >>> guard.collapsed, guard.collapse_iterations, guard.collapses
    (True, 1, 1)
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from ppo_objectives import _validate

__all__ = ["FLAGS", "CollapseGuard", "plot_metrics"]

#: The flags :class:`CollapseGuard` raises, in the order they are reported.
FLAGS = ("min_len", "zero_reward", "entropy", "kl_spike")
_BAD = ("min_len", "zero_reward", "entropy")  # the flags that make an iteration bad


def _number(name: str, value, *, low: float = 0.0) -> float:
    if not _validate.is_real(value, low=low):
        raise ValueError(f"CollapseGuard {name}={value!r} must be a finite number >= {low}")
    return float(value)


@dataclass
class CollapseGuard:
    """Flags the iterations of a PPO run that look like a collapse, and counts collapses.

    Args:
        min_response_len: the shortest response the task allows (1: EOS first).
        reward_floor: a mean task score below it counts as "no reward".
        entropy_floor: per-token entropy (nats) below which the policy is deterministic.
        solved_exact: an exact-match rate at which a deterministic policy is fine (converged).
        kl_spike: minibatch mean approx-KL (``kl_approx_max``, nats) that counts as a spike.
        patience: bad iterations in a row that make a collapse (an int >= 1).

    Missing metrics (``nan`` or absent) raise no flag.
    """

    min_response_len: float = 1.0
    reward_floor: float = 0.05
    entropy_floor: float = 0.05
    solved_exact: float = 0.5
    kl_spike: float = 1.0
    patience: int = 5
    streak: int = field(default=0, init=False)  # bad iterations in a row, up to the last update
    collapses: int = field(default=0, init=False)  # collapses declared so far
    collapse_iterations: int = field(default=0, init=False)  # iterations spent collapsed
    spikes: int = field(default=0, init=False)  # iterations with a kl_spike flag

    def __post_init__(self):
        for name in ("min_response_len", "reward_floor", "entropy_floor", "solved_exact", "kl_spike"):
            setattr(self, name, _number(name, getattr(self, name)))
        _validate.check_int("patience", self.patience, low=1, where="CollapseGuard ")

    @property
    def collapsed(self) -> bool:
        """True while the current streak of bad iterations is at least ``patience`` long."""
        return self.streak >= self.patience

    def flags(self, row: dict) -> dict[str, str]:
        """The flags a metrics row raises, each with the numbers that raised it."""
        g = lambda k: float(row.get(k, math.nan))  # noqa: E731 - nan compares False: no flag
        out = {}
        if g("response_len") <= self.min_response_len + 0.5:
            out["min_len"] = f"response_len {g('response_len'):.2f}"
        if g("reward") < self.reward_floor:
            out["zero_reward"] = f"reward {g('reward'):.3f}"
        if g("entropy") < self.entropy_floor and not g("exact") >= self.solved_exact:
            out["entropy"] = f"entropy {g('entropy'):.3f} at exact {g('exact'):.2f}"
        if g("kl_approx_max") > self.kl_spike:
            undone = ", step pulled back" if g("rolled_back") > 0 else ""
            out["kl_spike"] = (f"kl_approx_max {g('kl_approx_max'):.2f} nats, largest token "
                               f"{g('kl_token_max'):.2f}{undone}")  # fmt: skip
        return out

    def update(self, row: dict) -> list[str]:
        """Flag ``row`` (one iteration), write ``warn_*`` / ``collapse`` columns into it, and
        return the warning lines to show (empty on a quiet iteration).

        A streak of bad iterations is reported when it starts, again when it becomes a
        collapse, and when the run recovers; spikes are reported every time.
        """
        flags = self.flags(row)
        bad = [f for f in _BAD if f in flags]
        was_collapsed = self.collapsed
        self.streak = self.streak + 1 if bad else 0
        for f in FLAGS:
            row[f"warn_{f}"] = int(f in flags)
        row["collapse"] = int(self.collapsed)
        it = row.get("iteration", "?")
        it = int(it) if isinstance(it, float) and it.is_integer() else it
        lines = []
        if self.collapsed:
            self.collapse_iterations += 1
            if not was_collapsed:
                self.collapses += 1
                lines.append(
                    f"iteration {it}: COLLAPSE: {self.streak} bad iterations in a row ({', '.join(bad)}); "
                    "the run is not learning"
                )
        elif bad and self.streak == 1:
            lines.append(f"iteration {it}: " + ", ".join(f"{f} ({flags[f]})" for f in bad))
        if was_collapsed and not bad:
            lines.append(f"iteration {it}: recovered from the collapse")
        if "kl_spike" in flags:
            self.spikes += 1
            lines.append(f"iteration {it}: kl_spike ({flags['kl_spike']})")
        return lines

    def state_dict(self) -> dict:
        return dict(streak=self.streak, collapses=self.collapses, collapse_iterations=self.collapse_iterations,
                    spikes=self.spikes)  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        for k in ("streak", "collapses", "collapse_iterations", "spikes"):
            setattr(self, k, int(state[k]))

    def summary(self) -> str:
        """One line for the end of a run."""
        if not self.collapses and not self.spikes:
            return "no collapse, no KL spike"
        return (f"{self.collapses} collapse(s) ({self.collapse_iterations} iterations collapsed), "
                f"{self.spikes} iteration(s) with a per-token KL spike")  # fmt: skip


# --------------------------------------------------------------------------- #
# The plot
# --------------------------------------------------------------------------- #

# (title, [(metric, label)], y scale): each panel on its own axis, so no signal's scale hides another's
_PANELS = (
    ("task score", [("reward", "reward"), ("exact", "exact match")], "linear"),
    ("response length (tokens)", [("response_len", "response_len")], "linear"),
    ("per-token KL (nats)", [("kl_ref", "kl_ref (to reference, k1 mean)"), ("kl_approx", "kl_approx (k2 mean)"),
                             ("kl_approx_max", "kl_approx, largest minibatch"),
                             ("kl_token_max", "kl_token_max (largest token)")], "symlog"),  # fmt: skip
    ("entropy (nats/token)", [("entropy", "entropy")], "linear"),
    ("clip fraction", [("clip_fraction", "clip_fraction"), ("value_clip_fraction", "value_clip_fraction")],
     "linear"),
    ("explained variance", [("explained_variance", "explained_variance")], "symlog"),
    ("losses", [("loss_objective", "loss_objective"), ("loss_critic", "loss_critic")], "linear"),
    ("optimizer", [("updates", "steps kept"), ("rolled_back", "crossing step pulled back (0/1)"),
                   ("skipped_steps", "steps skipped")], "linear"),
)


def plot_metrics(rows: list[dict], png_path: str | Path, *, title: str | None = None) -> None:
    """Draw a run's metrics rows into ``png_path`` (written atomically).

    One axis per signal group (the table in the module docstring): task score,
    response length, per-token KL (mean and max, symlog scale so a spike of 10 nats
    and a mean of 0.01 are both readable), entropy, clip fractions, explained
    variance (symlog: -4000 does not flatten the curve), losses, optimizer steps.
    Iterations flagged by :class:`CollapseGuard` (``warn_*`` columns) are shaded
    orange, collapsed ones (``collapse``) red, on every panel.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    png_path = Path(png_path)
    it = [r.get("iteration", i + 1) for i, r in enumerate(rows)]
    fig, axes = plt.subplots(4, 2, figsize=(12, 12), sharex=True)
    for ax, (name, series, scale) in zip(axes.flat, _PANELS):
        drawn = 0
        for key, label in series:
            ys = [r.get(key, math.nan) for r in rows]
            if any(not math.isnan(y) for y in ys):
                ax.plot(it, ys, label=label, lw=1.2)
                drawn += 1
        for x, r in zip(it, rows):
            if r.get("collapse", 0):
                ax.axvspan(x - 0.5, x + 0.5, color="red", alpha=0.25, lw=0)
            elif any(r.get(f"warn_{f}", 0) for f in FLAGS):
                ax.axvspan(x - 0.5, x + 0.5, color="orange", alpha=0.25, lw=0)
        if scale == "symlog":
            ax.set_yscale("symlog", linthresh=1e-2)
        ax.set_title(name)
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(fontsize=8, loc="best")
    for ax in axes[-1]:
        ax.set_xlabel("iteration")
    n_collapsed = sum(int(r.get("collapse", 0)) for r in rows)
    n_flagged = sum(any(r.get(f"warn_{f}", 0) for f in FLAGS) for r in rows)
    head = title or "PPO run"
    fig.suptitle(f"{head}: {len(rows)} iterations; {n_collapsed} collapsed (red), {n_flagged} flagged (orange)")
    fig.tight_layout()
    tmp = png_path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=80)
    plt.close(fig)
    os.replace(tmp, png_path)

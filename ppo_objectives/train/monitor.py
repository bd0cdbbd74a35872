"""Watching a PPO run: a collapse guard over the logged metrics, the plot that shows a failing run, and the
first iteration's check that warms a cold critic up where rewards are rare (:class:`CriticWarmup`).

A token-level PPO run on a language model fails in a few recognisable ways, each
visible in one logged metric of :mod:`ppo_objectives.train` (one row per iteration):

=============== ================================================================== =====================
flag            what it means                                                      metric, default limit
=============== ================================================================== =====================
``min_len``     responses stuck at their shortest (EOS first)                      ``response_len <= min_response_len + 0.5``
``zero_reward`` the task score is gone (with the row's ``env_turns_cut`` when > 0: ``reward < 0.05``
                turns the token budget cut, the likely cause)
``entropy``     the policy became deterministic without solving the task           ``entropy < 0.05 and exact < 0.5``
``kl_spike``    one step jumped far past the trust region                          ``kl_approx_max > 1.0``
``stall``       no progress: neither the reward (mean of the last iterations) nor  ``stall_patience``
                the held-out greedy accuracy improved by ``stall_delta`` for       iterations without
                ``stall_patience`` iterations, below a solved level                progress
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

A **stall** is the quiet failure: a run whose reward sits at its starting level (a
seed that never takes off) raises none of the collapse flags, and only a flat curve
shows it. ``stall`` is raised on every iteration once ``stall_patience`` iterations
have passed since the last progress (a new best of the reward's running mean over
the last ``max(1, min(10, stall_patience // 4))`` iterations, or of ``eval_greedy``, by
more than ``stall_delta``), unless the run is solved (that running mean of ``reward`` or
of ``exact`` is at least ``solved_stall``). Like a spike it is a warning, not a bad
iteration: it does not count towards a collapse.

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

__all__ = ["FLAGS", "CollapseGuard", "CriticWarmup", "most_conversations_cut", "plot_metrics"]

#: The flags :class:`CollapseGuard` raises, in the order they are reported.
FLAGS = ("min_len", "zero_reward", "entropy", "kl_spike", "stall")
_BAD = ("min_len", "zero_reward", "entropy")  # the flags that make an iteration bad


def most_conversations_cut(row: dict) -> bool:
    """Whether the token budget cut most conversations of an iteration of a multi-turn task: its row's
    ``env_turns_cut`` (environment turns that did not fit) exceeds half its ``episodes``. A row without those
    columns (a single-turn task) is never cut.

    Example:
        >>> most_conversations_cut({"env_turns_cut": 24.0, "episodes": 42.0})
        True
        >>> most_conversations_cut({"env_turns_cut": 3.0, "episodes": 42.0}), most_conversations_cut({"episodes": 42.0})
        (False, False)
    """
    return 2 * float(row.get("env_turns_cut", 0.0)) > float(row.get("episodes", math.inf))


@dataclass
class CriticWarmup:
    """The iterations, from the first, that train the critic alone (the actor keeps the policy of its rollouts).

    ``fixed`` of them on every run (``--critic-warmup``). Where none are fixed, ``if_rare`` of them when the first
    iteration's rewards are rare (``--rare-reward-warmup``, on by default on multi-turn tasks): its mean ``reward``
    below ``floor``, with at most half its conversations cut by the token budget (else the budget is the cause, and
    the job's other warnings name it). A cold critic's first policy update learns from the few rewarded episodes
    alone: on ``chat-calc-sum`` that update settled 3 of 6 seeds of the pretrained recipe on a form that is never
    right (an answer after the first tool call), where two critic-only iterations first learned on 4 of 4
    (``docs/critic.md``). Single-turn tasks start as poorly (0 to 0.06 on ``chat-add2``) without that collapse, so
    their default is 0.

    The decision is made once, after the first rollout, and checkpointed (``iterations``).

    Example:
        >>> w = CriticWarmup(if_rare=2)
        >>> w.decide(dict(iteration=1, reward=0.026, episodes=76.0, env_turns_cut=4.0))[:61]
        'iteration 1: reward 0.026 is below 0.05 and the critic starts'
        >>> [w.critic_only(it) for it in range(3)]
        [True, True, False]
        >>> CriticWarmup(if_rare=2).decide(dict(iteration=1, reward=0.3, episodes=64.0)) is None
        True
    """

    fixed: int = 0
    if_rare: int = 0
    floor: float = 0.05
    iterations: int = field(init=False)

    def __post_init__(self):
        for name in ("fixed", "if_rare"):
            _validate.check_int(name, getattr(self, name), low=0, where="CriticWarmup ")
        self.floor = _number("floor", self.floor, where="CriticWarmup")
        self.iterations = self.fixed

    def critic_only(self, it: int) -> bool:
        """Whether iteration ``it`` (counted from 0) trains the critic alone."""
        return it < self.iterations

    def decide(self, row: dict) -> str | None:
        """After the first rollout (``row``: its metrics, ``iteration`` 1), start the warm-up if its rewards are
        rare; returns the line that says so, else None (on any other row too)."""
        reward = float(row.get("reward", math.nan))
        if row.get("iteration") != 1 or self.fixed or not self.if_rare or most_conversations_cut(row):
            return None
        if not reward < self.floor:
            return None
        self.iterations = self.if_rare
        span = "iteration 1 trains" if self.if_rare == 1 else f"iterations 1-{self.if_rare} train"
        return (f"iteration 1: reward {reward:.3f} is below {self.floor:g} and the critic starts cold: {span} "
                f"the critic alone before the first policy update (--rare-reward-warmup {self.if_rare}; 0 turns it "
                "off; docs/critic.md)")

    def state_dict(self) -> dict:
        return dict(iterations=self.iterations)

    def load_state_dict(self, state: dict) -> None:
        self.iterations = int(state["iterations"])


def _number(name: str, value, *, low: float = 0.0, where: str = "CollapseGuard") -> float:
    if not _validate.is_real(value, low=low):
        raise ValueError(f"{where} {name}={value!r} must be a finite number >= {low}")
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
        stall_patience: iterations without progress that make a stall (an int >= 1).
        stall_delta: the improvement that counts as progress.
        solved_stall: a running mean of ``reward`` or ``exact`` at which a flat run is solved, not stalled.

    Missing metrics (``nan`` or absent) raise no flag.
    """

    min_response_len: float = 1.0
    reward_floor: float = 0.05
    entropy_floor: float = 0.05
    solved_exact: float = 0.5
    kl_spike: float = 1.0
    patience: int = 5
    stall_patience: int = 100
    stall_delta: float = 0.01
    solved_stall: float = 0.95
    streak: int = field(default=0, init=False)  # bad iterations in a row, up to the last update
    recent: list = field(default_factory=list, init=False)  # (reward, exact) of the last iterations
    best: float = field(default=-math.inf, init=False)  # best running mean of the reward so far
    best_eval: float = field(default=-math.inf, init=False)  # best held-out greedy accuracy so far
    since_progress: int = field(default=0, init=False)  # iterations since the last progress
    stalls: int = field(default=0, init=False)  # stalls declared so far
    collapses: int = field(default=0, init=False)  # collapses declared so far
    collapse_iterations: int = field(default=0, init=False)  # iterations spent collapsed
    spikes: int = field(default=0, init=False)  # iterations with a kl_spike flag

    def __post_init__(self):
        for name in ("min_response_len", "reward_floor", "entropy_floor", "solved_exact", "kl_spike", "stall_delta"):
            setattr(self, name, _number(name, getattr(self, name)))
        self.solved_stall = _number("solved_stall", self.solved_stall, low=-math.inf)
        _validate.check_int("patience", self.patience, low=1, where="CollapseGuard ")
        _validate.check_int("stall_patience", self.stall_patience, low=1, where="CollapseGuard ")

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
            cut = g("env_turns_cut")  # a multi-turn task whose budget cut the conversations: the likely cause
            cause = (f"; {cut:g} environment turns cut by the token budget (env_turns_cut): raise --max-new-tokens"
                     if cut > 0 else "")
            out["zero_reward"] = f"reward {g('reward'):.3f}{cause}"
        if g("entropy") < self.entropy_floor and not g("exact") >= self.solved_exact:
            out["entropy"] = f"entropy {g('entropy'):.3f} at exact {g('exact'):.2f}"
        if g("kl_approx_max") > self.kl_spike:
            undone = ", step pulled back" if g("rolled_back") > 0 else ""
            out["kl_spike"] = (f"kl_approx_max {g('kl_approx_max'):.2f} nats, largest token "
                               f"{g('kl_token_max'):.2f}{undone}")  # fmt: skip
        if self.since_progress >= self.stall_patience:
            held_out = f", held-out greedy best {self.best_eval:.3f}" if math.isfinite(self.best_eval) else ""
            out["stall"] = (f"no progress for {self.since_progress} iterations (reward running mean best "
                            f"{self.best:.3f}{held_out})")
        return out

    def _track_progress(self, row: dict) -> None:
        """Update the running mean of the reward, the best held-out accuracy and the iterations since progress."""
        reward, exact, held_out = (float(row.get(k, math.nan)) for k in ("reward", "exact", "eval_greedy"))
        progress = False
        if not math.isnan(reward):
            window = max(1, min(10, self.stall_patience // 4))
            self.recent = (self.recent + [(reward, exact)])[-window:]
            mean = sum(r for r, _ in self.recent) / len(self.recent)
            exact_mean = sum(e for _, e in self.recent) / len(self.recent)
            solved = mean >= self.solved_stall or exact_mean >= self.solved_stall
            progress = solved or mean > self.best + self.stall_delta
            self.best = max(self.best, mean) if progress or self.best == -math.inf else self.best
        if not math.isnan(held_out) and held_out > self.best_eval + self.stall_delta:
            progress, self.best_eval = True, held_out
        self.since_progress = 0 if progress else self.since_progress + 1

    def update(self, row: dict) -> list[str]:
        """Flag ``row`` (one iteration), write ``warn_*`` / ``collapse`` columns into it, and
        return the warning lines to show (empty on a quiet iteration).

        A streak of bad iterations is reported when it starts, again when it becomes a
        collapse, and when the run recovers; spikes are reported every time.
        """
        was_stalled = self.since_progress >= self.stall_patience
        self._track_progress(row)
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
        if "stall" in flags and not was_stalled:
            self.stalls += 1
            lines.append(f"iteration {it}: STALL: {flags['stall']}; the run is not learning")
        elif was_stalled and "stall" not in flags:
            lines.append(f"iteration {it}: progress again after a stall")
        return lines

    def state_dict(self) -> dict:
        return dict(streak=self.streak, collapses=self.collapses, collapse_iterations=self.collapse_iterations,
                    spikes=self.spikes, recent=[list(r) for r in self.recent], best=self.best,
                    best_eval=self.best_eval, since_progress=self.since_progress, stalls=self.stalls)  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        for k in ("streak", "collapses", "collapse_iterations", "spikes"):
            setattr(self, k, int(state[k]))
        if "since_progress" in state:  # the stall tracker (checkpoints of this version)
            self.recent = [tuple(r) for r in state["recent"]]
            self.best, self.best_eval = float(state["best"]), float(state["best_eval"])
            self.since_progress, self.stalls = int(state["since_progress"]), int(state["stalls"])

    def summary(self) -> str:
        """One line for the end of a run."""
        if not self.collapses and not self.spikes and not self.stalls:
            return "no collapse, no KL spike, no stall"
        return (f"{self.collapses} collapse(s) ({self.collapse_iterations} iterations collapsed), "
                f"{self.spikes} iteration(s) with a per-token KL spike, {self.stalls} stall(s)")  # fmt: skip


# --------------------------------------------------------------------------- #
# The plot
# --------------------------------------------------------------------------- #

# (title, [(metric, label)], y scale): each panel on its own axis, so no signal's scale hides another's
_PANELS = (
    ("task score", [("reward", "reward"), ("exact", "exact match"), ("eval_greedy", "held-out greedy"),
                    ("eval_sampled", "held-out sampled")], "linear"),
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


def _plain_ticks():
    """Tick labels as plain numbers (``0.01``, ``-1``, ``100``), not ``6.79x10^-4``."""
    from matplotlib.ticker import FuncFormatter

    return FuncFormatter(lambda y, _: f"{y:g}")


def _set(row: dict, key: str) -> bool:
    """Whether a 0/1 column is set in ``row`` (absent or nan: not set)."""
    value = row.get(key, 0)
    return bool(value == value and value)


def plot_metrics(rows: list[dict], png_path: str | Path, *, title: str | None = None) -> None:
    """Draw a run's metrics rows into ``png_path`` (written atomically).

    ``rows`` are the job's metrics rows (:func:`ppo_objectives.train.read_metrics` reads them back from a
    ``metrics.csv``); the job redraws ``DIR/training.png`` with them at every checkpoint.

    One axis per signal group (the table in the module docstring): task score,
    response length, per-token KL (mean and max, symlog scale so a spike of 10 nats
    and a mean of 0.01 are both readable), entropy, clip fractions, explained
    variance (symlog: -4000 does not flatten the curve), losses, optimizer steps. Symlog axes have
    plain tick labels (``0.01``, ``-100``), and the response length's axis starts at 0, so only a
    real change in length shows.
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
            points = [(x, r[key]) for x, r in zip(it, rows) if not math.isnan(r.get(key, math.nan))]
            if points:  # sparse series (held-out evaluations) are drawn through their points, with markers
                xs, ys = zip(*points)
                ax.plot(xs, ys, label=label, lw=1.2, marker="o" if len(points) < len(rows) else None, ms=3)
                drawn += 1
        for x, r in zip(it, rows):
            if _set(r, "collapse"):
                ax.axvspan(x - 0.5, x + 0.5, color="red", alpha=0.25, lw=0)
            elif any(_set(r, f"warn_{f}") for f in FLAGS):
                ax.axvspan(x - 0.5, x + 0.5, color="orange", alpha=0.25, lw=0)
        if scale == "symlog":
            ax.set_yscale("symlog", linthresh=1e-2)
            ax.yaxis.set_major_formatter(_plain_ticks())  # 0.01, -1, 100: no 6.79x10^-4 labels
        if name.startswith("response length"):  # from 0: a dip of 0.03 tokens must not look like a collapse
            ax.set_ylim(bottom=0)
        ax.set_title(name)
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(fontsize=8, loc="best")
    for ax in axes[-1]:
        ax.set_xlabel("iteration")
    n_collapsed = sum(_set(r, "collapse") for r in rows)
    n_flagged = sum(any(_set(r, f"warn_{f}") for f in FLAGS) for r in rows)
    head = title or "PPO run"
    fig.suptitle(f"{head}: {len(rows)} iterations; {n_collapsed} collapsed (red), {n_flagged} flagged (orange)")
    fig.tight_layout()
    tmp = png_path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=80)
    plt.close(fig)
    os.replace(tmp, png_path)

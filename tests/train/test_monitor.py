"""The collapse guard and the plot of a run (ppo_objectives.train.monitor), and both inside the training job."""

import math

import pytest
import torch
from _flags import SMALL

from ppo_objectives import train as T
from ppo_objectives.train import loop
from ppo_objectives.train.digit import DigitTask
from ppo_objectives.train.monitor import FLAGS, CollapseGuard, CriticWarmup, plot_metrics

HEALTHY = dict(reward=0.4, exact=0.1, response_len=4.0, entropy=1.5, kl_approx_max=0.05, kl_token_max=9.0,
               rolled_back=0)  # a large per-token maximum alone is no spike
EOS_FIRST = dict(reward=0.0, exact=0.0, response_len=1.0, entropy=0.004, kl_approx_max=0.0, kl_token_max=0.0,
                 rolled_back=0)


def _feed(guard, rows):
    lines = []
    for i, r in enumerate(rows, 1):
        lines += guard.update(dict(r, iteration=i))
    return lines


@pytest.mark.parametrize(
    "change, flag",
    [
        (dict(response_len=1.4), "min_len"),
        (dict(reward=0.01), "zero_reward"),
        (dict(entropy=0.01), "entropy"),
        (dict(kl_approx_max=10.5), "kl_spike"),
    ],
)
def test_each_failure_mode_raises_its_own_flag(change, flag):
    guard = CollapseGuard()
    assert guard.flags(HEALTHY) == {}
    assert set(guard.flags(dict(HEALTHY, **change))) == {flag}


def test_a_converged_deterministic_policy_is_not_an_entropy_collapse():
    solved = dict(HEALTHY, reward=0.99, exact=0.97, entropy=0.003)
    assert CollapseGuard().flags(solved) == {}


def test_missing_or_nan_metrics_raise_no_flag():
    assert CollapseGuard().flags({}) == {}
    assert CollapseGuard().flags({k: math.nan for k in HEALTHY}) == {}


def test_patience_bad_iterations_in_a_row_make_one_collapse_and_recovery_is_reported():
    guard = CollapseGuard(patience=3)
    lines = _feed(guard, [HEALTHY, EOS_FIRST, EOS_FIRST, EOS_FIRST, EOS_FIRST, HEALTHY])
    assert lines[0].startswith("iteration 2: min_len (response_len 1.00), zero_reward (reward 0.000)")
    assert lines[1] == (
        "iteration 4: COLLAPSE: 3 bad iterations in a row (min_len, zero_reward, entropy); the run is not learning"
    )
    assert lines[2] == "iteration 6: recovered from the collapse"
    assert len(lines) == 3  # iteration 3 (streak continuing) and 5 (still collapsed) are quiet
    assert (guard.collapses, guard.collapse_iterations, guard.collapsed) == (1, 2, False)


def test_short_bad_streaks_are_warned_about_but_are_no_collapse():
    guard = CollapseGuard(patience=5)
    lines = _feed(guard, [EOS_FIRST] * 4 + [HEALTHY] + [EOS_FIRST] * 4)
    assert [line.split(":")[0] for line in lines] == ["iteration 1", "iteration 6"]
    assert guard.collapses == 0 and guard.summary() == "no collapse, no KL spike, no stall"


def test_update_writes_the_warn_and_collapse_columns_into_the_row():
    guard = CollapseGuard(patience=1)
    row = dict(EOS_FIRST, iteration=1, kl_approx_max=7.0, kl_token_max=40.0, rolled_back=1)
    lines = guard.update(row)
    assert {f: row[f"warn_{f}"] for f in FLAGS} == dict(min_len=1, zero_reward=1, entropy=1, kl_spike=1, stall=0)
    assert row["collapse"] == 1
    assert lines[-1] == "iteration 1: kl_spike (kl_approx_max 7.00 nats, largest token 40.00, step pulled back)"
    assert guard.spikes == 1 and "1 collapse(s)" in guard.summary()


def test_state_dict_round_trip_continues_the_streak():
    a = CollapseGuard(patience=4)
    _feed(a, [EOS_FIRST] * 3)
    b = CollapseGuard(patience=4)
    b.load_state_dict(a.state_dict())
    row = dict(EOS_FIRST, iteration=4)
    assert b.update(dict(row)) == a.update(dict(row))
    assert b.collapsed and b.state_dict() == a.state_dict()


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(patience=0), "patience=0 must be an int >= 1"),
        (dict(patience=2.5), "patience=2.5 must be an int >= 1"),
        (dict(kl_spike=float("nan")), "kl_spike=nan must be a finite number"),
        (dict(reward_floor=-1.0), "reward_floor=-1.0 must be a finite number >= 0"),
        (dict(entropy_floor="0.1"), "entropy_floor='0.1' must be a finite number"),
    ],
)
def test_bad_guard_settings_are_clear_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        CollapseGuard(**kw)


def test_plot_draws_every_panel_and_shades_flagged_iterations(tmp_path, monkeypatch):
    import matplotlib.axes

    spans = []
    real = matplotlib.axes.Axes.axvspan
    monkeypatch.setattr(matplotlib.axes.Axes, "axvspan", lambda self, *a, **k: spans.append(k["color"]) or real(
        self, *a, **k))
    guard = CollapseGuard(patience=2)
    rows = []
    for i, r in enumerate([HEALTHY, EOS_FIRST, EOS_FIRST, dict(HEALTHY, explained_variance=-3975.0)], 1):
        r = dict(r, iteration=i, kl_approx=0.01, explained_variance=r.get("explained_variance", 0.3))
        guard.update(r)
        rows.append(r)
    png = tmp_path / "run.png"
    plot_metrics(rows, png)
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    # 8 panels; iteration 2 flagged (orange), 3 collapsed (red)
    assert spans.count("orange") == 8 and spans.count("red") == 8
    assert not list(tmp_path.glob("*.tmp.png"))


# --------------------------------------------------------------------------- #
# In the training job
# --------------------------------------------------------------------------- #


def test_a_collapsing_run_says_so_counts_it_and_keeps_its_checkpoint(tmp_path, monkeypatch, capsys):
    # a task whose reward is always 0: the guard must see "zero_reward" on every iteration
    monkeypatch.setattr(DigitTask, "reward", lambda self, p, pm, r, rm: torch.zeros(r.shape[0]))
    with pytest.warns(T.TrainingCollapseWarning, match="collapsed: 1 collapse"):
        T.main(["--iterations", "6", "--out", str(tmp_path), "--no-plot", *SMALL])
    err = capsys.readouterr().err
    assert "WARNING ppo: iteration 1: zero_reward (reward 0.000)" in err
    assert "WARNING ppo: iteration 5: COLLAPSE: 5 bad iterations in a row (zero_reward" in err
    assert "critic starts cold" not in err  # a single-turn task: rare first rewards are no warning of their own
    rows = T.read_metrics(tmp_path / "metrics.csv")
    assert [r["warn_zero_reward"] for r in rows] == [1.0] * 6
    assert [r["collapse"] for r in rows] == [0, 0, 0, 0, 1, 1]
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=False)["collapse_guard"]["collapses"] == 1


@pytest.mark.parametrize(
    "row, warmup, iterations",
    [
        (dict(iteration=1, reward=0.026, episodes=76.0), CriticWarmup(if_rare=2), 2),
        (dict(iteration=1, reward=0.0, episodes=8.0), CriticWarmup(if_rare=1, floor=0.01), 1),
        (dict(iteration=1, reward=0.05, episodes=8.0), CriticWarmup(if_rare=2), 0),  # at the floor: not rare
        (dict(iteration=1, reward=0.02, episodes=8.0), CriticWarmup(if_rare=2, floor=0.01), 0),
        (dict(iteration=2, reward=0.0, episodes=8.0), CriticWarmup(if_rare=2), 0),  # only the first iteration
        (dict(iteration=1, reward=math.nan, episodes=8.0), CriticWarmup(if_rare=2), 0),  # no reward logged
        (dict(iteration=1), CriticWarmup(if_rare=2), 0),
        (dict(iteration=1, reward=0.0, episodes=8.0), CriticWarmup(if_rare=0), 0),  # off
        (dict(iteration=1, reward=0.0, episodes=8.0), CriticWarmup(fixed=3, if_rare=2), 3),  # a warm critic
        # the token budget cut most conversations: that is the cause of the rare rewards, not a cold critic
        (dict(iteration=1, reward=0.0, episodes=8.0, env_turns_cut=5.0), CriticWarmup(if_rare=2), 0),
        (dict(iteration=1, reward=0.0, episodes=8.0, env_turns_cut=4.0), CriticWarmup(if_rare=2), 2),
    ],
)
def test_critic_warmup_starts_only_on_a_cold_critics_first_iteration_below_the_floor(row, warmup, iterations):
    fixed = warmup.fixed
    line = warmup.decide(row)
    assert warmup.iterations == iterations
    assert [warmup.critic_only(it) for it in range(4)] == [it < iterations for it in range(4)]
    assert (line is not None) == (iterations > 0 and not fixed)
    if line is not None:
        assert line.startswith(f"iteration 1: reward {row['reward']:.3f} is below {warmup.floor:g} and the critic "
                               f"starts cold: {'iterations 1-2 train' if iterations == 2 else 'iteration 1 trains'} the critic alone")
        assert f"--rare-reward-warmup {iterations}; 0 turns it off" in line


def test_critic_warmup_keeps_its_decision_through_a_checkpoint():
    decided = CriticWarmup(if_rare=2)
    decided.decide(dict(iteration=1, reward=0.0, episodes=8.0))
    resumed = CriticWarmup(if_rare=2)
    resumed.load_state_dict(decided.state_dict())
    assert resumed.iterations == 2 and resumed.critic_only(1) and not resumed.critic_only(2)


@pytest.mark.parametrize("kwargs, match", [
    (dict(fixed=-1), r"CriticWarmup fixed=-1 must be an int >= 0"),
    (dict(if_rare=1.5), r"CriticWarmup if_rare=1.5 must be an int >= 0"),
    (dict(floor=math.nan), r"CriticWarmup floor=nan must be a finite number >= 0"),
])
def test_critic_warmup_refuses_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CriticWarmup(**kwargs)


def test_resume_of_a_collapsing_run_continues_its_streak(tmp_path, monkeypatch):
    monkeypatch.setattr(DigitTask, "reward", lambda self, p, pm, r, rm: torch.zeros(r.shape[0]))
    full, split = tmp_path / "full", tmp_path / "split"
    with pytest.warns(T.TrainingCollapseWarning):
        T.main(["--iterations", "6", "--out", str(full), "--no-plot", *SMALL])
    T.main(["--iterations", "3", "--out", str(split), "--no-plot", *SMALL])  # 3 bad: no collapse yet
    with pytest.warns(T.TrainingCollapseWarning):
        T.main(["--iterations", "6", "--out", str(split), "--no-plot", "--resume", *SMALL])
    a, b = T.read_metrics(full / "metrics.csv"), T.read_metrics(split / "metrics.csv")
    for key in ("collapse", "warn_zero_reward", "reward", "kl_approx", "loss_critic"):
        assert [r[key] for r in a] == pytest.approx([r[key] for r in b], rel=1e-5, abs=1e-7), key


def test_the_plot_is_redrawn_at_every_checkpoint(tmp_path, monkeypatch):
    drawn = []
    monkeypatch.setattr(loop, "plot_metrics", lambda rows, png, title=None: drawn.append(len(rows)))
    T.main(["--iterations", "5", "--save-every", "2", "--out", str(tmp_path), *SMALL])
    assert drawn == [2, 4, 5, 5]  # checkpoints at 2, 4, 5 and the end of the run

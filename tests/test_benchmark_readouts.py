"""The read-outs of the learning benchmarks (``benchmarks/sides.py``, ``benchmarks/study_critic.py``) on rows written by
hand: which evaluation counts at a mark, when a run reaches a level, and the interval of a difference over seeds."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from sides import at_minutes, mark_evaluation, reach_cell, train_minutes  # noqa: E402
from study_critic import bootstrap_diff, reach  # noqa: E402

NAN = float("nan")


def run(*evals):
    """Rows of 2-minute iterations (1 s of it scoring); ``evals[i]`` is the sampled accuracy after iteration i."""
    rows = [dict(iteration=0, rollout_s=0.0, reference_s=0.0, update_s=0.0, eval_sampled=evals[0])]
    for i, acc in enumerate(evals[1:], 1):
        rows.append(dict(iteration=i, rollout_s=60.0, reference_s=1.0, update_s=59.0, eval_sampled=acc, episodes=32))
    return rows


def test_a_mark_reads_the_evaluation_made_for_it_up_to_one_window_late():
    rows = run(0.3, NAN, NAN, 0.8, NAN, 0.9)  # evaluated at 0, 6 and 10 minutes
    assert train_minutes(rows) == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]
    assert [at_minutes(rows, "eval_sampled", m) for m in (0, 5, 6, 9.9, 10)] == [0.3, 0.8, 0.8, 0.9, 0.9]
    assert mark_evaluation(rows, 5)[0] == 6.0
    minute, row = mark_evaluation(rows, 15)  # the run ended at 10: no evaluation for the mark 15
    assert minute != minute and row == {}
    assert at_minutes(rows, "eval_sampled", 1) != at_minutes(rows, "eval_sampled", 1)  # next one is 5 minutes on
    assert at_minutes(rows, "eval_greedy", 10) != at_minutes(rows, "eval_greedy", 10)  # never evaluated: nan


def test_reach_gives_the_minutes_and_samples_of_the_first_evaluation_at_the_level():
    rows = run(0.3, NAN, 0.85, NAN, 0.95)
    assert reach(rows, 0.9) == (8.0, 4 * 32)
    assert reach(rows, 0.3) == (0.0, 0)
    minutes, samples = reach(rows, 0.99)
    assert minutes != minutes and samples != samples  # never reached: nan, not the end of the run


def test_bootstrap_interval_of_a_difference_over_seeds():
    assert bootstrap_diff([0.5, 0.5, 0.5], [0.5, 0.5, 0.5]) == (0.0, 0.0, 0.0)
    d, lo, hi = bootstrap_diff([0.9, 0.95, 1.0], [0.5, 0.6, 0.7])
    assert d == pytest.approx(0.35) and 0 < lo < d < hi
    d, lo, hi = bootstrap_diff([0.2, 0.9, 0.5], [0.6, 0.3, 0.7])  # noisy seeds: the interval spans 0
    assert lo < 0 < hi


def marks(at5, at10, at15):
    """A run evaluated for the marks 5, 10 and 15 (at 6, 10 and 16 training minutes)."""
    return run(0.0, NAN, NAN, at5, NAN, at10, NAN, NAN, at15)


def test_a_difference_line_sets_one_side_against_another_at_each_mark():
    from study_critic import difference_line

    line = difference_line("`--lr 3e-5`", [marks(0.5, 0.6, 0.7), marks(0.5, 0.6, 0.7)],
                           [marks(0.4, 0.6, 0.5), marks(0.4, 0.6, 0.5), marks(0.4, 0.6, 0.5)])
    assert line == ("- `--lr 3e-5` (2 against 3 seeds): 5 min +0.100 [+0.100, +0.100]; "
                    "10 min +0.000 [+0.000, +0.000]; 15 min +0.200 [+0.200, +0.200]")
    thin = difference_line("`--lr 3e-5`", [marks(0.5, 0.6, 0.7)], [marks(0.4, 0.6, 0.5), marks(0.3, 0.6, 0.5)])
    assert "(1 against 2 seeds; a side of one seed has no spread of its own, so this is not yet a test)" in thin
    assert "5 min +0.150 [+0.100, +0.200]" in thin


def test_the_sweep_refuses_against_study_without_summary_only(capsys):
    from sweep_real_lm import main

    with pytest.raises(SystemExit):
        main(["--against-study"])
    assert "error: --against-study reads rows already written: add --summary-only" in capsys.readouterr().err


def test_the_sweep_against_study_names_the_missing_recipe_rows(tmp_path, monkeypatch, capsys):
    import study_critic
    from sweep_real_lm import main

    monkeypatch.setattr(study_critic, "RESULTS", tmp_path)
    assert main(["--summary-only", "--against-study", "--task", "chat-add2", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == ("error: study_critic.py has no rows of the recipe on chat-add2: "
                                               "run its chat-add2:ppo:SEED first")


def test_the_sweep_against_study_reads_every_seed_and_names_a_variant_without_rows(tmp_path, monkeypatch, capsys):
    import json

    import study_critic
    from sweep_real_lm import main

    study = tmp_path / "critic"
    for seed in (0, 1):
        path = study / "chat-add2" / "ppo" / f"seed{seed}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(dict(task="chat-add2", side="ppo", seed=seed, rows=marks(0.4, 0.6, 0.5))))
    for seed in (0, 2):
        path = tmp_path / "sweep" / "chat-add2" / f"seed{seed}" / "lr_3e-5" / "rows.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(marks(0.5, 0.6, 0.7)))
    monkeypatch.setattr(study_critic, "RESULTS", study)
    assert main(["--summary-only", "--against-study", "--task", "chat-add2", "--out", str(tmp_path / "sweep"),
                 "--variants", "--lr 3e-5", "--lr 1e-5"]) == 0
    out = capsys.readouterr().out
    assert "- `--lr 3e-5` (2 against 2 seeds): 5 min +0.100 [+0.100, +0.100]" in out
    assert f"- `--lr 1e-5`: no rows under {tmp_path / 'sweep' / 'chat-add2'}/seed*/lr_1e-5/" in out


def test_the_pair_runner_passes_the_results_directory_pins_each_run_and_skips_written_rows(tmp_path, capsys):
    import os

    from sides import run_pairs

    script = tmp_path / "fake_side.py"
    script.write_text(
        "import argparse, json, os\n"
        "from pathlib import Path\n"
        "p = argparse.ArgumentParser()\n"
        "for a in ('--one-run', '--model', '--minutes', '--results'):\n"
        "    p.add_argument(a)\n"
        "args = p.parse_args()\n"
        "Path(args.results, args.one_run + '.json').write_text(json.dumps(sorted(os.sched_getaffinity(0))))\n"
    )
    results = tmp_path / "rows"
    results.mkdir()
    row = lambda spec: results / f"{spec}.json"  # noqa: E731
    assert run_pairs(script, ["a", "b"], row, tmp_path, 1.0, results) == 0
    cores = [json.loads(row(s).read_text()) for s in ("a", "b")]
    if len(os.sched_getaffinity(0)) >= 2:
        assert len(cores[0]) == len(cores[1]) == 1 and cores[0] != cores[1]  # one core each, not the same one
    assert run_pairs(script, ["a", "b"], row, tmp_path, 1.0, results) == 0
    assert capsys.readouterr().err.count("written already, skipped") == 2


def test_the_lever_summary_sets_each_lever_against_the_recipe(tmp_path, capsys):
    from ablate_critic import row_path, summary

    for lever, acc in (("recipe", [0.2, 0.4]), ("critic-steps-2", [0.5, 0.7])):
        for seed, base in enumerate(acc):
            path = row_path(tmp_path, f"chat-add2:{lever}:{seed}")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(dict(task="chat-add2", lever=lever, seed=seed, rows=run(0.0, base, base, base,
                                                                                                 base, base, base, base))))
    summary(tmp_path)
    out = capsys.readouterr().out
    assert "| recipe | 2 |" in out and "| critic-steps-2 | 2 |" in out
    assert "- critic-steps-2 (2 against 2 seeds): 5 min +0.300" in out


def test_the_lever_runner_refuses_an_unknown_lever_in_one_error_line(capsys):
    from ablate_critic import main

    with pytest.raises(SystemExit):
        main(["--model", str(Path(__file__).parent), "--runs", "chat-add2:bigger-critic:0"])
    err = capsys.readouterr().err
    assert "error:" in err and "LEVER one of" in err


def test_the_lever_runner_refuses_a_multi_turn_lever_on_a_single_turn_task_and_leaves_it_out_by_default(capsys):
    from ablate_critic import LEVERS, applies, main

    with pytest.raises(SystemExit):
        main(["--model", str(Path(__file__).parent), "--runs", "chat-add2:rare-reward-warmup-1:0"])
    err = capsys.readouterr().err
    assert "error:" in err and "applies to a multi-turn task only" in err and "chat-calc-sum" in err
    assert not applies("chat-add2", "rare-reward-warmup-0") and applies("chat-calc-sum", "rare-reward-warmup-1")
    assert applies("chat-add2", "critic-steps-2") and all(applies("chat-calc-sum", lever) for lever in LEVERS)


def test_the_lever_summary_can_take_the_recipe_from_the_studys_rows(tmp_path, capsys):
    from ablate_critic import row_path, summary

    study = tmp_path / "study" / "chat-add2" / "ppo" / "seed0.json"
    study.parent.mkdir(parents=True)
    study.write_text(json.dumps(dict(task="chat-add2", side="ppo", seed=0, rows=run(0.0, *[0.2] * 7))))
    lever = row_path(tmp_path / "levers", "chat-add2:turn-level:0")
    lever.parent.mkdir(parents=True)
    lever.write_text(json.dumps(dict(task="chat-add2", lever="turn-level", seed=0, rows=run(0.0, *[0.5] * 7))))
    summary(tmp_path / "levers", tmp_path / "study")
    out = capsys.readouterr().out
    assert "| recipe | 1 |" in out and "- turn-level (1 against 1 seeds" in out and "5 min +0.300" in out


def test_the_lever_summary_takes_a_recipe_seed_it_ran_itself_over_the_studys(tmp_path, capsys):
    from ablate_critic import row_path, summary

    for seed, acc in ((0, 0.2), (1, 0.4)):  # the study's recipe rows, at an older code and price
        study = tmp_path / "study" / "chat-add2" / "ppo" / f"seed{seed}.json"
        study.parent.mkdir(parents=True, exist_ok=True)
        study.write_text(json.dumps(dict(task="chat-add2", side="ppo", seed=seed, rows=run(0.0, *[acc] * 7))))
    for lever, acc in (("recipe", 0.6), ("turn-level", 0.7)):  # seed 0 re-run by the ablation
        path = row_path(tmp_path / "levers", f"chat-add2:{lever}:0")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(dict(task="chat-add2", lever=lever, seed=0, rows=run(0.0, *[acc] * 7))))
    summary(tmp_path / "levers", tmp_path / "study")
    out = capsys.readouterr().out
    # the recipe is the ablation's seed 0 (0.6) and the study's seed 1 (0.4), not the study's seed 0 as well
    assert "| recipe | 2 |" in out and "- turn-level (1 against 2 seeds" in out and "5 min +0.200" in out


def trace_rows(sampled, rewards):
    """A trace's rows: held-out sampled accuracy after every update, the training reward before it."""
    return [dict(iteration=i, reward=NAN if i == 0 else rewards[i - 1], eval_greedy=acc, eval_sampled=acc, seq_kl=1.0,
                 entropy=0.5) for i, acc in enumerate(sampled)]


def test_the_late_fall_trace_finds_the_one_update_that_falls_and_sets_the_studys_rewards_beside(tmp_path, capsys):
    from trace_late_fall import row_path, summary

    path = row_path(tmp_path / "trace", "chat-calc-sum:0")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(dict(task="chat-calc-sum", seed=0, machine="cpu", rows=trace_rows(
        [0.05, 0.6, 0.9, 0.95, 0.7, 0.9], [0.1, 0.5, 0.9, 0.95, 0.9]))))
    study = tmp_path / "study" / "chat-calc-sum" / "ppo" / "seed0.json"
    study.parent.mkdir(parents=True)
    study.write_text(json.dumps(dict(task="chat-calc-sum", side="ppo", seed=0, rows=trace_rows(
        [0.05, NAN, NAN, 0.95, NAN, 0.9], [0.1, 0.5, 0.9, 0.8, 0.9]))))
    summary(tmp_path / "trace", tmp_path / "study")
    out = capsys.readouterr().out
    assert "largest one-update fall of held-out sampled accuracy: -0.250 (update 4)" in out
    assert "standard error of a difference of two 200-problem evaluations at 0.90: 0.030" in out
    assert "training rewards equal to the study's row at 4 of 5 iterations" in out  # iteration 4 differs
    assert "| 4 | 0.950 | 0.800 | 0.700 | 0.700 | -0.250 | 1.00 | 0.500 |" in out


def test_the_late_fall_trace_refuses_a_bad_run_in_one_error_line(capsys):
    from trace_late_fall import main

    with pytest.raises(SystemExit):
        main(["--model", str(Path(__file__).parent), "--runs", "chat-calc-sum:first"])
    err = capsys.readouterr().err
    assert "error:" in err and "TASK:SEED" in err


def test_the_lever_summary_warns_when_its_rows_come_from_two_machines(tmp_path, capsys):
    from ablate_critic import row_path, summary

    for lever, cpu in (("recipe", "Intel Xeon, 2 cores"), ("turn-level", "AMD EPYC, 2 cores")):
        path = row_path(tmp_path, f"chat-add2:{lever}:0")
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps(dict(task="chat-add2", lever=lever, seed=0, machine=cpu, rows=run(0.0, *[0.5] * 7))))
    summary(tmp_path)
    assert "warning: the chat-add2 rows come from 2 machines (AMD EPYC, 2 cores; Intel Xeon, 2 cores)" in (
        capsys.readouterr().out)
    (tmp_path / "chat-add2" / "turn-level" / "seed0.json").unlink()
    summary(tmp_path)
    assert "warning" not in capsys.readouterr().out


def test_the_study_summary_warns_when_its_rows_come_from_two_machines(tmp_path, capsys):
    from study_critic import row_path, summary

    for side, cpu in (("ppo", "Intel Xeon, 2 cores"), ("plain", "AMD EPYC, 2 cores")):
        path = row_path(tmp_path, f"chat-add2:{side}:0")
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps(dict(task="chat-add2", side=side, seed=0, machine=cpu, rows=run(0.0, *[0.5] * 7))))
    summary(tmp_path, plot=False)
    assert "warning: the chat-add2 rows come from 2 machines (AMD EPYC, 2 cores; Intel Xeon, 2 cores)" in (
        capsys.readouterr().out)
    (tmp_path / "chat-add2" / "plain" / "seed0.json").unlink()
    summary(tmp_path, plot=False)
    assert "warning" not in capsys.readouterr().out


@pytest.mark.parametrize(
    "hits, kw, cell",
    [
        ([9.4, float("nan"), 10.0], {}, "9.7 (2 of 3 seeds)"),  # the median of the runs that reached it
        ([float("nan"), float("nan")], {}, "not reached (0 of 2 seeds)"),  # never "nan"
        ([3.0, 5.0], {}, "4"),  # all reached: no count
        ([3.0, 5.0], dict(count=True), "4 (2 of 2 seeds)"),
        ([3.0, float("nan")], dict(unit=""), "3 (1 of 2)"),
    ],
)
def test_a_reach_cell_says_how_many_runs_reached_the_target_and_never_prints_nan(hits, kw, cell):
    fmt = ".1f" if cell.startswith("9.7") else ".0f"
    assert reach_cell(hits, fmt, **kw) == cell


def test_the_answers_line_counts_each_sides_answers_to_the_grouped_sides_final_accuracy():
    from study_critic import answers_line

    ppo = [run(0.0, 0.6, *[0.6] * 7), run(0.0, 0.3, 0.7, *[0.7] * 6)]  # 32 and 64 answers to 0.6
    grpo8 = [run(0.0, 0.2, 0.4, *[0.6] * 6), run(0.0, 0.1, 0.2, 0.5, *[0.6] * 5)]  # 96 and 128 answers
    assert answers_line("grpo8", ppo, grpo8) == (
        "- to grpo8's final 0.600: ppo 48 (2 of 2 seeds), grpo8 112 (2 of 2 seeds); ppo / grpo8 0.43 "
        "(SAO's claim: at most 0.50)")
    slow = [run(0.0, *[0.5] * 8)]  # never reaches 0.6: counted as not reached, not as zero answers
    assert answers_line("grpo8", slow, grpo8).startswith("- to grpo8's final 0.600: ppo not reached (0 of 1 seeds)")


def test_the_study_summary_prints_the_answers_line_only_where_a_grouped_side_ran(tmp_path, capsys):
    from study_critic import row_path, summary

    for side in ("ppo", "grpo"):
        path = row_path(tmp_path, f"chat-add2:{side}:0")
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps(dict(task="chat-add2", side=side, seed=0, rows=run(0.0, *[0.5] * 8))))
    summary(tmp_path, plot=False)
    assert "rollout answers to a side's final accuracy" not in capsys.readouterr().out
    path = row_path(tmp_path, "chat-add2:rloo8:0")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(dict(task="chat-add2", side="rloo8", seed=0, rows=run(0.0, *[0.5] * 8))))
    summary(tmp_path, plot=False)
    assert "- to rloo8's final 0.500: ppo 32 (1 of 1 seeds), rloo8 32 (1 of 1 seeds); ppo / rloo8 1.00" in (
        capsys.readouterr().out)


def test_a_runners_child_writes_its_one_runs_row_and_runs_nothing_else(tmp_path):
    from argparse import Namespace

    from sides import run_specs

    args = Namespace(one_run="chat-add2:0", runs=["chat-add2:1"], model=tmp_path, minutes=1.0, results=tmp_path)
    seen = []
    row = lambda results, spec: results / f"{spec.replace(':', '_')}.json"  # noqa: E731
    assert run_specs(Path("no-such-script.py"), args, row, lambda spec: seen.append(spec) or {"spec": spec},
                     lambda: seen.append("summary")) == 0
    assert seen == ["chat-add2:0"] and json.loads(row(tmp_path, "chat-add2:0").read_text()) == {"spec": "chat-add2:0"}
    assert not row(tmp_path, "chat-add2:1").exists()

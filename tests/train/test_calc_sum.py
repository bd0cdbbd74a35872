"""``--task chat-calc-sum``: the problems, the tool that the credit must cross twice, and the job on it."""

import math

import pytest

from ppo_objectives.train.calc_sum import (
    CALC_SUM_ERROR,
    ONE_SHOT,
    calc_sum_calls_well_formed,
    calc_sum_examples,
    calc_sum_tool,
)
from ppo_objectives.train.text import number_reward


def _numbers(question: str) -> tuple[int, int, int]:
    left, c = question[len("What is "):-1].split(" plus ")
    a, b = left.split(" times ")
    return int(a), int(b), int(c)


def test_the_split_is_seeded_disjoint_and_every_answer_is_the_product_plus_the_third_number():
    held_out, train = calc_sum_examples("eval"), calc_sum_examples("train")
    assert (len(held_out), len(train)) == (200, 20_000)
    questions = [e.prompt[-1]["content"] for e in held_out + train]
    assert len(set(questions)) == len(questions)  # no problem twice, none in both splits
    assert calc_sum_examples("eval") == held_out and calc_sum_examples("eval", split_seed=1) != held_out
    for ex in held_out[:20] + train[:20]:
        a, b, c = _numbers(ex.prompt[-1]["content"])
        assert all(10 <= x <= 99 for x in (a, b, c)) and ex.fields == {"answer": a * b + c}
        assert tuple(ex.prompt[:-1]) == ONE_SHOT
    assert (12, 34, 56) not in {_numbers(q) for q in questions}  # the worked example is no problem


def test_the_worked_exchange_is_what_the_tool_answers():
    for call, reply in zip(ONE_SHOT[1:-1:2], ONE_SHOT[2::2]):
        assert calc_sum_tool([call]) == reply["content"]
    assert number_reward(ONE_SHOT[-1]["content"], 12 * 34 + 56) == 1.0


@pytest.mark.parametrize("text, reply", [
    ("calc(57*18)", "calc result: 1026"),
    ("calc( 57 x 18 )", "calc result: 1026"),
    ("calc(1026+40)", "calc result: 1066"),
    ("calc(57-18)", CALC_SUM_ERROR),
    ("calc(__import__('os').system('x'))", CALC_SUM_ERROR),
    ("The answer is 1066.", None),
])
def test_the_tool_reads_products_and_sums_and_never_evaluates_the_text(text, reply):
    assert calc_sum_tool([{"role": "assistant", "content": text}]) == reply


def test_well_formed_calls_are_the_products_and_sums_after_the_prompt():
    chat = [*ONE_SHOT, {"role": "user", "content": "What is 57 times 18 plus 100?"}]
    good = [{"role": "assistant", "content": "calc(57*18)"}, {"role": "user", "content": "calc result: 1026"},
            {"role": "assistant", "content": "calc(1026+100)"}]
    assert calc_sum_calls_well_formed(chat + good)
    assert not calc_sum_calls_well_formed(chat + good + [{"role": "assistant", "content": "calc(1126/2)"}])
    assert not calc_sum_calls_well_formed(chat + [{"role": "assistant", "content": "The answer is 1126."}])


def test_the_task_has_a_budget_for_two_calls_an_answer_and_a_turn_to_spare():
    from ppo_objectives import train as T

    cfg = T.TrainConfig(task="chat-calc-sum", model="m")
    assert cfg.multi_turn and (cfg.max_new_tokens, cfg.max_turns, cfg.max_turn_tokens) == (128, 4, 16)


def test_the_job_runs_chat_calc_sum_and_checks_its_calls(tmp_path, chat_model_dir):
    from ppo_objectives import train as T

    cfg = T.TrainConfig(model=str(chat_model_dir), task="chat-calc-sum", iterations=1, num_envs=4, eval_every=1,
                        out=str(tmp_path / "run"), no_progress=True, no_plot=True)
    rows = T.train(cfg)
    assert len(rows) == 2 and rows[1]["turns"] >= 1.0
    assert 0.0 <= rows[1]["eval_tool_calls"] <= 1.0 and not math.isnan(rows[1]["eval_tool_calls"])

"""Multi-turn text tasks: a tool's messages appended as the chat template renders them, the conversation the tool and
the reward see, ``chat-calc``, the job's ``--tool`` and every bad input of it (a tokenizer and a Llama built in code)."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from ppo_objectives.train.calc import CALC_ERROR, calc_examples, calc_tool, tool_calls_well_formed
from ppo_objectives.train.text import TextExample, TextTask, evaluate, number_reward

pytest.importorskip("transformers")


def echo_tool(messages, answer):
    """Replies once with the answer's double, then ends the episode."""
    return None if sum(m["role"] == "assistant" for m in messages[-3:]) > 1 else f"result {2 * answer}"


def _task(tok, tool=echo_tool, **kw):
    examples = [TextExample("What is 1 + 2?", {"answer": 3}), TextExample("What is 10 + 5?", {"answer": 15})]
    return TextTask(examples, kw.pop("reward", number_reward), tok, max_new_tokens=kw.pop("M", 24), tool=tool, **kw)


def test_the_env_turn_is_the_template_difference_after_the_end_of_turn_token(tok):
    task = _task(tok)
    messages = [{"role": "user", "content": "What is 1 + 2?"}, {"role": "assistant", "content": "3"}]
    ids = task.env_turn_ids(messages, "result 6", closed=True)
    assert tok.decode(ids) == "\n<|im_start|>user\nresult 6<|im_end|>\n<|im_start|>assistant\n"
    # a turn cut by its budget (no end-of-turn token): the env closes it for the model
    cut = task.env_turn_ids(messages, "result 6", closed=False)
    assert tok.decode(cut) == "<|im_end|>\n<|im_start|>user\nresult 6<|im_end|>\n<|im_start|>assistant\n"
    # the prompt, the model's tokens and the env turn read as the template's rendering of the whole conversation
    prompt = tok.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    whole = tok.apply_chat_template(messages + [{"role": "user", "content": "result 6"}], tokenize=False,
                                    add_generation_prompt=True)
    assert prompt + "3<|im_end|>" + tok.decode(ids) == whole


def test_the_tool_and_the_reward_see_the_whole_conversation(tok):
    seen = {}

    def tool(messages, answer):
        seen["tool"] = [dict(m) for m in messages]
        return "result 6" if len(messages) < 4 else None

    def reward(completion, answer, messages):
        seen["reward"] = (completion, [dict(m) for m in messages])
        return float(completion == "fine")

    task = _task(tok, tool=tool, reward=reward)
    a1, a2 = tok("3", add_special_tokens=False)["input_ids"], tok("fine", add_special_tokens=False)["input_ids"]
    conversation = []
    turn1 = torch.tensor(a1 + [task.eos_id])
    env_ids = task.env_turn(turn1, torch.ones(len(turn1), dtype=torch.bool), conversation=conversation, prompt_id=0)
    assert conversation == ["result 6"] and seen["tool"][-1] == {"role": "assistant", "content": "3"}
    response = torch.cat([turn1, env_ids, torch.tensor(a2 + [task.eos_id])])
    mask = torch.cat([torch.ones(len(turn1)), torch.zeros(len(env_ids)), torch.ones(len(a2) + 1)]).bool()
    assert task.env_turn(response, mask, conversation=conversation, prompt_id=0) is None
    score = task.reward(task.prompt_ids[:1], task.prompt_mask[:1], response[None], mask[None],
                        prompt_id=torch.tensor([0]), conversation=[conversation])
    assert score.tolist() == [1.0]
    completion, chat = seen["reward"]
    assert completion == "fine" and [m["role"] for m in chat] == ["user", "assistant", "user", "assistant"]
    assert chat[2]["content"] == "result 6"


@pytest.mark.parametrize("tool, error, match", [
    (lambda messages, answer: 1 / 0, RuntimeError,
     r"What is 1 \+ 2\?|the tool <lambda> raised ZeroDivisionError: division by zero .*make it return a message"),
    (lambda messages, answer: 42, ValueError, r"the tool <lambda> returned 42 \(int\); it must return .* a str, or None"),
])
def test_a_bad_tool_is_an_error_naming_the_prompt_and_the_fix(tok, tool, error, match):
    task = _task(tok, tool=tool)
    with pytest.raises(error, match=match):
        task.env_turn(torch.tensor([5, task.eos_id]), torch.ones(2, dtype=torch.bool), conversation=[], prompt_id=0)


def test_a_tool_whose_parameters_miss_a_field_is_refused_before_any_rollout(tok):
    with pytest.raises(TypeError, match=r"the tool .*cannot be called as tool\(messages, \*\*\['answer'\]\)"):
        _task(tok, tool=lambda messages: None)


def test_turn_budgets_without_a_tool_are_refused(tok):
    with pytest.raises(ValueError, match="max_turns budgets the turns of a multi-turn task.*pass tool= or drop"):
        TextTask([TextExample("x", {})], lambda completion: 0.0, tok, max_new_tokens=4, max_turns=2)


def test_evaluate_plays_whole_conversations_and_scores_them(tok, chat_model_dir):
    from ppo_objectives.train.pretrained import load_causal_lm

    lm = load_causal_lm(chat_model_dir)
    task = _task(tok, tool=lambda messages, answer: "again" if len(messages) < 4 else None, max_turn_tokens=3, M=30)
    greedy = evaluate(lm, task, greedy=True)
    assert len(greedy.conversations) == 2 and len(greedy.rewards) == 2
    for chat in greedy.conversations:
        roles = [m["role"] for m in chat[1:]]
        assert roles[:3] == ["assistant", "user", "assistant"] and chat[2]["content"] == "again"
    assert greedy.completions[0].startswith("assistant: ") and " | user: again | assistant: " in greedy.completions[0]
    sampled = evaluate(lm, task, greedy=False, generator=torch.Generator().manual_seed(0), samples=2)
    assert len(sampled.rewards) == 4


def test_chat_calc_has_a_seeded_split_of_200_held_out_problems_and_a_safe_tool():
    held_out, train = calc_examples("eval"), calc_examples("train")
    assert len(held_out) == 200 and len(held_out) + len(train) == 90 * 90 - 1
    assert not {e.prompt[-1]["content"] for e in held_out} & {e.prompt[-1]["content"] for e in train}
    assert calc_examples("eval") == held_out
    ex = held_out[0]
    a, b = (int(x) for x in ex.prompt[-1]["content"][len("What is "):-1].split(" times "))
    assert ex.fields == {"answer": a * b} and ex.prompt[1]["content"] == "calc(23*41)"
    chat = [{"role": "assistant", "content": f"calc({a} * {b})"}]
    assert calc_tool(chat) == f"calc result: {a * b}"
    assert calc_tool([{"role": "assistant", "content": "calc(__import__('os').system('x'))"}]) == CALC_ERROR
    assert calc_tool([{"role": "assistant", "content": "The answer is 12."}]) is None
    assert number_reward("The answer is 12.", 12) == 1.0
    prompt = list(ex.prompt)
    assert tool_calls_well_formed(prompt + chat + [{"role": "user", "content": "x"},
                                                   {"role": "assistant", "content": "The answer is 1."}])
    assert not tool_calls_well_formed(prompt + [{"role": "assistant", "content": "calc(1+)"}])


def _jsonl(tmp_path, tool_body="def tool(messages, answer):\n    return None if len(messages) > 4 else 'result'\n"):
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(
        {"prompt": [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"},
                    {"role": "user", "content": f"What is {a} + 1?"}], "answer": a + 1}) + "\n" for a in range(6)))
    (tmp_path / "e.jsonl").write_text(json.dumps({"prompt": "What is 9 + 9?", "answer": 18}) + "\n")
    (tmp_path / "r.py").write_text("def f(completion, answer, messages):\n    return float(len(messages) > 4)\n")
    (tmp_path / "t.py").write_text(tool_body)
    return dict(task="jsonl", prompts=str(tmp_path / "p.jsonl"), reward=f"{tmp_path / 'r.py'}:f",
                eval_prompts=str(tmp_path / "e.jsonl"), tool=f"{tmp_path / 't.py'}:tool")


def test_the_job_trains_a_users_tool_task_with_a_few_shot_prefix(tmp_path, chat_model_dir):
    from ppo_objectives import train as T

    cfg = T.TrainConfig(model=str(chat_model_dir), iterations=2, num_envs=4, max_new_tokens=48, max_turn_tokens=6,
                        eval_every=1, out=str(tmp_path / "run"), no_progress=True, no_plot=True, **_jsonl(tmp_path))
    rows = T.train(cfg)[1:]  # the first row: the held-out evaluation before training
    assert len(rows) == 2
    for row in rows:
        assert row["turns"] == 2.0 and 0 < row["turn_tokens"] <= 6  # every episode had the tool's turn
        assert row["env_turns_cut"] == 0
        assert row["eval_turns"] >= 1.0 and math.isnan(row["eval_tool_calls"])  # a tool of the user's: no check
    header = (tmp_path / "run" / "metrics.csv").read_text().splitlines()[0].split(",")
    assert {"turns", "turn_tokens", "eval_turns", "eval_tool_calls"} <= set(header)
    samples = (tmp_path / "run" / "samples.txt").read_text()
    assert "assistant: " in samples and " | user: result | assistant: " in samples


def test_holes_cut_bootstraps_each_turn_from_the_value_after_the_reply(tmp_path, chat_model_dir):
    from ppo_objectives import train as T
    from ppo_objectives.train.rollout import next_valid_values

    seen = {}

    def callback(row, run):
        seen["holes"] = run.gae.holes

    cfg = T.TrainConfig(model=str(chat_model_dir), iterations=1, num_envs=4, max_new_tokens=48, max_turn_tokens=6,
                        holes="cut", out=str(tmp_path / "run"), no_progress=True, no_plot=True, **_jsonl(tmp_path))
    assert T.train(cfg, callbacks=[callback])[-1]["turns"] == 2.0 and seen["holes"] == "cut"
    g = torch.Generator().manual_seed(0)
    values, mask = torch.randn(5, 9, generator=g), torch.rand(5, 9, generator=g) < 0.6
    expected = torch.zeros(5, 9)
    for b in range(5):  # the loop: the value of the next valid token after each position
        for j in range(9):
            later = [k for k in range(j + 1, 9) if mask[b, k]]
            expected[b, j] = values[b, later[0]] if later else 0.0
    assert torch.equal(next_valid_values(values, mask), expected)


def test_a_tool_turn_that_does_not_fit_is_counted_and_warned_about(tmp_path, chat_model_dir, capsys):
    from ppo_objectives import train as T

    cfg = T.TrainConfig(model=str(chat_model_dir), iterations=1, num_envs=4, max_new_tokens=24, max_turn_tokens=6,
                        out=str(tmp_path / "run"), no_progress=True, no_plot=True, **_jsonl(tmp_path))
    row = T.train(cfg)[-1]
    assert row["env_turns_cut"] > 0 and row["turns"] == 1.0  # the tool's 23 tokens never fit after a 6-token turn
    assert "environment turns did not fit --max-new-tokens 24" in capsys.readouterr().err


def test_a_cold_critic_on_a_multi_turn_task_with_rare_rewards_trains_alone_first(tmp_path, chat_model_dir, capsys):
    from ppo_objectives import train as T

    inputs = _jsonl(tmp_path)
    (tmp_path / "r.py").write_text("def f(completion, answer, messages):\n    return 0.0\n")  # no episode rewarded
    common = dict(model=str(chat_model_dir), num_envs=4, max_new_tokens=48, max_turn_tokens=6,
                  no_progress=True, no_plot=True, **inputs)
    assert T.TrainConfig(advantage="rloo", **common).rare_reward_warmup == 0  # no critic to warm up
    runs = {}
    # the default warms up and says so once; a fixed --critic-warmup 2 does the same silently; 0 turns it off
    for name, flags, said in [("default", {}, 1), ("fixed", dict(critic_warmup=2, rare_reward_warmup=0), 0),
                              ("off", dict(rare_reward_warmup=0), 0)]:
        cfg = T.TrainConfig(out=str(tmp_path / name), iterations=2, **flags, **common)
        assert cfg.rare_reward_warmup == (2 if name == "default" else 0), name
        runs[name] = T.train(cfg)[1:]
        assert [r["turns"] for r in runs[name]] == [2.0, 2.0]  # every episode fit its tool turn
        err = capsys.readouterr().err
        assert err.count("critic starts cold") == said, name
        if said:
            assert ("WARNING ppo: iteration 1: reward 0.000 is below 0.05 and the critic starts cold: iterations 1-2 "
                    "train the critic alone before the first policy update (--rare-reward-warmup 2") in err
    # the decision changes when the policy starts to learn, nothing else: the same run as --critic-warmup 2
    for key in ("reward", "entropy", "loss_critic", "loss_objective", "kl_approx", "explained_variance"):
        assert [r[key] for r in runs["default"]] == pytest.approx([r[key] for r in runs["fixed"]], nan_ok=True), key
    ckpt = {name: torch.load(tmp_path / name / "checkpoint.pt", weights_only=False) for name in runs}
    assert ckpt["default"]["critic_warmup"] == {"iterations": 2}  # a --resume keeps the decision
    actor = {name: c["actor_model"] for name, c in ckpt.items()}
    assert all(torch.equal(t, actor["fixed"][k]) for k, t in actor["default"].items())
    # without it the actor steps from iteration 1 (a little, at the recipe's 2e-5)
    assert not all(torch.equal(t, actor["off"][k]) for k, t in actor["default"].items())


def test_a_run_whose_budget_cuts_most_conversations_says_so_where_the_user_looks(tmp_path, chat_model_dir, capsys):
    from ppo_objectives import train as T
    from ppo_objectives.train.text import CUT_MARK

    T.main(["--model", str(chat_model_dir), "--iterations", "2", "--num-envs", "4", "--max-new-tokens", "24",
            "--max-turn-tokens", "6", "--out", str(tmp_path / "run"), "--no-progress", "--no-plot",
            *(f"--{k.replace('_', '-')}={v}" for k, v in _jsonl(tmp_path).items())])
    out, err = capsys.readouterr()
    rows = T.read_metrics(tmp_path / "run" / "metrics.csv")[1:]
    assert all(2 * r["env_turns_cut"] > r["episodes"] and r["reward"] == 0.0 for r in rows)
    cut = int(rows[-1]["env_turns_cut"])
    for it in (1, 2):  # said on every iteration where most conversations were cut, not only the first
        assert re.search(rf"iteration {it}: \d+ environment turns did not fit --max-new-tokens 24 \(\d+ conversations\)", err)
    assert re.search(r"iteration 1: zero_reward \(reward 0.000; \d+ environment turns cut by the token budget "
                     r"\(env_turns_cut\): raise --max-new-tokens\)", err)
    assert "critic starts cold" not in err  # the budget is the cause, and the warnings above name it
    assert (f"MOST CONVERSATIONS CUT in 2 of 2 iterations (env_turns_cut {cut} of {rows[-1]['episodes']:g} in iteration "
            f"2): raise --max-new-tokens 24") in out
    samples = (tmp_path / "run" / "samples.txt").read_text()
    assert CUT_MARK in samples and "user: result" not in samples  # the reply the model never read is not shown


def test_a_users_tool_gets_a_budget_for_a_round_trip_and_an_answer():
    from ppo_objectives import train as T
    from ppo_objectives.train.config import TASK_DEFAULTS, TOOL_DEFAULTS

    flags = dict(task="jsonl", model="m", prompts="p.jsonl", reward="r.py:f")
    cfg = T.TrainConfig(**flags, tool="t.py:tool")
    assert (cfg.max_new_tokens, cfg.minibatches, cfg.rare_reward_warmup) == (80, 4, 2) == tuple(TOOL_DEFAULTS.values())
    assert TOOL_DEFAULTS["max_new_tokens"] == TASK_DEFAULTS["chat-calc"]["max_new_tokens"]
    assert T.TrainConfig(**flags).max_new_tokens == 16  # without a tool: the single-turn recipe
    assert T.TrainConfig(**flags).rare_reward_warmup == 0
    assert T.TrainConfig(**flags, tool="t.py:tool", max_new_tokens=32).max_new_tokens == 32  # a flag wins
    assert "--tool 80]" in " ".join(T.build_parser().format_help().split())


def test_a_single_turn_run_has_no_turn_columns(tmp_path, chat_model_dir):
    from ppo_objectives import train as T

    cfg = T.TrainConfig(model=str(chat_model_dir), task="chat-add1", iterations=1, num_envs=4, max_new_tokens=4,
                        out=str(tmp_path / "run"), no_progress=True, no_plot=True)
    row = T.train(cfg)[0]
    assert "turns" not in row and "eval_turns" not in row


@pytest.mark.parametrize("argv, flag, fix", [
    (["--task", "chat-add1", "--tool", "t.py:tool"], "--tool", "a single-turn task; use --task jsonl or drop --tool"),
    (["--task", "chat-calc", "--tool", "t.py:tool"], "--tool", "which has its own calc tool"),
    (["--task", "chat-add1", "--max-turns", "2"], "--max-turns", "--task chat-add1 has one turn"),
    (["--task", "chat-calc", "--max-turn-tokens", "90"], "--max-turn-tokens", "exceeds --max-new-tokens 80"),
    (["--task", "chat-calc", "--max-turns", "-1"], "--max-turns", "must be an int >= 0"),
    (["--task", "chat-add1", "--holes", "cut"], "--holes", "--task chat-add1 has one turn"),
    (["--task", "reverse", "--tool", "t.py:reply"], "--tool", "but --task is reverse, a single-turn task"),
    (["--task", "reverse", "--max-turns", "2"], "--max-turns", "--task reverse has one turn"),
    (["--task", "add", "--max-turn-tokens", "4"], "--max-turn-tokens", "--task add has one turn"),
    (["--task", "chat-calc", "--holes", "cut", "--advantage", "grpo"], "--holes", "--advantage grpo has no GAE"),
    (["--task", "chat-add1", "--rare-reward-warmup", "2"], "--rare-reward-warmup", "--task chat-add1 has one turn"),
    (["--task", "chat-calc", "--rare-reward-warmup", "-1"], "--rare-reward-warmup", "must be an int >= 0"),
    (["--task", "chat-calc", "--rare-reward-warmup", "2", "--advantage", "rloo"], "--rare-reward-warmup",
     "configure the critic, but --advantage rloo has none"),
])
def test_a_misused_turn_flag_is_one_error_line(capsys, tmp_path, chat_model_dir, argv, flag, fix):
    from ppo_objectives import train as T

    with pytest.raises(SystemExit) as exc:
        T.main(["--model", str(chat_model_dir), "--out", str(tmp_path / "run"), *argv])
    assert exc.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert flag in line and fix in line, line


@pytest.mark.parametrize("body, fix", [
    ("def other(messages, answer):\n    return None\n", "has no function 'tool'"),
    ("def tool(:\n", "importing"),
    ("def tool(messages):\n    return None\n", "cannot be called as tool(messages, **['answer'])"),
])
def test_a_bad_tool_file_is_one_error_line_naming_it(capsys, tmp_path, chat_model_dir, body, fix):
    from ppo_objectives import train as T

    flags = _jsonl(tmp_path, body)
    argv = [x for k, v in flags.items() for x in (f"--{k.replace('_', '-')}", v)]
    with pytest.raises(SystemExit):
        T.main(["--model", str(chat_model_dir), "--out", str(tmp_path / "run"), *argv])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--tool" in line and "t.py" in line and fix in line, line

"""Text tasks on a real tokenizer: prompts, rewards, bad input, the env, the job, the export (tiny models)."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from ppo_objectives import testing as K
from ppo_objectives.llm.env import TokenLMEnv
from ppo_objectives.train.text import (
    ARITHMETIC_TASKS,
    TextExample,
    TextTask,
    arithmetic_examples,
    evaluate,
    load_function,
    number_reward,
    read_prompts_jsonl,
)

pytest.importorskip("transformers")


def _task(tok, examples=None, reward=number_reward, M=6):
    examples = examples or [TextExample("What is 1 + 2?", {"answer": 3}), TextExample("What is 10 + 5?", {"answer": 15})]
    return TextTask(examples, reward, tok, max_new_tokens=M)


# --------------------------------------------------------------------------- #
# The built-in tasks and their reward
# --------------------------------------------------------------------------- #


def test_the_jobs_text_tasks_are_the_built_in_ones_and_jsonl():
    from ppo_objectives.train.config import TEXT_TASKS  # the --task choices; config imports no task module

    assert TEXT_TASKS == (*ARITHMETIC_TASKS, "chat-calc", "chat-calc-sum", "chat-word", "jsonl")


def test_chat_word_split_is_disjoint_seeded_and_its_answers_follow_the_stories():
    import re

    from ppo_objectives.train.word import ASK, ONE_SHOT, STORIES, word_examples

    train, held_out = word_examples("train"), word_examples("eval")
    assert len(held_out) == 200 and word_examples("eval") == held_out
    assert not {e.prompt[-1]["content"] for e in train} & {e.prompt[-1]["content"] for e in held_out}
    assert [e.prompt for e in word_examples("eval", split_seed=1)] != [e.prompt for e in held_out]
    shot_question = ONE_SHOT[0]["content"]
    assert {e.prompt[-1]["content"] for e in train + held_out}.isdisjoint({shot_question})
    assert re.findall(r"\d+", ONE_SHOT[1]["content"])[-1] == "25"  # the worked answer is right: 2 * 14 - 3
    minus = plus = 0
    for e in train + held_out:  # every answer recomputed from the numbers of its story, independently
        text = e.prompt[-1]["content"]
        assert text.endswith(ASK) and e.prompt[:-1] == ONE_SHOT
        x, y, c = (int(n) for n in re.findall(r"\d+", text))
        taken = any(w in text for w in ("gives away", "are taken"))
        assert e.fields["answer"] == x * y + (-c if taken else c) and e.fields["answer"] > 0
        minus, plus = minus + taken, plus + (not taken)
    assert minus and plus and len(STORIES) == 4


@pytest.mark.parametrize("completion, answer, want", [
    ("7 * 12 = 84, 84 + 15 = 99. The answer is 99.", 99, 1.0), ("84 + 15 = 99", 99, 1.0), ("99", 99, 1.0),
    ("The answer is 99, since 7 * 12 = 84", 99, 0.0), ("", 99, 0.0), ("a lot", 99, 0.0), ("1,099", 1099, 1.0),
    ("12 x 8 = 96\n96 - 5 = 91\nSo 91 chairs.", 91, 1.0),
])  # fmt: skip
def test_final_number_reward_reads_the_last_number_of_the_whole_completion(completion, answer, want):
    from ppo_objectives.train.word import final_number_reward

    assert final_number_reward(completion, answer) == want


def test_the_job_runs_chat_word_and_its_budget_is_longer(tmp_path, chat_model_dir, monkeypatch):
    from ppo_objectives import train as T
    from ppo_objectives.train import text_job, word

    # the job's wiring on 8 problems of each split (the splits themselves are tested above)
    monkeypatch.setattr(text_job, "word_examples", lambda split: word.word_examples(split)[:8])

    assert T.TrainConfig(model=str(chat_model_dir), task="chat-word").max_new_tokens == 64
    cfg = T.TrainConfig(model=str(chat_model_dir), task="chat-word", iterations=1, num_envs=4, max_new_tokens=4,
                        out=str(tmp_path / "run"), no_progress=True, no_plot=True)
    rows = T.train(cfg)
    assert len(rows) == 2 and rows[-1]["eval_greedy"] == rows[-1]["eval_greedy"]  # evaluated on the held-out split
    assert "Work it out step by step" in (tmp_path / "run" / "samples.txt").read_text()


@pytest.mark.parametrize("name", list(ARITHMETIC_TASKS))
def test_arithmetic_split_is_disjoint_seeded_and_complete(name):
    lo, hi, n_eval = ARITHMETIC_TASKS[name]
    train, held_out = arithmetic_examples(name, "train"), arithmetic_examples(name, "eval")
    assert len(held_out) == n_eval and len(train) + n_eval == (hi - lo + 1) ** 2
    assert not {e.prompt for e in train} & {e.prompt for e in held_out}  # held-out never trained on
    assert [e.prompt for e in held_out] == [e.prompt for e in arithmetic_examples(name, "eval")]  # seeded
    assert [e.prompt for e in held_out] != [e.prompt for e in arithmetic_examples(name, "eval", split_seed=1)]
    for e in held_out:
        a, b = (int(x) for x in e.prompt[len("What is "):-1].split(" + "))
        assert e.fields == {"answer": a + b}


@pytest.mark.parametrize("completion, answer, want", [
    ("3 + 5 = 8", 8, 1.0), ("3 + 5 = 8.", 8, 1.0), ("The answer is 8.", 8, 1.0), ("8", 8, 1.0),
    ("3 + 5 = 9", 8, 0.0), ("To add 3 and 5, you", 8, 0.0), ("", 8, 0.0), ("3 + 5\n= 8", 8, 0.0),
    ("12 + 30 = 42, so", 42, 1.0), ("1,000", 1000, 1.0), ("  7 is it", 7, 1.0), ("= 5 then 6", 5, 1.0),
])  # fmt: skip
def test_number_reward_reads_the_first_line(completion, answer, want):
    # first number after "=" on the first line, else the last number of that line
    assert number_reward(completion, answer) == want


def test_arithmetic_bad_arguments():
    with pytest.raises(ValueError, match="name='chat-mul' is unknown"):
        arithmetic_examples("chat-mul", "train")
    with pytest.raises(ValueError, match="split='test' must be 'train' or 'eval'"):
        arithmetic_examples("chat-add1", "test")


# --------------------------------------------------------------------------- #
# JSONL prompts and reward files: every bad input names the file, the line and the fix
# --------------------------------------------------------------------------- #


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_read_prompts_jsonl_strings_and_messages(tmp_path):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]
    path = _write(tmp_path, "p.jsonl", json.dumps({"prompt": "Hi", "answer": 1, "tag": "x"}) + "\n"
                  + json.dumps({"prompt": msgs, "answer": 4}) + "\n")
    a, b = read_prompts_jsonl(path)
    assert a.prompt == "Hi" and a.fields == {"answer": 1, "tag": "x"} and a.source == f"{path}:1"
    assert b.messages() == msgs and b.fields == {"answer": 4} and b.source == f"{path}:2"


@pytest.mark.parametrize("text, match", [
    ('{"prompt": "a"}\n\n{"prompt": "b"}\n', r":2: the line is empty; remove it"),
    ('{"prompt": "a"}\n{"prompt": "b",}\n', r":2: not valid JSON \(.*column 16\); write one JSON object per line"),
    ('[1, 2]\n', r":1: a JSON list, not an object"),
    ('{"question": "a", "answer": 1}\n', r":1: no 'prompt' field \(fields: \['answer', 'question'\]\); add the prompt"),
    ('{"prompt": 5}\n', r":1: 'prompt' is 5; give a non-empty string or a list of chat messages"),
    ('{"prompt": ""}\n', r":1: 'prompt' is ''"),
    ('{"prompt": []}\n', r":1: 'prompt' is an empty list of messages"),
    ('{"prompt": [{"role": "user"}]}\n', r":1: message 0 of 'prompt' is .*role.*content"),
    ('', r"the prompts file is empty"),
])  # fmt: skip
def test_read_prompts_jsonl_bad_lines(tmp_path, text, match):
    path = _write(tmp_path, "bad.jsonl", text)
    with pytest.raises(ValueError, match=match):
        read_prompts_jsonl(path)


def test_read_prompts_jsonl_refuses_a_role_that_is_not_a_chat_role(tmp_path):
    good = {"prompt": [{"role": "user", "content": "2 + 2?"}, {"role": "tool", "content": "4"}], "answer": 4}
    bad = {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "usr", "content": "2 + 2?"}], "answer": 4}
    path = _write(tmp_path, "roles.jsonl", json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}:2: message 1 of 'prompt' has role 'usr', which is "
                                         r"not a chat role \(.*\); use one of 'system', 'user', 'assistant', 'tool'$"):
        read_prompts_jsonl(path)
    path.write_text(json.dumps(good) + "\n")
    assert [m["role"] for m in read_prompts_jsonl(path)[0].messages()] == ["user", "tool"]


def test_read_prompts_jsonl_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such prompts file"):
        read_prompts_jsonl(tmp_path / "nope.jsonl")


def test_load_function_and_its_errors(tmp_path):
    path = _write(tmp_path, "r.py", "import math\ndef exact(completion, answer):\n    return float(completion == str(answer))\n")
    assert load_function(f"{path}:exact")("4", answer=4) == 1.0
    with pytest.raises(ValueError, match="must be FILE.py:function"):
        load_function(str(path))
    with pytest.raises(FileNotFoundError, match=r"--reward .*missing\.py:exact: no such file .*missing\.py; give "
                                              r"FILE\.py:function"):
        load_function(f"{tmp_path / 'missing.py'}:exact")
    with pytest.raises(ValueError, match=r"has no function 'score' \(its functions: \['exact'\]\)"):
        load_function(f"{path}:score")
    broken = _write(tmp_path, "broken.py", "raise RuntimeError('boom')\n")
    with pytest.raises(ImportError, match="importing .*broken.py failed: RuntimeError: boom"):
        load_function(f"{broken}:f")


def test_reward_signature_is_checked_against_every_line_before_any_rollout(tok):
    def reward(completion, answer):
        return 0.0

    examples = [TextExample("a", {"answer": 1}, "f.jsonl:1"), TextExample("b", {"answer": 1, "extra": 2}, "f.jsonl:2")]
    with pytest.raises(TypeError, match=r"f.jsonl:2: the reward reward\(completion, answer\) cannot be called as "
                                        r"reward\(completion, \*\*\['answer', 'extra'\]\)"):
        TextTask(examples, reward, tok, max_new_tokens=4)


@pytest.mark.parametrize("value, error, match", [
    (float("nan"), ValueError, r"f.jsonl:1: the reward .* returned nan for the completion .*; it must return a finite float"),
    ("1.0", ValueError, r"returned '1.0'"),
    (None, ValueError, r"returned None"),
    (True, ValueError, r"returned True"),
    (ZeroDivisionError("x"), RuntimeError, r"f.jsonl:1: the reward .* raised ZeroDivisionError: x on the completion"),
])  # fmt: skip
def test_a_bad_reward_value_names_the_prompt_and_the_completion(tok, value, error, match):
    def reward(completion, answer):
        if isinstance(value, Exception):
            raise value
        return value

    task = TextTask([TextExample("What is 1 + 2?", {"answer": 3}, "f.jsonl:1")], reward, tok, max_new_tokens=4)
    with pytest.raises(error, match=match):
        task.score(["3"], torch.tensor([0]))


# --------------------------------------------------------------------------- #
# The task on the env: chat template, left padding, EOS, full vocabulary, decoded reward
# --------------------------------------------------------------------------- #


def test_a_text_task_follows_the_env_task_protocol(tok):
    from ppo_objectives.llm.env import LMTask

    assert isinstance(_task(tok), LMTask)


def test_prompts_are_the_chat_template_left_padded(tok):
    task = _task(tok)
    for i, ex in enumerate(task.examples):
        want = tok.apply_chat_template(ex.messages(), tokenize=False, add_generation_prompt=True)
        ids = task.prompt_ids[i][task.prompt_mask[i]]
        assert tok.decode(ids) == want
        n = ids.numel()
        assert not task.prompt_mask[i, : task.prompt_len - n].any()  # left padding
        assert (task.prompt_ids[i, : task.prompt_len - n] == tok.pad_token_id).all()
    assert task.prompt_len == int(task.prompt_mask.sum(1).max())
    assert task.eos_id == tok.convert_tokens_to_ids("<|im_end|>") and task.vocab_size == len(tok)


def test_a_tokenizer_without_chat_template_or_eos_is_refused(tok):
    bare = K.tiny_chat_tokenizer()
    bare.chat_template = None
    with pytest.raises(ValueError, match="the tokenizer has no chat template.*chat_template=False"):
        _task(bare)
    raw = TextTask([TextExample("What is 1 + 2?", {"answer": 3})], number_reward, bare, max_new_tokens=4,
                   chat_template=False)
    assert tok.decode(raw.prompt_ids[0][raw.prompt_mask[0]]) == "What is 1 + 2?"
    no_eos = K.tiny_chat_tokenizer()
    no_eos.eos_token = None
    with pytest.raises(ValueError, match="the tokenizer has no eos_token_id"):
        _task(no_eos)


def test_env_ends_at_eos_mid_batch_and_scores_the_decoded_completion(tok):
    task = _task(tok, M=6)
    V = len(tok) + 64  # the model's vocabulary may exceed the tokenizer's: every sampled id is a valid action
    env = TokenLMEnv.from_task(task, num_envs=2, vocab_size=V, seed=0)
    td = env.reset()
    pid = td["prompt_id"].clone()
    answers = [str(task.examples[i].fields["answer"]) for i in pid.tolist()]
    scripts = [tok(a, add_special_tokens=False)["input_ids"] + [task.eos_id] for a in answers]
    scripts[1] = tok("0 0 0 0 0 0", add_special_tokens=False)["input_ids"][:6]  # row 1 never stops
    rewards, done_at = torch.zeros(2), [None, None]
    for step in range(6):
        action = [s[step] if step < len(s) else task.eos_id for s in scripts]
        td["action"] = torch.tensor(action)
        td = env.step(td)
        nxt = td["next"]
        for row in range(2):
            if nxt["done"][row] and done_at[row] is None:
                done_at[row], rewards[row] = step, nxt["reward"][row, 0]
        assert torch.equal(nxt["prompt_id"], pid)
        td = nxt
        if all(d is not None for d in done_at):
            break
    assert done_at[0] == len(scripts[0]) - 1 and rewards[0] == 1.0  # EOS mid-batch: terminated, right answer
    assert done_at[1] == 5 and rewards[1] == 0.0 and td["truncated"][1]  # budget reached


def test_prompt_ids_come_from_the_source():
    calls = []

    def reward(p, pm, r, rm, prompt_id):
        calls.append(prompt_id.clone())
        return torch.zeros(len(prompt_id))

    lists = [[3, 4], [5], [6, 7]]
    env = TokenLMEnv(lists, reward, num_envs=4, prompt_len=3, max_new_tokens=1, vocab_size=10, eos_id=1, seed=0)
    td = env.reset()
    assert td["prompt_id"].tolist() == [0, 1, 2, 0]  # a finite source: the index, cycled
    td["action"] = torch.ones(4, dtype=torch.long)
    env.step(td)
    assert calls[0].tolist() == [0, 1, 2, 0]  # a reward_fn with a prompt_id parameter receives them
    sampled = TokenLMEnv(lambda k, g: torch.full((k, 2), 3), lambda p, pm, r, rm: torch.zeros(len(p)), num_envs=3,
                         prompt_len=2, max_new_tokens=1, vocab_size=10, eos_id=1)
    assert sampled.reset()["prompt_id"].tolist() == [0, 1, 2]  # a sampler without ids: the draw number
    assert sampled.reset()["prompt_id"].tolist() == [3, 4, 5]


def test_sampler_prompt_id_shape_is_checked():
    def sampler(k, g):
        return {"input_ids": torch.full((k, 2), 3), "prompt_id": torch.zeros(k + 1, dtype=torch.long)}

    env = TokenLMEnv(sampler, lambda *a: torch.zeros(len(a[0])), num_envs=2, prompt_len=2, max_new_tokens=1,
                     vocab_size=10, eos_id=1, seed=None)
    with pytest.raises(ValueError, match=r"prompt_id of shape \(3,\) for k=2; return one id per prompt"):
        env.reset()


# --------------------------------------------------------------------------- #
# A tiny Llama through the collector, evaluation, the job, the export
# --------------------------------------------------------------------------- #


def test_greedy_evaluation_is_the_argmax_decode_of_the_full_forward(tok, chat_model_dir):
    from ppo_objectives.train.pretrained import load_causal_lm

    lm = load_causal_lm(chat_model_dir).eval()
    task = _task(tok, M=4)
    res = evaluate(lm, task, greedy=True)
    for i, text in enumerate(res.completions):  # an independent decode: argmax of the whole sequence, step by step
        ids = task.prompt_ids[i][task.prompt_mask[i]][None]
        out = []
        for _ in range(4):
            nxt = int(lm(ids).logits[0, -1].argmax())
            out.append(nxt)
            if nxt == task.eos_id:
                break
            ids = torch.cat([ids, torch.tensor([[nxt]])], 1)
        assert text == tok.decode(out, skip_special_tokens=True)
    assert res.accuracy == sum(res.rewards) / len(res.rewards)


def _run_job(tmp_path, model_dir, **kw):
    from ppo_objectives import train as T

    cfg = dict(model=str(model_dir), task="chat-add1", iterations=2, num_envs=4, max_new_tokens=4, eval_every=1,
               out=str(tmp_path / "run"), no_progress=True, no_plot=True, save_every=2)
    cfg.update(kw)
    return T.train(T.TrainConfig(**cfg)), tmp_path / "run"


def test_job_on_a_text_task_evaluates_logs_samples_and_exports(tmp_path, chat_model_dir):
    from transformers import AutoModelForCausalLM

    from ppo_objectives.llm.hf import HFCausalLMAdapter
    from ppo_objectives.llm.readouts import ResponseLogProbs
    from ppo_objectives.train import read_metrics
    from ppo_objectives.train.pretrained import load_tokenizer

    rows, out = _run_job(tmp_path, chat_model_dir)
    assert [r["iteration"] for r in rows] == [0, 1, 2]  # row 0: the model before training
    assert all(0.0 <= r["eval_greedy"] <= 1.0 and 0.0 <= r["eval_sampled"] <= 1.0 for r in rows)
    assert math.isnan(rows[0]["reward"]) and rows[1]["episodes"] >= 4
    assert [r["iteration"] for r in read_metrics(out / "metrics.csv")] == [0, 1, 2]
    samples = (out / "samples.txt").read_text()
    assert samples.count("=== iteration") == 3 and "greedy" in samples and "[chat-add1 #" in samples
    # the export: a plain HF directory with the tokenizer and chat template, whose log-probs are the actor's
    ckpt = torch.load(out / "checkpoint.pt", weights_only=False)
    hf = AutoModelForCausalLM.from_pretrained(out / "hf", local_files_only=True)
    tok = load_tokenizer(out / "hf")
    assert tok.chat_template == K.CHAT_TEMPLATE and tok.eos_token == "<|im_end|>"
    actor = HFCausalLMAdapter.from_pretrained(str(chat_model_dir))
    actor.load_state_dict(ckpt["actor_model"])
    ids = torch.randint(3, len(tok), (3, 12))
    am = torch.ones(3, 12, dtype=torch.bool)
    want, _ = ResponseLogProbs(actor, 5, from_hidden=True)(ids, am)
    got, _ = ResponseLogProbs(HFCausalLMAdapter(hf), 5, from_hidden=True)(ids, am)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    # generate() on the export reproduces the job's final greedy accuracy
    held_out = TextTask(arithmetic_examples("chat-add1", "eval"), number_reward, tok, max_new_tokens=4)
    gen = hf.generate(input_ids=held_out.prompt_ids, attention_mask=held_out.prompt_mask.long(), max_new_tokens=4,
                      do_sample=False, eos_token_id=held_out.eos_id, pad_token_id=held_out.pad_id)
    resp = gen[:, held_out.prompt_len:]
    resp_mask = ((resp == held_out.eos_id).long().cumsum(1) - (resp == held_out.eos_id).long()) == 0
    acc = float(held_out.score(held_out.completions(resp, resp_mask), torch.arange(len(held_out.examples))).mean())
    assert acc == pytest.approx(rows[-1]["eval_greedy"])


def test_job_with_user_prompts_and_reward_file(tmp_path, chat_model_dir):
    prompts = tmp_path / "train.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"What is {a} + 1?", "answer": a + 1}) + "\n" for a in range(5)))
    held = tmp_path / "eval.jsonl"
    held.write_text(json.dumps({"prompt": [{"role": "user", "content": "What is 9 + 1?"}], "answer": 10}) + "\n")
    reward = tmp_path / "reward.py"
    reward.write_text("def close(completion, answer):\n    return -abs(len(completion) - answer) / 10.0\n")
    rows, out = _run_job(tmp_path, chat_model_dir, task="jsonl", prompts=str(prompts), reward=f"{reward}:close",
                         eval_prompts=str(held), iterations=1)
    assert rows[-1]["reward"] <= 0.0 and not math.isnan(rows[-1]["eval_greedy"])
    assert f"[{held}:1] What is 9 + 1?" in (out / "samples.txt").read_text()


def test_held_out_prompts_that_are_training_prompts_are_refused(tmp_path, chat_model_dir):
    prompts = tmp_path / "train.jsonl"
    prompts.write_text(json.dumps({"prompt": "What is 1 + 1?", "answer": 2}) + "\n")
    held = tmp_path / "eval.jsonl"
    held.write_text(json.dumps({"prompt": "What is 1 + 1?", "answer": 2}) + "\n")
    reward = tmp_path / "reward.py"
    reward.write_text("def f(completion, answer):\n    return 0.0\n")
    with pytest.raises(ValueError, match=r"held-out prompt at .*eval.jsonl:1 is also a training prompt \(.*train.jsonl:1\)"):
        _run_job(tmp_path, chat_model_dir, task="jsonl", prompts=str(prompts), reward=f"{reward}:f",
                 eval_prompts=str(held))


def test_a_resumed_runs_summary_gives_the_held_out_numbers_from_the_runs_start(tmp_path, chat_model_dir, capsys):
    from ppo_objectives import train as T

    argv = ["--model", str(chat_model_dir), "--task", "chat-add1", "--num-envs", "4", "--max-new-tokens", "4",
            "--eval-every", "1", "--save-every", "1", "--out", str(tmp_path / "run"), "--no-progress", "--no-plot"]
    T.main([*argv, "--iterations", "1"])
    capsys.readouterr()
    T.main([*argv, "--iterations", "2", "--resume"])
    rows = T.read_metrics(tmp_path / "run" / "metrics.csv")
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert (f"held-out greedy {rows[0]['eval_greedy']:.3f} -> {rows[2]['eval_greedy']:.3f}, sampled "
            f"{rows[0]['eval_sampled']:.3f} -> {rows[2]['eval_sampled']:.3f} (iteration 0 -> 2)") in summary
    assert "1 iterations in" in summary  # the iterations this process ran


def test_text_job_resumes_exactly(tmp_path, chat_model_dir):
    from ppo_objectives import train as T

    straight, _ = _run_job(tmp_path / "a", chat_model_dir, iterations=3, save_every=1)
    _run_job(tmp_path / "b", chat_model_dir, iterations=2, save_every=1)
    _, out = _run_job(tmp_path / "b", chat_model_dir, iterations=3, save_every=1, resume=True)
    resumed = T.read_metrics(out / "metrics.csv")
    for a, b in zip(straight, resumed):
        for k, v in a.items():
            if not k.endswith("_s") and k != "tokens_per_s":
                assert v == b[k] or (math.isnan(v) and math.isnan(b[k])), (a["iteration"], k)


@pytest.mark.parametrize("kw, match", [
    (dict(task="chat-add1", model=""), r"--task chat-add1 is a text task: it needs --model DIR"),
    (dict(task="jsonl", prompts="p.jsonl"), r"--task jsonl needs --reward"),
    (dict(task="reverse", prompts="p.jsonl"), r"--prompts belong to --task jsonl"),
    (dict(task="chat-add1", model="m", warmup_steps=10), r"--warmup-steps 10: the warm start teaches the toy"),
    (dict(task="chat-add1", model="m", workers=2), r"--workers 2 --collector-backend process with a text task"),
    (dict(task="chat-add1", model="m", fsdp=True), r"--fsdp with a text task is not supported"),
    (dict(task="reverse", max_new_tokens=8), r"--max-new-tokens is for text tasks"),
    (dict(policy_lmbda=0.9, length_alpha=1.0), r"--policy-lmbda and --length-alpha both set"),
    (dict(time_limit=-1.0), r"time_limit=-1.0 must be a number of minutes >= 0"),
])  # fmt: skip
def test_text_job_configuration_errors(kw, match):
    from ppo_objectives import train as T

    with pytest.raises(ValueError, match=match):
        T.TrainConfig(**kw)


def test_text_task_needs_the_checkpoint_tokenizer(tmp_path, chat_model_dir):
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(chat_model_dir, bare)
    for f in bare.iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            f.unlink()
    with pytest.raises(ValueError, match="needs the tokenizer of --model .*bare.*has none"):
        _run_job(tmp_path, bare)


def test_pretrained_recipe_defaults_fill_unset_flags():
    from ppo_objectives import train as T

    toy, text = T.TrainConfig(), T.TrainConfig(task="chat-add1", model="m")
    for name, value in T.RECIPES["toy"].items():
        assert getattr(toy, name) == value
    for name, value in T.RECIPES["pretrained"].items():
        assert getattr(text, name) == value
    assert T.TrainConfig(task="chat-add1", model="m", lr=1e-4).lr == 1e-4  # a flag given wins
    args = T.build_parser().parse_args(["--task", "chat-add2", "--model", "m", "--no-shared-trunk"])
    cfg = T.TrainConfig(**vars(args))
    assert cfg.shared_trunk is False and cfg.num_envs == T.RECIPES["pretrained"]["num_envs"]


def test_a_lora_run_trains_the_adapters_only_and_exports_them_merged(tmp_path, chat_model_dir):
    pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    from ppo_objectives import train as T
    from ppo_objectives.llm.hf import HFCausalLMAdapter
    from ppo_objectives.llm.lora import add_lora

    # a reward that is never 0 and differs between completions: the first update has a policy gradient, whatever
    # the tiny random model samples (chat-add1's exact-answer reward is 0 for every sample of some versions of it)
    prompts = tmp_path / "train.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"What is {a} + 1?"}) + "\n" for a in range(5)))
    reward = tmp_path / "reward.py"
    reward.write_text("def longer(completion):\n    return 1.0 + len(completion) / 10.0\n")
    rows, out = _run_job(tmp_path, chat_model_dir, task="jsonl", prompts=str(prompts), reward=f"{reward}:longer",
                         lora_rank=2, iterations=2, kl_reward_coeff=0.05)
    assert rows[1]["reward"] >= 1.0 and rows[1]["loss_objective"] != 0.0
    assert rows[-1]["kl_ref"] != 0.0  # the reference (adapters off) is no longer the actor (adapters on)
    ckpt = torch.load(out / "checkpoint.pt", weights_only=False)
    assert ckpt["reference"] == {} and ckpt["config"]["lr"] == T.config.LORA_LR
    lm = add_lora(HFCausalLMAdapter.from_pretrained(str(chat_model_dir)), rank=2)
    start = {n: p.clone() for n, p in lm.state_dict().items()}
    lm.load_state_dict(ckpt["actor_model"])
    moved = {n for n, p in lm.state_dict().items() if not torch.equal(p, start[n])}
    assert moved and all("lora_" in n for n in moved)  # the base weights never moved
    hf = AutoModelForCausalLM.from_pretrained(out / "hf", local_files_only=True)
    assert not any("lora_" in n for n in hf.state_dict())
    ids, am = torch.randint(3, 100, (2, 9)), torch.ones(2, 9, dtype=torch.bool)
    torch.testing.assert_close(HFCausalLMAdapter(hf)(ids, am).logits, lm(ids, am).logits, rtol=1e-5, atol=1e-5)


def test_a_lora_run_resumes_exactly(tmp_path, chat_model_dir):
    pytest.importorskip("peft")
    from ppo_objectives import train as T

    straight, _ = _run_job(tmp_path / "a", chat_model_dir, lora_rank=2, iterations=2, save_every=1, eval_every=2)
    _run_job(tmp_path / "b", chat_model_dir, lora_rank=2, iterations=1, save_every=1, eval_every=2)
    _, out = _run_job(tmp_path / "b", chat_model_dir, lora_rank=2, iterations=2, save_every=1, eval_every=2,
                      resume=True)
    resumed = T.read_metrics(out / "metrics.csv")
    assert [r["iteration"] for r in resumed] == [0, 1, 2]
    for a, b in zip(straight[1:], resumed[1:]):
        for k in ("reward", "loss_objective", "loss_critic", "kl_ref"):
            assert a[k] == b[k], (a["iteration"], k)
    assert straight[-1]["eval_greedy"] == resumed[-1]["eval_greedy"]  # the interrupted run evaluated at its end too


@pytest.mark.parametrize("kw, match", [
    (dict(task="reverse", lora_rank=4), r"--lora-rank puts adapters on a pretrained model's projections, but --task "
                                        r"reverse is a toy digit task"),
    (dict(task="chat-add1", model="m", lora_rank=4, shared_trunk=False), r"--lora-rank with --no-shared-trunk"),
    (dict(task="chat-add1", model="m", lora_rank=-1), r"TrainConfig lora_rank=-1"),
])  # fmt: skip
def test_lora_configuration_errors(kw, match):
    from ppo_objectives import train as T

    with pytest.raises(ValueError, match=match):
        T.TrainConfig(**kw)


def test_lora_takes_its_own_learning_rate_unless_one_is_given():
    from ppo_objectives import train as T

    assert T.TrainConfig(task="chat-add1", model="m", lora_rank=8).lr == T.config.LORA_LR
    assert T.TrainConfig(task="chat-add1", model="m", lora_rank=8, lr=3e-5).lr == 3e-5
    assert T.TrainConfig(task="chat-add1", model="m").lr == T.RECIPES["pretrained"]["lr"]


def test_lora_without_peft_is_refused_before_anything_loads(tmp_path, chat_model_dir, monkeypatch):
    from ppo_objectives import train as T
    from ppo_objectives.train import launch

    monkeypatch.setattr(launch, "_missing", lambda module: module == "peft")
    cfg = T.TrainConfig(model=str(chat_model_dir), task="chat-add1", lora_rank=2, out=str(tmp_path / "run"),
                        no_progress=True, no_plot=True)
    with pytest.raises(ImportError, match=r'--lora-rank 2 needs peft, which is not installed: pip install -e "\.\[lora\]"'):
        T.check_launch(cfg)
    assert not (tmp_path / "run").exists()

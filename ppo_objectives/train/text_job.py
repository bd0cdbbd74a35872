"""What the training job adds for text tasks on a pretrained checkpoint (internal to ``train``).

The tasks from the flags (``--task chat-add1 | chat-add2 | chat-calc | chat-calc-sum | chat-word | jsonl``, ``--tool``), the held-out
evaluation every ``--eval-every`` iterations with its samples log, and the export
of the trained actor as a Hugging Face directory. ``ppo_objectives/train/``
calls these; the text tasks themselves are :mod:`ppo_objectives.train.text`.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from pathlib import Path

import torch

from ppo_objectives.llm.lora import merged_hf_model
from ppo_objectives.train.calc import calc_examples, calc_tool, tool_calls_well_formed
from ppo_objectives.train.calc_sum import calc_sum_calls_well_formed, calc_sum_examples, calc_sum_tool
from ppo_objectives.train.pretrained import (
    CONVERTER,
    check_checkpoint_dir,
    has_chat_template,
    has_tokenizer,
    load_tokenizer,
)
from ppo_objectives.train.text import (
    TextTask,
    arithmetic_examples,
    check_reward_signature,
    check_tool_signature,
    evaluate,
    load_function,
    number_reward,
    read_prompts_jsonl,
)
from ppo_objectives.train.word import final_number_reward, word_examples

#: The held-out sampling generator is seeded with ``--seed`` + this (a stream apart from the training run's).
EVAL_SEED_OFFSET = 7919

#: Held-out prompt -> completion pairs written to ``samples.txt`` at each evaluation.
SAMPLES_SHOWN = 6

#: The evaluation columns a text run adds to ``metrics.csv`` (nan on iterations without an evaluation).
EVAL_COLUMNS = ("eval_greedy", "eval_sampled", "eval_s")

#: The evaluation columns of a multi-turn run: the greedy conversations' assistant turns, and (``chat-calc``,
#: ``chat-calc-sum``) the fraction of them whose tool calls were all well-formed, at least one (nan for a ``--tool`` of
#: your own).
EVAL_TURN_COLUMNS = ("eval_turns", "eval_tool_calls")


#: ``--eval-prompts none``: no held-out evaluation (as when the flag is not given).
NO_EVAL = "none"

#: The flags that name input files whose content a checkpoint records (:func:`input_sha256`).
INPUT_FILES = ("prompts", "reward", "eval_prompts", "tool")


def check_inputs(cfg) -> None:
    """Refuse, before anything loads, a ``--model`` that is no checkpoint directory (missing, a file, a Hub id,
    no ``config.json``, or no tokenizer where the run needs one) and text-task inputs the run cannot read: the
    ``--prompts`` and ``--eval-prompts`` files, the ``--reward`` function and its parameters, a held-out prompt
    that is also a training prompt. The launch check of ``python -m ppo_objectives.train`` calls it, so each is
    an ``error:`` line."""
    if not cfg.model:
        return
    check_checkpoint_dir(cfg.model)
    if cfg.recipe == "toy":
        if cfg.token_map == "tokenizer" and not has_tokenizer(cfg.model):
            raise ValueError(f"--model {cfg.model} has no tokenizer (tokenizer.json / tokenizer_config.json), so the "
                             f"toy task's tokens cannot be found in its vocabulary; save the tokenizer beside the "
                             f"checkpoint, or pass --token-map identity to map task token i to model token i on "
                             f"purpose")
        return
    if not has_tokenizer(cfg.model):
        raise _no_tokenizer(cfg)
    if cfg.chat_template and not has_chat_template(cfg.model):
        raise ValueError(
            f"--model {cfg.model}: its tokenizer has no chat template, so --task {cfg.task}'s prompts cannot be "
            f"rendered as a chat; give --no-chat-template to tokenize string prompts as they are (a base model), or "
            f"a model with a chat template ({CONVERTER}; a tiny one for a smoke run: python -m "
            f"ppo_objectives.pretrained --chat --out DIR)"
        )
    _text_inputs(cfg)


def _no_tokenizer(cfg) -> ValueError:
    return ValueError(
        f"--task {cfg.task} needs the tokenizer of --model {cfg.model} (tokenizer.json / tokenizer_config.json "
        f"with a chat template), and the directory has none; export the checkpoint with its tokenizer: {CONVERTER} "
        f"(or --gguf FILE.gguf / a checkpoint directory)"
    )


def _text_inputs(cfg) -> tuple[list, object, list | None, object]:
    """``(training examples, reward, held-out examples or None, tool or None)`` of ``--task``, checked: the reward
    and the tool bind every example's fields, and no held-out prompt is a training prompt."""
    tool = None
    if cfg.task == "jsonl":
        train, reward = _read_prompts("--prompts", cfg.prompts), load_function(cfg.reward, "--reward")
        held_out = _read_prompts("--eval-prompts", cfg.eval_prompts) if cfg.eval_prompts not in ("", NO_EVAL) else None
        tool = load_function(cfg.tool, "--tool") if cfg.tool else None
    elif cfg.task == "chat-calc":
        train, reward, tool = calc_examples("train"), number_reward, calc_tool
        held_out = calc_examples("eval")
    elif cfg.task == "chat-calc-sum":
        train, reward, tool = calc_sum_examples("train"), number_reward, calc_sum_tool
        held_out = calc_sum_examples("eval")
    elif cfg.task == "chat-word":
        train, reward, held_out = word_examples("train"), final_number_reward, word_examples("eval")
    else:
        train, reward = arithmetic_examples(cfg.task, "train"), number_reward
        held_out = arithmetic_examples(cfg.task, "eval")
    for flag, check, fn in (("--reward", check_reward_signature, reward), ("--tool", check_tool_signature, tool)):
        try:
            if fn is not None:
                check(fn, train + (held_out or []))
        except TypeError as err:
            raise TypeError(f"{flag} {getattr(cfg, flag[2:])}: {err}") from None
    if held_out is not None:
        _check_disjoint(train, held_out)
    if not cfg.chat_template:  # chat messages need the template
        chat = next((ex for ex in train + (held_out or []) if not isinstance(ex.prompt, str)), None)
        if chat is not None:
            raise ValueError(f"--no-chat-template: the prompt at {chat.source} is a list of chat messages, which only "
                             f"a chat template renders; give it as a string, or drop --no-chat-template")
    return train, reward, held_out, tool


def _read_prompts(flag: str, path: str) -> list:
    """:func:`read_prompts_jsonl` of ``path``, its errors prefixed with the flag that named the file."""
    try:
        return read_prompts_jsonl(path)
    except FileNotFoundError as err:
        raise FileNotFoundError(f"{flag} {err}") from None
    except UnicodeDecodeError as err:
        raise ValueError(f"{flag} {path}: not UTF-8 text ({err.reason} at byte {err.start}); give a JSONL file, one "
                         f"JSON object per line") from None
    except ValueError as err:
        raise ValueError(f"{flag} {err}") from None


def input_sha256(cfg) -> dict[str, str]:
    """``{flag: sha256 of the file's bytes}`` of the input files a ``--task jsonl`` run reads (:data:`INPUT_FILES`;
    ``--reward``: its ``FILE.py``): a checkpoint records them, and ``--resume`` refuses a file whose content changed.
    Empty for the other tasks."""
    if cfg.task != "jsonl":
        return {}
    files = {flag: getattr(cfg, flag) for flag in INPUT_FILES}
    for flag in ("reward", "tool"):  # FILE.py:function
        files[flag] = files[flag].rsplit(":", 1)[0]
    return {flag: hashlib.sha256(Path(path).read_bytes()).hexdigest() for flag, path in files.items()
            if path not in ("", NO_EVAL) and Path(path).is_file()}


def build_text_tasks(cfg) -> tuple[TextTask, TextTask | None]:
    """``(training task, held-out task or None)`` of ``--task`` with the tokenizer of ``--model``; ``--task jsonl``
    without ``--eval-prompts`` (or with ``--eval-prompts none``) has no held-out task."""
    check_checkpoint_dir(cfg.model)  # a missing --model is named as such, not as a missing tokenizer
    tokenizer = load_tokenizer(cfg.model)
    if tokenizer is None:
        raise _no_tokenizer(cfg)
    train, reward, held_out, tool = _text_inputs(cfg)
    kw = dict(max_new_tokens=cfg.max_new_tokens, chat_template=cfg.chat_template)
    if tool is not None:
        kw.update(tool=tool, max_turns=cfg.max_turns or None, max_turn_tokens=cfg.max_turn_tokens or None)
    return (TextTask(train, reward, tokenizer, name=cfg.task, **kw),
            None if held_out is None else TextTask(held_out, reward, tokenizer, name=f"{cfg.task} held-out", **kw))


def _check_disjoint(train, held_out) -> None:
    """A held-out prompt that is also a training prompt is an error naming both places."""
    seen = {_key(ex.prompt): ex.source for ex in train}
    for ex in held_out:
        if _key(ex.prompt) in seen:
            raise ValueError(
                f"--eval-prompts: the held-out prompt at {ex.source} is also a training prompt "
                f"({seen[_key(ex.prompt)]}): the held-out accuracy would measure memorised prompts; remove it from "
                f"--eval-prompts or --prompts"
            )


def _key(prompt) -> str:
    return prompt if isinstance(prompt, str) else repr([sorted(m.items()) for m in prompt])


class HeldOutEvaluation:
    """Greedy and sampled accuracy on the held-out task, and the samples log ``OUT/samples.txt``.

    Sampling uses its own generator (seeded from ``--seed``), so evaluating changes no random
    stream of the training run: a run with and without evaluations trains the same. The sampled
    completions are drawn at the run's ``--temperature``; greedy ones do not depend on it.
    """

    def __init__(self, task: TextTask | None, cfg, out: Path, main: bool):
        self.task, self.samples, self.main = task, cfg.eval_samples, main
        self.well_formed = {"chat-calc": tool_calls_well_formed, "chat-calc-sum": calc_sum_calls_well_formed}.get(cfg.task)
        self.temperature = cfg.temperature
        self.path = out / "samples.txt"
        self.generator = torch.Generator().manual_seed(cfg.seed + EVAL_SEED_OFFSET)

    def state_dict(self) -> dict:
        """The sampling generator's state: a resumed run evaluates with the random numbers it would have drawn."""
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])

    def __call__(self, model: torch.nn.Module, iteration: int, what: str) -> dict[str, float]:
        """Evaluate ``model`` (rank 0 writes the samples log); returns the eval columns of the row."""
        if self.task is None:
            return {k: float("nan") for k in EVAL_COLUMNS}
        t0 = time.perf_counter()
        greedy = evaluate(model, self.task, greedy=True)
        sampled = evaluate(model, self.task, greedy=False, generator=self.generator, samples=self.samples,
                           temperature=self.temperature)
        if self.main:
            self._log(iteration, what, greedy, sampled)
        row = dict(eval_greedy=greedy.accuracy, eval_sampled=sampled.accuracy, eval_s=time.perf_counter() - t0)
        if greedy.conversations is not None:
            row.update(_turn_columns(greedy.conversations, self.task, self.well_formed))
        return row

    def _log(self, iteration: int, what: str, greedy, sampled) -> None:
        lines = [f"=== iteration {iteration} ({what}): held-out greedy {greedy.accuracy:.3f}, "
                 f"sampled {sampled.accuracy:.3f} over {len(self.task.examples)} prompts ==="]
        for i in range(min(SAMPLES_SHOWN, len(self.task.examples))):
            ex = self.task.examples[i]
            lines.append(f"[{ex.source}] {_one_line(ex.messages()[-1]['content'])}")
            lines.append(f"  greedy  ({greedy.rewards[i]:g}): {_one_line(greedy.completions[i])}")
            j = i * self.samples
            lines.append(f"  sampled ({sampled.rewards[j]:g}): {_one_line(sampled.completions[j])}")
        with open(self.path, "a", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n\n")


def _turn_columns(chats: list[list[dict]], task: TextTask, well_formed) -> dict[str, float]:
    """``eval_turns`` (assistant turns per conversation) and ``eval_tool_calls`` (the fraction whose tool calls were
    well-formed; nan without a ``well_formed`` check) of the held-out conversations."""
    n = max(len(chats), 1)
    turns = sum(sum(m["role"] == "assistant" for m in c[len(ex.messages()):])
                for c, ex in zip(chats, task.examples))
    calls = float("nan") if well_formed is None else sum(map(well_formed, chats)) / n
    return dict(eval_turns=turns / n, eval_tool_calls=calls)


def _one_line(text: str) -> str:
    return text.replace("\n", "\\n")


def export_hf(model: torch.nn.Module, tokenizer, path: Path) -> None:
    """Save the actor's Hugging Face model and its tokenizer (chat template included) to ``path``.

    Written to a temporary directory first and swapped in, so ``path`` always holds a whole
    checkpoint. ``model`` is an :class:`~ppo_objectives.llm.hf.HFCausalLMAdapter`; its LoRA adapters, if any, are
    merged into the weights (:func:`~ppo_objectives.llm.lora.merged_hf_model`), so the directory loads without peft.
    """
    from transformers.utils import logging as hf_logging

    tmp, old = path.with_name(path.name + ".tmp"), path.with_name(path.name + ".old")
    shutil.rmtree(tmp, ignore_errors=True)
    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # no "Writing model shards" bar under the run's own
    try:
        merged_hf_model(model).save_pretrained(str(tmp))  # LoRA adapters merged: a plain Hugging Face model
    finally:
        if shown:
            hf_logging.enable_progress_bar()
    tokenizer.save_pretrained(str(tmp))
    if path.exists():
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)

"""Text tasks on a real tokenizer: an earlier import path, kept as a plain re-export of ``ppo_objectives.train.text``.

New code imports from there; ``docs/design.md`` lists the re-exports.
"""

from ppo_objectives.train.text import (
    ARITHMETIC_TASKS,
    EvalResult,
    TextExample,
    TextTask,
    arithmetic_examples,
    evaluate,
    load_reward,
    number_reward,
    read_prompts_jsonl,
)

__all__ = ["ARITHMETIC_TASKS", "EvalResult", "TextExample", "TextTask", "arithmetic_examples", "evaluate", "load_reward", "number_reward", "read_prompts_jsonl"]  # fmt: skip

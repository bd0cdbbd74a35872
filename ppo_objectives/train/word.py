"""``--task chat-word``: two-step word problems whose answers show their working, a single-turn text task.

Each prompt is one worked exchange (:data:`ONE_SHOT`) and then the chat question: a
multiplication and then an addition or a subtraction, told as a story, with the request to work it
out before giving the number::

    user:      A farm has 2 pens with 14 sheep in each pen. 3 sheep are sold. How many sheep are
               left? Work it out step by step, then give the final answer.
    assistant: 2 pens of 14 sheep: 2 * 14 = 28 sheep.
               28 - 3 = 25 sheep are left.
               The answer is 25.
    user:      A shop packs 4 boxes with 6 pencils in each box, then sells 5 loose pencils. How many
               pencils did it sell in all? Work it out step by step, then give the final answer.

A good answer runs past 16 tokens (the worked one is 42), so the critic has a longer sequence to
assign credit over than in ``chat-add1`` / ``chat-add2``. The reward (:func:`final_number_reward`)
reads the **last** number of the whole completion, the final answer after the working.

The problems are every story with every ``a`` and ``b`` in 2..6 and ``c`` in 1..9 (``c < a * b``
in the stories that take it away), split by a seeded permutation: 200 held-out, the rest for
training. The numbers are small and the worked exchange is there because SmolLM2-135M-Instruct
cannot do more: without them it starts near 0 (0.025 greedy and 0.015 sampled on 200 problems
with ``a`` up to 9, ``b`` up to 12 and ``c`` up to 20, and a reward that is 0 on every rollout of
the first iterations, so no side has anything to learn from).
"""

from __future__ import annotations

import re

import torch

from ppo_objectives.train.text import TextExample

__all__ = ["ONE_SHOT", "WORD_HELD_OUT", "final_number_reward", "word_examples"]

#: Held-out problems of ``chat-word``.
WORD_HELD_OUT = 200

#: ``(story, sign)``: the story asks for ``a * b + sign * c``.
STORIES = (
    ("A shop packs {a} boxes with {b} pencils in each box, then sells {c} loose pencils. How many pencils did it "
     "sell in all?", +1),
    ("Mia has {a} bags with {b} marbles in each bag. She gives away {c} marbles. How many marbles does she have "
     "now?", -1),
    ("Sam reads {b} pages a day for {a} days, then {c} more pages. How many pages does he read in all?", +1),
    ("A hall has {a} rows of {b} chairs. {c} chairs are taken. How many chairs are free?", -1),
)

#: What every question asks for after its story.
ASK = "Work it out step by step, then give the final answer."

#: The worked exchange at the start of every prompt (its numbers are outside the problems' ranges).
ONE_SHOT = (
    {"role": "user", "content": f"A farm has 2 pens with 14 sheep in each pen. 3 sheep are sold. How many sheep are "
                                f"left? {ASK}"},
    {"role": "assistant", "content": "2 pens of 14 sheep: 2 * 14 = 28 sheep.\n28 - 3 = 25 sheep are left.\n"
                                     "The answer is 25."},
)


def word_examples(split: str, *, split_seed: int = 0) -> list[TextExample]:
    """The ``chat-word`` problems of ``split`` (``"train"`` or ``"eval"``), with ``fields = {"answer": N}``.

    Example:
        >>> held_out = word_examples("eval")
        >>> len(held_out), len(word_examples("train")), held_out[0].prompt[:2] == ONE_SHOT
        (200, 662, True)
        >>> held_out[0].prompt[-1]["content"]
        'Sam reads 3 pages a day for 3 days, then 8 more pages. How many pages does he read in all? Work it out step by step, then give the final answer.'
        >>> held_out[0].fields
        {'answer': 17}
    """
    if split not in ("train", "eval"):
        raise ValueError(f"word_examples split={split!r} must be 'train' or 'eval'")
    problems = [(s, a, b, c) for s, (_, sign) in enumerate(STORIES) for a in range(2, 7) for b in range(2, 7)
                for c in range(1, 10) if sign > 0 or c < a * b]
    order = torch.randperm(len(problems), generator=torch.Generator().manual_seed(split_seed)).tolist()
    chosen = order[:WORD_HELD_OUT] if split == "eval" else order[WORD_HELD_OUT:]
    out = []
    for i in chosen:
        s, a, b, c = problems[i]
        story, sign = STORIES[s]
        question = f"{story.format(a=a, b=b, c=c)} {ASK}"
        out.append(TextExample((*ONE_SHOT, {"role": "user", "content": question}), {"answer": a * b + sign * c},
                               f"chat-word #{i}"))
    return out


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def final_number_reward(completion: str, answer: float) -> float:
    """1.0 when the last number of the completion is ``answer``, else 0.0 (the working before it may hold any
    numbers). Commas in numbers are ignored, and so is a full stop after the last one.

    Example:
        >>> final_number_reward("7 * 12 = 84, and 84 + 15 = 99. The answer is 99.", 99)
        1.0
        >>> final_number_reward("The answer is 99, since 7 * 12 = 84", 99), final_number_reward("no idea", 99)
        (0.0, 0.0)
    """
    found = _NUMBER.findall(completion.replace(",", ""))
    return float(bool(found) and float(found[-1]) == float(answer))

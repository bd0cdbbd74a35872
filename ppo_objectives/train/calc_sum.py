"""``--task chat-calc-sum``: a product and a sum with a calculator tool, two calls per problem.

A multi-turn text task where the credit has turns to cross and the model must learn when to stop
calling: the answer to ``a * b + c`` needs the product looked up, then its sum with ``c``, then the
answer, so a conversation is two tool calls and the answer, and a wrong first call spoils what
follows. Every prompt starts with one worked exchange (:data:`ONE_SHOT`), then the user asks the
problem::

    user:      What is 12 times 34 plus 56?
    assistant: calc(12*34)
    user:      calc result: 408
    assistant: calc(408+56)
    user:      calc result: 464
    assistant: The answer is 464.
    user:      What is 23 times 45 plus 67?

SmolLM2-135M-Instruct starts below half of it: it makes the two calls, then often keeps adding
instead of answering (``benchmarks/start_accuracy.py``); ``a * b + c * d`` with three calls was
tried first and started at 0.000 greedy and sampled, too far for any side to learn in 15 minutes.

:func:`calc_sum_tool` is the environment's turn: a well-formed call ``calc(a*b)`` or ``calc(a+b)``
(two whole numbers) gets ``"calc result: N"``, a malformed one an error message that shows the
forms, and a turn without a call ends the episode (it is the answer). The reward is
:func:`~ppo_objectives.train.text.number_reward` of the last assistant message against
``a * b + c``. Results are computed from the numbers the regular expression read, never by
evaluating the model's text.

The problems are triples of two-digit numbers drawn by a seeded generator (the worked example's
excluded, no triple twice): 200 held-out, 20,000 for training.
"""

from __future__ import annotations

import re

import torch

from ppo_objectives.train.calc import calc_reply, tool_calls_well_formed
from ppo_objectives.train.text import TextExample

__all__ = ["CALC_SUM_HELD_OUT", "ONE_SHOT", "calc_sum_examples", "calc_sum_tool", "calc_sum_calls_well_formed"]

#: Held-out problems of ``chat-calc-sum``.
CALC_SUM_HELD_OUT = 200
#: Training problems of ``chat-calc-sum`` (drawn after the held-out ones).
CALC_SUM_TRAIN = 20_000

#: The worked exchange at the start of every prompt.
ONE_SHOT = (
    {"role": "user", "content": "What is 12 times 34 plus 56?"},
    {"role": "assistant", "content": "calc(12*34)"},
    {"role": "user", "content": "calc result: 408"},
    {"role": "assistant", "content": "calc(408+56)"},
    {"role": "user", "content": "calc result: 464"},
    {"role": "assistant", "content": "The answer is 464."},
)

_CALL = re.compile(r"calc\(\s*(\d{1,12})\s*([*x×+])\s*(\d{1,12})\s*\)")

#: The reply to a call the tool cannot read.
CALC_SUM_ERROR = "calc error: write calc(a*b) or calc(a+b) with two whole numbers"


def calc_sum_examples(split: str, *, split_seed: int = 0) -> list[TextExample]:
    """The ``chat-calc-sum`` problems of ``split`` (``"train"`` or ``"eval"``), with
    ``fields = {"answer": a * b + c}``.

    Example:
        >>> held_out = calc_sum_examples("eval")
        >>> len(held_out), len(calc_sum_examples("train"))
        (200, 20000)
        >>> held_out[0].prompt[-1]["content"], held_out[0].fields
        ('What is 54 times 19 plus 93?', {'answer': 1119})
    """
    if split not in ("train", "eval"):
        raise ValueError(f"calc_sum_examples split={split!r} must be 'train' or 'eval'")
    g = torch.Generator().manual_seed(split_seed)
    seen, problems = {(12, 34, 56)}, []
    while len(problems) < CALC_SUM_HELD_OUT + CALC_SUM_TRAIN:  # 90^3 triples: a second draw fills the repeats
        for q in map(tuple, torch.randint(10, 100, (CALC_SUM_HELD_OUT + CALC_SUM_TRAIN, 3), generator=g).tolist()):
            if q not in seen and len(problems) < CALC_SUM_HELD_OUT + CALC_SUM_TRAIN:
                seen.add(q)
                problems.append(q)
    chosen = range(CALC_SUM_HELD_OUT) if split == "eval" else range(CALC_SUM_HELD_OUT, len(problems))
    return [TextExample((*ONE_SHOT, {"role": "user", "content": f"What is {a} times {b} plus {c}?"}),
                        {"answer": a * b + c}, f"chat-calc-sum #{i}")
            for i in chosen for a, b, c in [problems[i]]]  # fmt: skip


def calc_sum_tool(messages: list[dict], **fields) -> str | None:
    """The environment's turn of ``chat-calc-sum``: the result of the last assistant message's call (a product or a
    sum), an error message for a call it cannot read, or ``None`` (the episode ends) when the message makes no call.

    Example:
        >>> calc_sum_tool([{"role": "assistant", "content": "calc(57*18)"}])
        'calc result: 1026'
        >>> calc_sum_tool([{"role": "assistant", "content": "calc(1026 + 40)"}])
        'calc result: 1066'
        >>> calc_sum_tool([{"role": "assistant", "content": "calc(57-18)"}])
        'calc error: write calc(a*b) or calc(a+b) with two whole numbers'
        >>> calc_sum_tool([{"role": "assistant", "content": "The answer is 1066."}]) is None
        True
    """
    return calc_reply(messages[-1]["content"], _CALL, _result, CALC_SUM_ERROR)


def _result(found: re.Match) -> int:
    a, op, b = int(found.group(1)), found.group(2), int(found.group(3))
    return a + b if op == "+" else a * b


def calc_sum_calls_well_formed(messages: list[dict]) -> bool:
    """:func:`~ppo_objectives.train.calc.tool_calls_well_formed` with this task's worked exchange and call forms.

    Example:
        >>> chat = [*ONE_SHOT, {"role": "user", "content": "What is 57 times 18 plus 40?"}]
        >>> calc_sum_calls_well_formed(chat + [{"role": "assistant", "content": "calc(57*18)"}])
        True
        >>> calc_sum_calls_well_formed(chat + [{"role": "assistant", "content": "calc(57 times 18)"}])
        False
    """
    return tool_calls_well_formed(messages, len(ONE_SHOT) + 1, call=_CALL)

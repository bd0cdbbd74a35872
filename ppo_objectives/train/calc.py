"""``--task chat-calc``: two-digit multiplication with a calculator tool, a multi-turn text task.

Every prompt starts with one worked exchange: the user asks a product, the assistant calls
the tool, the tool answers, the assistant states the answer. Then the user asks the problem::

    user:      What is 23 times 41?
    assistant: calc(23*41)
    user:      calc result: 943
    assistant: The answer is 943.
    user:      What is 57 times 18?

The model's turns end at its end-of-turn token. :func:`calc_tool` is the environment's turn:
a well-formed call ``calc(a*b)`` (two whole numbers) gets ``"calc result: N"``, a malformed
one an error message that shows the form, and a turn without a call ends the episode (it is
the answer). The reward is :func:`~ppo_objectives.train.text.number_reward` of the last
assistant message against the product. The product is computed from the two numbers the
regular expression read, never by evaluating the model's text.

The problems are the ordered pairs of 10..99 (without the worked example's), split by a
seeded permutation: 200 held-out, the rest for training.
"""

from __future__ import annotations

import re

import torch

from ppo_objectives.train.text import TextExample

__all__ = ["CALC_HELD_OUT", "ONE_SHOT", "calc_examples", "calc_reply", "calc_tool", "tool_calls_well_formed"]

#: Held-out problems of ``chat-calc``.
CALC_HELD_OUT = 200

#: The worked exchange at the start of every prompt.
ONE_SHOT = (
    {"role": "user", "content": "What is 23 times 41?"},
    {"role": "assistant", "content": "calc(23*41)"},
    {"role": "user", "content": "calc result: 943"},
    {"role": "assistant", "content": "The answer is 943."},
)

_CALL = re.compile(r"calc\(\s*(\d{1,12})\s*[*x×]\s*(\d{1,12})\s*\)")
_ANY_CALL = re.compile(r"calc\s*\(")

#: The reply to a call the tool cannot read.
CALC_ERROR = "calc error: write calc(a*b) with two whole numbers"


def calc_examples(split: str, *, split_seed: int = 0) -> list[TextExample]:
    """The ``chat-calc`` problems of ``split`` (``"train"`` or ``"eval"``), with ``fields = {"answer": a * b}``.

    Example:
        >>> held_out = calc_examples("eval")
        >>> len(held_out), len(calc_examples("train")), held_out[0].prompt[-1]["content"]
        (200, 7899, 'What is 44 times 35?')
        >>> held_out[0].fields
        {'answer': 1540}
    """
    if split not in ("train", "eval"):
        raise ValueError(f"calc_examples split={split!r} must be 'train' or 'eval'")
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100) if (a, b) != (23, 41)]
    order = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(split_seed)).tolist()
    chosen = order[:CALC_HELD_OUT] if split == "eval" else order[CALC_HELD_OUT:]
    return [TextExample((*ONE_SHOT, {"role": "user", "content": f"What is {pairs[i][0]} times {pairs[i][1]}?"}),
                        {"answer": pairs[i][0] * pairs[i][1]}, f"chat-calc #{i}") for i in chosen]


def calc_tool(messages: list[dict], **fields) -> str | None:
    """The environment's turn of ``chat-calc``: the result of the last assistant message's call, an error message
    for a call it cannot read, or ``None`` (the episode ends) when the message makes no call.

    Example:
        >>> calc_tool([{"role": "assistant", "content": "calc(57*18)"}])
        'calc result: 1026'
        >>> calc_tool([{"role": "assistant", "content": "calc(57 plus 18)"}])
        'calc error: write calc(a*b) with two whole numbers'
        >>> calc_tool([{"role": "assistant", "content": "The answer is 1026."}]) is None
        True
    """
    return calc_reply(messages[-1]["content"], _CALL, lambda m: int(m.group(1)) * int(m.group(2)), CALC_ERROR)


def calc_reply(text: str, call: re.Pattern, result, error: str) -> str | None:
    """A calculator's reply to an assistant message ``text``: ``"calc result: N"`` with ``N = result(match)`` for the
    first well-formed call (``call``), ``error`` for a call it cannot read (any ``calc(``), ``None`` without one.

    Example:
        >>> calc_reply("calc(2*3)", _CALL, lambda m: int(m.group(1)) * int(m.group(2)), "bad")
        'calc result: 6'
    """
    found = call.search(text)
    if found:
        return f"calc result: {result(found)}"
    return error if _ANY_CALL.search(text) else None


def tool_calls_well_formed(messages: list[dict], prompt_messages: int = len(ONE_SHOT) + 1, *,
                           call: re.Pattern = _CALL) -> bool:
    """Whether the model's turns (after the prompt's first ``prompt_messages`` messages) made at least one call and
    every call they made was well-formed (matched ``call``, the tool's pattern; a call is any ``calc(``).

    Example:
        >>> chat = [*ONE_SHOT, {"role": "user", "content": "What is 57 times 18?"}]
        >>> tool_calls_well_formed(chat + [{"role": "assistant", "content": "calc(57*18)"}])
        True
        >>> tool_calls_well_formed(chat + [{"role": "assistant", "content": "It is 1026."}])
        False
    """
    turns = [m["content"] for m in messages[prompt_messages:] if m["role"] == "assistant"]
    calls = [t for t in turns if _ANY_CALL.search(t)]
    return bool(calls) and all(call.search(t) for t in calls)

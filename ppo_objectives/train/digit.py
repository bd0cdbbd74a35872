"""The shipped toy task and its supervised warm start.

:class:`DigitTask` (in the spirit of minGPT's adder): digits in, the exactly
checkable answer out, with partial credit. It follows
:class:`~ppo_objectives.llm.env.LMTask`, so
``TokenLMEnv.from_task(DigitTask("reverse", 3), num_envs=N)`` is the default job's
env. :func:`warm_start` is the short supervised warm start of the default job: it
teaches the answer's *format* (digits then EOS), not the answer.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ppo_objectives import _validate
from ppo_objectives.llm.readouts import ResponseLogProbs

__all__ = ["DigitTask", "warm_start"]


# --------------------------------------------------------------------------- #
# The toy task
# --------------------------------------------------------------------------- #


class DigitTask:
    """Digits in, a checkable answer out: ``copy``, ``reverse`` or ``add``.

    **Encoding.** 16 tokens, one character each::

        id:   0   1   2   3   4   5   6   7   8   9  10  11  12  13  14  15
        char: _   .   0   1   2   3   4   5   6   7   8   9   +   =   <   >

    ``_`` is padding, ``.`` is EOS. Prompts and answers, for ``num_digits=3``:

    - ``reverse``: ``"123<"`` -> ``"321."``
    - ``copy``:    ``"123>"`` -> ``"123."``
    - ``add``:     ``"123+456="`` -> ``"0579."`` (sum zero-padded to ``num_digits + 1`` digits)

    A worked string: the prompt ``"123<"`` is ``[3, 4, 5, 14]``; the correct
    response ``"321."`` is ``[5, 4, 3, 1]``.

    **Reward** (partial credit, in [0, 1]): the target is the answer digits
    followed by EOS, ``K + 1`` tokens; the reward is the fraction of target
    tokens the response has at the right index. ``"321."`` scores 1.0,
    ``"311."`` 3/4, ``"32."`` 2/4 (the third digit and the EOS are missing),
    ``"3210"`` (no EOS) 3/4.

    With ``min_digits < num_digits`` the copy/reverse prompts have varying
    lengths and are left-padded in the env.

    Example:
        >>> task = DigitTask("reverse", num_digits=3)
        >>> task.encode("123<"), task.encode("321.")
        ([3, 4, 5, 14], [5, 4, 3, 1])
        >>> prompt = torch.tensor([task.encode("123<")])
        >>> resp = torch.tensor([task.encode("321."), task.encode("311."), task.encode("32._")])
        >>> task.reward(prompt.expand(3, -1), torch.ones(3, 4, dtype=torch.bool), resp, resp != 0)
        tensor([1.0000, 0.7500, 0.5000])
    """

    VOCAB = "_.0123456789+=<>"
    PAD, EOS = 0, 1
    _OPS = ("copy", "reverse", "add")

    def __init__(self, op: str = "reverse", num_digits: int = 3, *, min_digits: int | None = None):
        if op not in self._OPS:
            raise ValueError(f"DigitTask op={op!r} is unknown; choose one of {self._OPS}")
        _validate.check_int("num_digits", num_digits, low=1, high=9)
        min_digits = num_digits if min_digits is None else min_digits
        if not 1 <= min_digits <= num_digits:
            raise ValueError(f"min_digits={min_digits!r} must be in [1, num_digits={num_digits}]")
        if op == "add" and min_digits != num_digits:
            raise ValueError("the add task has fixed-width operands; leave min_digits unset")
        self.op, self.num_digits, self.min_digits = op, num_digits, min_digits

    def __repr__(self) -> str:
        return f"DigitTask(op={self.op!r}, num_digits={self.num_digits}, min_digits={self.min_digits})"

    @property
    def vocab_size(self) -> int:
        return len(self.VOCAB)

    @property
    def eos_id(self) -> int:
        """The end-of-answer token ``.`` (:attr:`EOS`), as the env's task protocol names it."""
        return self.EOS

    @property
    def pad_id(self) -> int:
        """The padding token ``_`` (:attr:`PAD`)."""
        return self.PAD

    @property
    def prompt_len(self) -> int:
        """``P``: the widest prompt, in tokens."""
        return 2 * self.num_digits + 2 if self.op == "add" else self.num_digits + 1

    @property
    def answer_len(self) -> int:
        """Answer tokens including EOS (``K + 1``): the natural ``max_new_tokens``."""
        return (self.num_digits + 2) if self.op == "add" else (self.num_digits + 1)

    def encode(self, text: str) -> list[int]:
        bad = sorted(set(text) - set(self.VOCAB))
        if bad:
            raise ValueError(f"cannot encode {text!r}: characters {bad} are not in the vocabulary {self.VOCAB!r}")
        return [self.VOCAB.index(c) for c in text]

    def decode(self, ids) -> str:
        ids = ids.tolist() if isinstance(ids, Tensor) else list(ids)
        return "".join(self.VOCAB[i] for i in ids)

    def sample_prompts(self, k: int, generator: torch.Generator | None = None) -> Tensor:
        """``k`` random prompts, ``[k, P]`` int64, left-padded with ``_`` when shorter than ``P``.

        Example:
            >>> task = DigitTask("reverse", 3, min_digits=1)
            >>> [task.decode(p) for p in task.sample_prompts(3, torch.Generator().manual_seed(0))]
            ['039<', '__7<', '316<']
        """
        d = self.num_digits
        if self.op == "add":
            digits = torch.randint(10, (k, 2 * d), generator=generator) + 2
            plus = torch.full((k, 1), 12, dtype=torch.long)
            eq = torch.full((k, 1), 13, dtype=torch.long)
            return torch.cat([digits[:, :d], plus, digits[:, d:], eq], 1)
        op_tok = 14 if self.op == "reverse" else 15
        lens = torch.randint(self.min_digits, d + 1, (k,), generator=generator)
        digits = torch.randint(10, (k, d), generator=generator) + 2
        real = torch.arange(d)[None, :] >= (d - lens)[:, None]  # right-aligned digits
        digits = torch.where(real, digits, self.PAD)
        return torch.cat([digits, torch.full((k, 1), op_tok, dtype=torch.long)], 1)

    __call__ = sample_prompts  # a task is a prompt source: task(k, generator)

    def targets(self, prompt_ids: Tensor, prompt_mask: Tensor) -> Tensor:
        """The correct responses ``[N, K + 1]`` (digits then EOS, right-padded with ``_``)
        for left-padded prompts ``[N, P]``."""
        N, P = prompt_ids.shape
        K1 = self.answer_len
        device = prompt_ids.device
        if self.op == "add":
            d = self.num_digits
            x = prompt_ids[:, -(2 * d + 2) :] - 2
            place = 10 ** torch.arange(d - 1, -1, -1, device=device)
            total = (x[:, :d] * place).sum(-1) + (x[:, d + 1 : 2 * d + 1] * place).sum(-1)  # [N]
            place1 = 10 ** torch.arange(d, -1, -1, device=device)
            ans = (total[:, None] // place1) % 10 + 2  # [N, d + 1]
            return torch.cat([ans, torch.full((N, 1), self.EOS, device=device, dtype=torch.long)], 1)
        n = prompt_mask.long().sum(-1) - 1  # [N] digits per prompt
        j = torch.arange(K1, device=device)
        if self.op == "reverse":
            src = (P - 2 - j)[None, :].expand(N, K1)  # answer digit j is prompt column P - 2 - j
        else:
            src = (P - 1 - n)[:, None] + j[None, :]  # answer digit j is prompt column P - 1 - n + j
        digits = prompt_ids.gather(1, src.clamp(0, P - 1))
        out = torch.where(j[None] < n[:, None], digits, self.PAD)
        return torch.where(j[None] == n[:, None], self.EOS, out)

    def reward(self, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor, response_mask: Tensor) -> Tensor:
        """Fraction of target tokens (digits + EOS) matched at their index, ``[N]`` float32."""
        target = self.targets(prompt_ids, prompt_mask)  # [N, K1]
        K1 = target.shape[1]
        M = response_ids.shape[1]
        if M < K1:  # a too-short budget cannot hold the whole answer: pad the response
            pad = torch.zeros(response_ids.shape[0], K1 - M, dtype=response_ids.dtype, device=response_ids.device)
            response_ids = torch.cat([response_ids, pad], 1)
            response_mask = torch.cat([response_mask.bool(), pad.bool()], 1)
        resp = torch.where(response_mask[:, :K1].bool(), response_ids[:, :K1], -1)
        counted = target != self.PAD
        hits = ((resp == target) & counted).sum(-1).float()
        return hits / counted.sum(-1).float()


def warm_start(model: torch.nn.Module, task: DigitTask, steps: int, lr: float, generator: torch.Generator,
               device) -> float:
    """Supervised warm start on the answer *format*: prompt, then random digits of the answer's
    length, then EOS. Teaches "K digits and stop", not which digits. Returns the last loss.

    The training job runs it before PPO on a digit task (``--warmup-steps``, ``--warmup-lr``);
    ``model`` is the actor's causal LM, trained in place with AdamW on batches of 64."""
    if steps <= 0:
        return float("nan")
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    P, K1 = task.prompt_len, task.answer_len
    head = ResponseLogProbs(model, P, return_entropy=False)
    loss = torch.zeros(())
    for _ in range(steps):
        prompts = task.sample_prompts(64, generator)  # [64, P], left-padded
        digits = torch.randint(10, (64, K1 - 1), generator=generator) + 2
        resp = torch.cat([digits, torch.full((64, 1), task.EOS)], 1)
        ids = torch.cat([prompts, resp], 1).to(device)
        mask = torch.cat([prompts != task.PAD, torch.ones_like(resp, dtype=torch.bool)], 1).to(device)
        loss = -head(ids, mask).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return float(loss.detach())

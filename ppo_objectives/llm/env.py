"""A token-level language-model environment for TorchRL, for any task that follows :class:`LMTask`.

:class:`TokenLMEnv` is a batched ``torchrl.envs.EnvBase`` in which **one step
is one token**: the policy reads the token buffer and emits the next token id;
the episode ends at EOS (``terminated``) or after ``max_new_tokens`` tokens
(``truncated``). Rows reset independently, so a TorchRL collector keeps every
row busy. :func:`~ppo_objectives.llm.layouts.trajectories_to_llm_batch` turns the
collector's per-token batch ``[N, T]`` into the response layout (one row per
finished response, ``[B, R]`` per-token entries) that the losses read.

:class:`LMTask` is what the env needs of a task (a prompt sampler, a reward, the
widths and the special ids); the shipped tasks live with the training job:
:class:`~ppo_objectives.train.digit.DigitTask` (a verifiable toy task) and
:class:`~ppo_objectives.train.text.TextTask` (chat prompts on a real tokenizer).

Shape letters:

- ``N``: parallel env rows (``env.batch_size == [N]``); ``T``: collector steps.
- ``P``: prompt width (prompts are **left-padded** to it, as in MiniMind);
  ``M = max_new_tokens``; ``S = P + M``: the token buffer.
- ``B``: finished responses in a batch; ``R = M``: response length (padded).

Observation / action / reward (all TensorDict keys at the root):

=====================  ================  ==============================================
key                    shape, dtype      meaning
=====================  ================  ==============================================
``tokens``             ``[N, S]`` int64  prompt (columns ``< P``) then generated tokens
``attention_mask``     ``[N, S]`` bool   True = real token (prompt or generated)
``position``           ``[N]`` int64     column the next token goes to (``P + step``)
``prompt_id``          ``[N]`` int64     the row's prompt: its index in a finite source, the
                                         id a sampler returns with it, else its draw number
``group``              ``[N]`` int64     the row's group: the rows that drew one prompt together
                                         (``group_size`` of them at a full reset) share it
``action``             ``[N]`` int64     the next token id (integer dtype)
``("next","reward")``  ``[N, 1]`` f32    sequence score on the last token (+ shaping)
``("next","done")``    ``[N, 1]`` bool   ``terminated | truncated``
=====================  ================  ==============================================

Multi-turn episodes
-------------------

With ``env_turn_fn`` an episode is a conversation. An **assistant turn** ends at
``eos_id`` (the end-of-turn token) or after ``max_turn_tokens`` tokens; the env then
calls ``env_turn_fn(response_ids, assistant_mask, conversation=list)`` on that row
(``response_ids`` / ``assistant_mask``: the row's columns ``P`` to ``position``; plus
``prompt_id=`` when the function takes it), which returns the **environment's turn**
as token ids (a tool result, feedback, the next user message) or ``None`` to end the
episode (``terminated``). The env writes those tokens after the assistant's in the same
step and moves ``position`` past them: they are **holes**, tokens the model reads as
context (``attention_mask`` True) but never sampled (no step writes them, so
:func:`~ppo_objectives.llm.layouts.trajectories_to_llm_batch` gives them ``mask`` False,
no log-prob, no reward, no advantage) and never trained. ``max_new_tokens`` is the whole
conversation's budget. The episode ends **truncated** when the budget is spent, when
``max_turns`` assistant turns are done, or when the environment's turn does not fit
with a column to spare (then it is dropped, counted in ``env_turns_cut`` and
:meth:`TokenLMEnv.turn_cut`, what ``env_turn_fn`` recorded for it is taken out of the
conversation, and the conversation is scored as it stands). Rows end at different
turns and reset on their own. ``conversation`` is the row's own list, empty at its reset, for ``env_turn_fn`` to
record what it needs (:class:`~ppo_objectives.train.text.TextTask` keeps the tool's
messages there); a ``reward_fn`` with a ``conversation`` parameter gets each finished
row's, and its ``response_mask`` is ``assistant_mask``: the tokens the policy wrote.
The observation then also holds ``assistant_mask`` ``[N, S]``, ``turn_start`` ``[N]``
(the column the current assistant turn began at) and ``turns`` ``[N]`` (environment
turns so far). A finished row stepped again without a reset is left as it is.
The env policy (:class:`~ppo_objectives.llm.policy.NextTokenLogits`) feeds an
environment's turn to its KV cache in one forward of those tokens: no turn re-encodes
the conversation before it.

Example (the reverse task, a scripted policy that answers correctly):
    >>> import torch
    >>> from ppo_objectives.train.digit import DigitTask
    >>> task = DigitTask("reverse", num_digits=3)
    >>> env = TokenLMEnv.from_task(task, num_envs=1, seed=0)
    >>> td = env.reset()
    >>> task.decode(td["tokens"][0, : env.prompt_len])
    '930<'
    >>> for tok in task.encode("039."):
    ...     td["action"] = torch.tensor([tok])
    ...     td = env.step(td)
    ...     reward, done = td["next", "reward"].item(), td["next", "done"].item()
    ...     td = td["next"]
    >>> reward, done, td["terminated"].item()
    (1.0, True, True)
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any, Protocol, runtime_checkable

import torch
from tensordict import TensorDict, TensorDictBase
from torch import Tensor
from torchrl.data import Bounded, Categorical, Composite, Unbounded
from torchrl.envs import EnvBase

from ppo_objectives import _validate

__all__ = ["LMTask", "RewardFn", "TokenLMEnv"]


RewardFn = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


@runtime_checkable
class LMTask(Protocol):
    """What :meth:`TokenLMEnv.from_task` needs of a task.

    The task is the prompt sampler: ``task(k, generator)`` returns ``k`` prompts, as a
    left-padded ``[k, P]`` tensor, a list of rows, or a dict with the rows and one
    ``prompt_id`` per prompt.
    ``reward(prompt, prompt_mask, response, response_mask) -> [k]`` scores finished
    responses. ``answer_len`` is the default ``max_new_tokens``. The shipped tasks,
    :class:`~ppo_objectives.train.digit.DigitTask` and
    :class:`~ppo_objectives.train.text.TextTask`, follow it.

    Example:
        >>> from ppo_objectives.train.digit import DigitTask
        >>> isinstance(DigitTask("reverse", 3), LMTask), isinstance(object(), LMTask)
        (True, False)
    """

    prompt_len: int
    answer_len: int
    vocab_size: int
    eos_id: int
    pad_id: int

    def __call__(self, k: int, generator: torch.Generator) -> Tensor | list | dict: ...

    def reward(self, prompt: Tensor, prompt_mask: Tensor, response: Tensor, response_mask: Tensor) -> Tensor: ...


# --------------------------------------------------------------------------- #
# Prompt sources
# --------------------------------------------------------------------------- #


class _PromptStream:
    """Draws prompts from a callable sampler, a tensor / list (cycled), or any iterable, each with its
    prompt id: the index in a finite source, the ``prompt_id`` a sampler returns, else the draw number."""

    def __init__(self, source: Any, pad_id: int):
        if isinstance(source, (str, bytes)):
            raise _text_prompts(f"the string {source[:40]!r}")
        if isinstance(source, (list, tuple)):
            text = next((i for i, p in enumerate(source) if isinstance(p, (str, bytes))), None)
            if text is not None:
                raise _text_prompts(f"the string {source[text][:40]!r} at index {text}")
            if source and all(_is_token_id(p) for p in source):
                raise _one_prompt(f"a flat {type(source).__name__} of {len(source)} token ids", "[prompt]")
        if isinstance(source, Tensor) and source.dim() < 2:
            raise _one_prompt(f"a {source.dim()}-D tensor of shape {tuple(source.shape)}",
                              "[prompt] or prompt.unsqueeze(0)" if source.dim() else "a list of prompts")
        self.pad_id = pad_id
        self._draws = 0  # prompts drawn so far (the id of a prompt that has no other)
        self._pending: list[tuple[Tensor, int]] = []
        self._iter = None
        if callable(source) and not isinstance(source, (Tensor, list, tuple)) and not hasattr(source, "__iter__"):
            self.kind = "sampler"
        elif isinstance(source, (Tensor, list, tuple)):
            self.kind = "finite"
            if len(source) == 0:
                raise ValueError("the prompt source is empty: give at least one prompt")
        elif isinstance(source, Iterable):
            self.kind = "iterable"
        else:
            raise TypeError(
                f"prompts must be a callable (k, generator) -> prompts, a tensor, a list of token-id sequences, "
                f"or an iterable / DataLoader of them; got {type(source).__name__}"
            )
        self.source = source
        self._cursor = 0

    def _rows(self, item) -> list[Tensor]:
        """One source item -> 1-D prompts with the left padding stripped.

        The padding is the ``attention_mask`` when the item has one. Without it, only **left** padding is
        inferred, in a 2-D batch: the leading ``pad_id`` tokens of each row. A ``pad_id`` after a row's first
        other token is a prompt token and is kept (a tokenizer whose pad id is a real token, e.g. SmolLM2's
        ``<|im_end|>``), and a 1-D prompt is taken whole; right-padded prompts need their ``attention_mask``.
        """
        if isinstance(item, (dict, TensorDictBase)):
            ids = torch.as_tensor(item["input_ids"], dtype=torch.long)
            mask = item.get("attention_mask", None)
            if mask is None:
                return self._rows(ids)
            mask = torch.as_tensor(mask)
            if mask.shape != ids.shape:
                raise ValueError(f"the prompt's attention_mask has shape {tuple(mask.shape)} but its input_ids "
                                 f"{tuple(ids.shape)}: give one mask value per token (True = real token)")
            ids, mask = ids.reshape(-1, ids.shape[-1]), mask.reshape(-1, ids.shape[-1]).bool()
            return [r[m] for r, m in zip(ids, mask)]
        t = _token_ids(item)
        if t.dim() == 1:
            return [t]
        if t.dim() == 2:  # a batch of left-padded prompts
            return [r[r.ne(self.pad_id).long().cummax(0).values.bool()] for r in t]
        if t.dim() == 0:
            raise ValueError(
                f"the prompt source gave a single token id ({int(t)}) where a prompt (1-D token ids) or a batch of "
                f"them is expected: a source that iterates over one prompt's tokens yields them one by one; give a "
                f"list of prompts ([prompt], or prompt.unsqueeze(0) for a tensor)"
            )
        raise ValueError(f"a prompt must be 1-D (or a 2-D batch), got shape {tuple(t.shape)}")

    def _draw_ids(self, k: int) -> Tensor:
        ids = torch.arange(self._draws, self._draws + k)
        self._draws += k
        return ids

    def take(self, k: int, generator: torch.Generator, width: int) -> tuple[Tensor, Tensor, Tensor]:
        """``k`` prompts left-padded to ``width``: ``(ids [k, width], mask [k, width], prompt_id [k])`` on the CPU."""
        if self.kind == "sampler":
            return self._take_sampled(k, generator, width)
        out: list[tuple[Tensor, int]] = []
        while len(out) < k:
            if self._pending:
                out.append(self._pending.pop(0))
                continue
            if self.kind == "finite":
                item = self.source[self._cursor % len(self.source)]
                index = self._cursor % len(self.source)
                self._cursor += 1
                self._pending.extend((row, index) for row in self._rows(item))
            else:
                if self._iter is None:
                    self._iter = iter(self.source)
                try:
                    item = next(self._iter)
                except StopIteration:
                    self._iter = iter(self.source)
                    if self._iter is self.source:  # a one-shot iterator cannot be restarted
                        raise ValueError(
                            "the prompt iterator is exhausted; pass a re-iterable source (a list, a DataLoader)"
                        ) from None
                    try:
                        item = next(self._iter)
                    except StopIteration:
                        raise ValueError("the prompt iterable yielded nothing; give a non-empty source") from None
                rows = self._rows(item)
                self._pending.extend(zip(rows, self._draw_ids(len(rows)).tolist()))
        ids, mask = self._pad_rows([row for row, _ in out], width)
        return ids, mask, torch.tensor([i for _, i in out], dtype=torch.long)

    def _take_sampled(self, k: int, generator: torch.Generator, width: int) -> tuple[Tensor, Tensor, Tensor]:
        out = self.source(k, generator)
        prompt_id = None
        if isinstance(out, dict) and "prompt_id" in out:
            prompt_id = torch.as_tensor(out["prompt_id"], dtype=torch.long).reshape(-1)
            if prompt_id.shape != (k,):
                raise ValueError(f"the prompt sampler returned prompt_id of shape {tuple(prompt_id.shape)} for "
                                 f"k={k}; return one id per prompt, shape ({k},)")
        if isinstance(out, Tensor) and out.dim() == 2:  # fast path: already a left-padded batch
            if out.shape[0] != k:
                raise ValueError(f"the prompt sampler returned {out.shape[0]} prompts for k={k}")
            ids, mask = self._pad_batch(out.long(), width)
        else:
            if isinstance(out, (Tensor, dict)):
                rows = self._rows(out)
            else:
                rows = [_token_ids(r) for r in out]
            if len(rows) != k:
                raise ValueError(f"the prompt sampler returned {len(rows)} prompts for k={k}")
            ids, mask = self._pad_rows(rows, width)
        return ids, mask, self._draw_ids(k) if prompt_id is None else prompt_id

    def _pad_batch(self, ids: Tensor, width: int) -> tuple[Tensor, Tensor]:
        mask = ids.ne(self.pad_id).long().cummax(1).values.bool()  # real from the first non-pad token on
        n = mask.sum(1)
        if ids.shape[1] > width:
            too_long = (n > width).nonzero()
            if too_long.numel():
                i = int(too_long[0, 0])
                self._too_long(i, int(n[i]), width)
            ids, mask = ids[:, -width:], mask[:, -width:]
        if bool((n == 0).any()):
            self._too_long(int((n == 0).nonzero()[0, 0]), 0, width)
        pad = width - ids.shape[1]
        if pad:
            ids = torch.cat([torch.full((ids.shape[0], pad), self.pad_id, dtype=torch.long), ids], 1)
            mask = torch.cat([torch.zeros(ids.shape[0], pad, dtype=torch.bool), mask], 1)
        return ids, mask

    def _pad_rows(self, prompts: list[Tensor], width: int) -> tuple[Tensor, Tensor]:
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros(len(prompts), width, dtype=torch.bool)
        for i, p in enumerate(prompts):
            n = p.numel()
            if n == 0 or n > width:
                self._too_long(i, n, width)
            ids[i, width - n :] = p
            mask[i, width - n :] = True
        return ids, mask

    @staticmethod
    def _too_long(i: int, n: int, width: int):
        raise ValueError(
            f"prompt {i} has {n} tokens but the env's prompt_len is P={width}; every prompt needs 1..P "
            f"tokens: raise prompt_len or shorten the prompts"
        )


def _token_ids(item: Any) -> Tensor:
    """One prompt (or a batch of them) as int64 token ids; text is a ``TypeError`` that says how to tokenize it."""
    text = item[0] if isinstance(item, (list, tuple)) and item else item
    if isinstance(text, (str, bytes)):
        raise _text_prompts(f"the string {text[:40]!r}")
    return torch.as_tensor(item, dtype=torch.long)


def _is_token_id(x: Any) -> bool:
    return (isinstance(x, int) and not isinstance(x, bool)) or (isinstance(x, Tensor) and x.dim() == 0)


def _text_prompts(what: str) -> TypeError:
    return TypeError(
        f"TokenLMEnv prompts must be token ids (1-D int tensors or lists, a 2-D left-padded tensor, or dicts with "
        f"input_ids), got {what}; tokenize the text first, e.g. [tokenizer(p)['input_ids'] for p in texts], or train "
        f"on text prompts with TokenLMEnv.from_task(TextTask(examples, reward, tokenizer, max_new_tokens=M), "
        f"num_envs=N) (ppo_objectives.train.text)"
    )


def _one_prompt(what: str, fix: str) -> ValueError:
    return ValueError(
        f"TokenLMEnv prompts is one prompt, {what}, but a batch of prompts is expected (a list of 1-D token-id "
        f"tensors or lists, or a 2-D left-padded tensor [n, P]): iterating it would give single token ids, not "
        f"prompts; pass {fix}"
    )


# --------------------------------------------------------------------------- #
# The environment
# --------------------------------------------------------------------------- #


def _takes_keyword(fn: Callable, name: str) -> bool:
    """Whether ``fn`` has a parameter ``name`` that can be passed by keyword (``**kwargs`` does not count)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no signature (a builtin): the plain call
        return False
    p = params.get(name)
    return p is not None and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)


def _accepts_keyword(fn: Callable, name: str) -> bool:
    """Whether ``fn`` can be called with ``name=`` (a parameter of that name, or ``**kwargs``); ``True`` when its
    signature cannot be read (a builtin: the call will tell)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True
    return _takes_keyword(fn, name) or any(p.kind == p.VAR_KEYWORD for p in params)


def _task_turns(task) -> dict:
    """The multi-turn settings of a task that has an ``env_turn`` method (none for a single-turn task)."""
    if getattr(task, "env_turn", None) is None:
        return {}
    return dict(env_turn_fn=task.env_turn, max_turns=getattr(task, "max_turns", None),
                max_turn_tokens=getattr(task, "max_turn_tokens", None))


class TokenLMEnv(EnvBase):
    """Batched token-by-token generation as a TorchRL environment.

    Args:
        prompts: where prompts come from: a callable ``(k, generator) -> k prompts``
            (a :class:`DigitTask` is one), a 2-D tensor of left-padded prompts or a
            list of token-id sequences (cycled in order), or any iterable /
            ``DataLoader`` yielding prompts, batches of them, or dicts with
            ``input_ids`` (+ ``attention_mask``); exhausted iterables restart.
            Token ids only: text is refused (tokenize it, or use
            :class:`~ppo_objectives.train.text.TextTask` with :meth:`from_task`), and so
            is one prompt given alone (a 1-D tensor or flat list: pass ``[prompt]``).
            Without an ``attention_mask``, only left padding is inferred: the
            leading ``pad_id`` tokens of each row of a 2-D batch. A ``pad_id``
            inside a prompt stays a prompt token; give right-padded prompts
            their ``attention_mask``.
        reward_fn: ``(prompt_ids [k, P], prompt_mask [k, P], response_ids [k, M],
            response_mask [k, M]) -> [k]`` score of each **finished** response (only
            finished rows are passed), placed on its last token. Exactly ``[k]``: any
            other shape (``[k, 1]``, a scalar) is an error. A ``reward_fn`` with a
            ``prompt_id`` parameter also gets the rows' prompt ids ``[k]`` as
            ``prompt_id=`` (how :class:`~ppo_objectives.train.text.TextTask` finds each
            prompt's reward fields).
        num_envs: ``N``, the batch of rows.
        prompt_len: ``P``; longer prompts raise.
        max_new_tokens: ``M``; a row that reaches it without EOS is ``truncated``.
        eos_id / pad_id: token ids.
        vocab_size: ``V`` (the action space).
        token_reward_fn: optional shaping ``(response_ids [N, M], response_mask [N, M],
            index [N]) -> [N]`` added to every step's reward (``index`` = the
            response index of the token just generated).
        device: where the env's tensors live.
        seed: seed of the prompt generator (:meth:`set_seed`).
        env_turn_fn: makes the env **multi-turn** (module docstring, "Multi-turn episodes"):
            called at the end of each assistant turn as ``env_turn_fn(response_ids [r],
            assistant_mask [r], conversation=list)`` (plus ``prompt_id=`` when it takes one)
            and returns the token ids of the environment's turn (a tool result, feedback, the
            next user message: 1-D ints), or ``None`` to end the episode. A function without a
            ``conversation`` parameter (or ``**kwargs``) is refused at construction.
        max_turns: multi-turn: the assistant's turns per episode (default: as many as fit).
        max_turn_tokens: multi-turn: the tokens of one assistant turn (default ``max_new_tokens``).
        group_size: ``G``, responses sampled per prompt (GRPO, RLOO): a full reset draws
            ``N / G`` prompts and gives each to ``G`` consecutive rows, which share a ``group``
            id (``N`` must be a multiple of ``G``). A row that finishes and restarts inside a
            batch draws a prompt of its own, in a group of one (the group estimators give such a
            response advantage 0); with ``reset_at_each_iter=True`` every batch starts with full
            groups. ``G = 1``: every draw is its own group.

    Prompts are left-padded to width ``P`` so every response starts at column
    ``P``. ``reset`` draws a fresh prompt for each row being reset (only those:
    ``_reset`` partial resets draw ``k`` prompts for ``k`` rows). Each row carries its
    prompt's ``prompt_id`` (the index of the prompt in a finite source, the
    ``prompt_id`` entry a sampler returns in a dict with ``input_ids`` /
    ``attention_mask``, else the draw number), which
    :func:`~ppo_objectives.llm.layouts.trajectories_to_llm_batch` keeps per response.

    Example:
        >>> from torchrl.envs.utils import check_env_specs
        >>> from ppo_objectives.train.digit import DigitTask
        >>> env = TokenLMEnv.from_task(DigitTask("copy", 2), num_envs=4, seed=0)
        >>> check_env_specs(env)  # doctest: +ELLIPSIS
        >>> env.batch_size, env.prompt_len, env.max_new_tokens
        (torch.Size([4]), 3, 3)
    """

    def __init__(
        self,
        prompts: Any,
        reward_fn: RewardFn,
        *,
        num_envs: int,
        prompt_len: int,
        max_new_tokens: int,
        vocab_size: int,
        eos_id: int,
        pad_id: int = 0,
        token_reward_fn: Callable[[Tensor, Tensor, Tensor], Tensor] | None = None,
        device: torch.device | str | None = None,
        seed: int | None = None,
        group_size: int = 1,
        env_turn_fn: Callable[..., Any] | None = None,
        max_turns: int | None = None,
        max_turn_tokens: int | None = None,
    ):
        for name, value, low in (
            ("num_envs", num_envs, 1),
            ("group_size", group_size, 1),
            ("prompt_len", prompt_len, 1),
            ("max_new_tokens", max_new_tokens, 1),
            ("vocab_size", vocab_size, 2),
        ):
            _validate.check_int(name, value, low=low, where="TokenLMEnv ")
        for name, value in (("eos_id", eos_id), ("pad_id", pad_id)):
            if not 0 <= value < vocab_size:
                raise ValueError(f"TokenLMEnv {name}={value} is outside the vocabulary [0, {vocab_size})")
        if not callable(reward_fn):
            raise TypeError(f"reward_fn must be callable, got {type(reward_fn).__name__}")
        super().__init__(device=device, batch_size=torch.Size([num_envs]))
        self.prompt_len, self.max_new_tokens, self.vocab_size = prompt_len, max_new_tokens, vocab_size
        self.eos_id, self.pad_id = eos_id, pad_id
        if num_envs % group_size:
            raise ValueError(
                f"TokenLMEnv num_envs={num_envs} is not a multiple of group_size={group_size}: a full reset gives each "
                f"prompt to {group_size} rows; use num_envs={group_size * max(1, num_envs // group_size)}"
            )
        self.group_size = group_size
        self._groups = 0  # groups drawn so far (the next group id)
        self.reward_fn, self.token_reward_fn = reward_fn, token_reward_fn
        self._reward_takes_prompt_id = _takes_keyword(reward_fn, "prompt_id")
        self._set_turns(env_turn_fn, max_turns, max_turn_tokens)
        self._prompts = _PromptStream(prompts, pad_id)
        self._generator = torch.Generator()
        self._make_specs()
        self.set_seed(0 if seed is None else seed)

    def _set_turns(self, env_turn_fn, max_turns, max_turn_tokens) -> None:
        """The multi-turn settings, checked; a single-turn env refuses the turn budgets."""
        self.env_turn_fn = env_turn_fn
        self.multi_turn = env_turn_fn is not None
        if not self.multi_turn:
            given = [n for n, v in (("max_turns", max_turns), ("max_turn_tokens", max_turn_tokens)) if v is not None]
            if given:
                raise ValueError(f"TokenLMEnv {given[0]} budgets the turns of a multi-turn env, and this env has one "
                                 f"turn (no env_turn_fn); pass env_turn_fn= or drop {given[0]}")
            return
        if not callable(env_turn_fn):
            raise TypeError(f"TokenLMEnv env_turn_fn must be callable (response_ids, assistant_mask, conversation=) -> "
                            f"token ids | None, got {type(env_turn_fn).__name__}")
        if not _accepts_keyword(env_turn_fn, "conversation"):
            name = getattr(env_turn_fn, "__name__", type(env_turn_fn).__name__)
            example = name if name.isidentifier() else "env_turn"  # a lambda's name is "<lambda>"
            raise TypeError(
                f"TokenLMEnv env_turn_fn {name}{inspect.signature(env_turn_fn)} has no 'conversation' parameter, "
                f"but the env calls it as env_turn_fn(response_ids, assistant_mask, conversation=list) (plus "
                f"prompt_id= when it takes one); add the parameter, e.g. def {example}(response_ids, assistant_mask, "
                f"conversation): ..., or accept **kwargs"
            )
        if max_turns is not None:
            _validate.check_int("max_turns", max_turns, low=1, where="TokenLMEnv ")
        if max_turn_tokens is not None:
            _validate.check_int("max_turn_tokens", max_turn_tokens, low=1, where="TokenLMEnv ")
            if max_turn_tokens > self.max_new_tokens:
                raise ValueError(f"TokenLMEnv max_turn_tokens={max_turn_tokens} exceeds max_new_tokens="
                                 f"{self.max_new_tokens}, the whole conversation's budget; lower it or raise "
                                 f"max_new_tokens")
        self.max_turns = max_turns
        self.max_turn_tokens = self.max_new_tokens if max_turn_tokens is None else max_turn_tokens
        self._turn_takes_prompt_id = _takes_keyword(env_turn_fn, "prompt_id")
        self._reward_takes_conversation = _takes_keyword(self.reward_fn, "conversation")
        self._conversations: list[list] = [[] for _ in range(self.batch_size[0])]
        #: Environment turns that did not fit the token budget (each ended its episode, truncated).
        self.env_turns_cut = 0
        self._turn_cut = [False] * self.batch_size[0]  # per row: its episode ended on a cut environment turn

    def conversation(self, row: int) -> list:
        """Row ``row``'s conversation list: what ``env_turn_fn`` recorded in it since the row's last reset (the
        env passes it as ``conversation=`` to ``env_turn_fn`` and to a ``reward_fn`` that takes it)."""
        if not self.multi_turn:
            raise ValueError("TokenLMEnv.conversation: this env has one turn (no env_turn_fn), so no conversation")
        return self._conversations[row]

    def turn_cut(self, row: int) -> bool:
        """Whether row ``row``'s episode (since its last reset) ended on an environment turn that did not fit the
        token budget: the turn was dropped (counted in :attr:`env_turns_cut`), so the model never read it, and
        what ``env_turn_fn`` recorded in the conversation for it was taken out again."""
        if not self.multi_turn:
            raise ValueError("TokenLMEnv.turn_cut: this env has one turn (no env_turn_fn), so no environment turn")
        return self._turn_cut[row]

    @classmethod
    def from_task(cls, task: LMTask, *, num_envs: int, max_new_tokens: int | None = None, vocab_size: int | None = None,
                  **kwargs) -> "TokenLMEnv":
        """An env for a task that follows :class:`LMTask`.

        ``vocab_size=`` overrides the task's (e.g. with a model's embedding size when it is
        larger than its tokenizer's).
        """
        return cls(
            task,
            task.reward,
            num_envs=num_envs,
            prompt_len=task.prompt_len,
            max_new_tokens=task.answer_len if max_new_tokens is None else max_new_tokens,
            vocab_size=task.vocab_size if vocab_size is None else vocab_size,
            eos_id=task.eos_id,
            pad_id=task.pad_id,
            **{**_task_turns(task), **kwargs},
        )

    @property
    def seq_len(self) -> int:
        """``S = P + M``, the token buffer length."""
        return self.prompt_len + self.max_new_tokens

    def _make_specs(self) -> None:
        N, S, V, P = self.batch_size[0], self.seq_len, self.vocab_size, self.prompt_len
        self.observation_spec = Composite(
            tokens=Categorical(V, shape=(N, S), dtype=torch.long),
            attention_mask=Categorical(2, shape=(N, S), dtype=torch.bool),
            position=Bounded(low=P, high=S, shape=(N,), dtype=torch.long),
            prompt_id=Unbounded(shape=(N,), dtype=torch.long),
            group=Unbounded(shape=(N,), dtype=torch.long),
            **self._turn_specs(),
            shape=(N,),
        )
        self.action_spec = Categorical(V, shape=(N,), dtype=torch.long)
        self.reward_spec = Unbounded(shape=(N, 1), dtype=torch.float32)
        self.done_spec = Composite(
            done=Categorical(2, shape=(N, 1), dtype=torch.bool),
            terminated=Categorical(2, shape=(N, 1), dtype=torch.bool),
            truncated=Categorical(2, shape=(N, 1), dtype=torch.bool),
            shape=(N,),
        )

    @property
    def max_steps(self) -> int:
        """The most steps (tokens of the policy) an episode can take: ``max_new_tokens``, or in a multi-turn env
        with ``max_turns``, at most ``max_turns * max_turn_tokens`` (a collector batch of ``N * max_steps`` frames
        finishes every row's first episode)."""
        if self.multi_turn and self.max_turns is not None:
            return min(self.max_new_tokens, self.max_turns * self.max_turn_tokens)
        return self.max_new_tokens

    def _turn_specs(self) -> dict:
        """The multi-turn observations: which columns the policy wrote, where its current turn began, and its
        finished turns (none for a single-turn env)."""
        if not self.multi_turn:
            return {}
        N, S, P = self.batch_size[0], self.seq_len, self.prompt_len
        return dict(
            assistant_mask=Categorical(2, shape=(N, S), dtype=torch.bool),
            turn_start=Bounded(low=P, high=S, shape=(N,), dtype=torch.long),
            turns=Unbounded(shape=(N,), dtype=torch.long),
        )

    def _set_seed(self, seed: int | None) -> None:
        self._generator.manual_seed(int(seed) if seed is not None else torch.seed())

    def _reset(self, tensordict: TensorDictBase | None, **kwargs) -> TensorDictBase:
        N, S, P = self.batch_size[0], self.seq_len, self.prompt_len
        reset = tensordict.get("_reset", None) if tensordict is not None else None
        tokens = torch.full((N, S), self.pad_id, dtype=torch.long, device=self.device)
        mask = torch.zeros(N, S, dtype=torch.bool, device=self.device)
        prompt_id = torch.full((N,), -1, dtype=torch.long, device=self.device)
        group = torch.full((N,), -1, dtype=torch.long, device=self.device)
        if reset is None:
            rows = torch.arange(N, device=self.device)
        else:
            rows = reset.reshape(N).nonzero().squeeze(-1)
        G = self.group_size if rows.numel() == N else 1  # a full reset: G rows per prompt; else one each
        ids, pmask, ids_of_prompts = self._prompts.take(rows.numel() // G, self._generator, P)
        if G > 1:
            ids, pmask, ids_of_prompts = (x.repeat_interleave(G, 0) for x in (ids, pmask, ids_of_prompts))
        n_groups = rows.numel() // G
        group[rows] = (torch.arange(self._groups, self._groups + n_groups).repeat_interleave(G)).to(self.device)
        self._groups += n_groups
        bad = pmask & ((ids < 0) | (ids >= self.vocab_size))
        if bool(bad.any()):
            i, j = (int(x) for x in bad.nonzero()[0])
            raise ValueError(
                f"prompt {i} holds token id {int(ids[i, j])}, outside the vocabulary [0, {self.vocab_size}): the "
                f"policy's embedding cannot look it up; fix the prompt source or raise vocab_size"
            )
        tokens[rows, :P] = ids.to(self.device)
        mask[rows, :P] = pmask.to(self.device)
        prompt_id[rows] = ids_of_prompts.to(self.device)
        false = torch.zeros(N, 1, dtype=torch.bool, device=self.device)
        turn_state = {}
        if self.multi_turn:
            for i in rows.tolist():
                self._conversations[i] = []
                self._turn_cut[i] = False
            turn_state = dict(assistant_mask=torch.zeros(N, S, dtype=torch.bool, device=self.device),
                              turn_start=torch.full((N,), P, dtype=torch.long, device=self.device),
                              turns=torch.zeros(N, dtype=torch.long, device=self.device))
        return TensorDict(
            tokens=tokens,
            attention_mask=mask,
            position=torch.full((N,), P, dtype=torch.long, device=self.device),
            prompt_id=prompt_id,
            group=group,
            **turn_state,
            done=false,
            terminated=false.clone(),
            truncated=false.clone(),
            batch_size=self.batch_size,
            device=self.device,
        )

    def _action(self, tensordict: TensorDictBase) -> Tensor:
        """The ``[N]`` token ids of ``action``, refused when not integers."""
        action = tensordict.get("action")
        if action.is_floating_point() or action.is_complex() or action.dtype == torch.bool:
            raise TypeError(
                f"TokenLMEnv.step: action has dtype {action.dtype}, but an action is the next token id; pass an "
                f"integer tensor (e.g. Categorical(logits=logits).sample() or logits.argmax(-1)); a float action "
                f"is never rounded or truncated (3.7 is not token 3)"
            )
        return action.reshape(self.batch_size[0]).long()

    def _raise_out_of_vocab(self, action: Tensor, out_of_vocab: Tensor) -> None:
        i = int(out_of_vocab.nonzero()[0, 0])
        raise ValueError(
            f"action {int(action[i])} of row {i} is outside the vocabulary [0, {self.vocab_size}): an action "
            f"is the next token id; check the policy's output size (V = {self.vocab_size})"
        )

    def _score(self, rows: Tensor, tokens: Tensor, mask: Tensor, response_mask: Tensor, prompt_id: Tensor) -> Tensor:
        """``reward_fn`` of the finished ``rows``, ``[k]`` float32, checked (``response_mask``: the columns
        ``>= P`` the reward reads: the policy's tokens)."""
        P = self.prompt_len
        extra = {"prompt_id": prompt_id[rows]} if self._reward_takes_prompt_id else {}
        if self.multi_turn and self._reward_takes_conversation:
            extra["conversation"] = [self._conversations[i] for i in rows.tolist()]
        score = self.reward_fn(tokens[rows, :P], mask[rows, :P], tokens[rows, P:], response_mask[rows], **extra)
        score = torch.as_tensor(score, dtype=torch.float32, device=self.device)
        if score.shape != rows.shape:
            k = rows.numel()
            raise ValueError(
                f"TokenLMEnv reward_fn returned shape {tuple(score.shape)} for k={k} finished responses; "
                f"expected [k] = ({k},), one score per response (the env places it on the response's last "
                f"token as ('next', 'reward') [N, 1]); return e.g. score.reshape({k}) or score.squeeze(-1)"
            )
        return score

    def _step(self, tensordict: TensorDictBase) -> TensorDictBase:
        if self.multi_turn:
            return self._turn_step(tensordict)
        N, S, P = self.batch_size[0], self.seq_len, self.prompt_len
        action = self._action(tensordict)
        position = tensordict.get("position").reshape(N)
        col = position.clamp(max=S - 1)[:, None]  # a done row stepped again stays in bounds
        tokens = tensordict.get("tokens").scatter(1, col, action[:, None])
        mask = tensordict.get("attention_mask").scatter(1, col, True)
        new_position = position + 1
        terminated = action == self.eos_id
        truncated = (new_position - P >= self.max_new_tokens) & ~terminated
        done = terminated | truncated
        reward = torch.zeros(N, dtype=torch.float32, device=self.device)
        out_of_vocab = (action < 0) | (action >= self.vocab_size)
        bad, any_done = torch.stack([out_of_vocab.any(), done.any()]).tolist()  # one host sync per step
        if bad:
            self._raise_out_of_vocab(action, out_of_vocab)
        prompt_id = tensordict.get("prompt_id").reshape(N)
        if any_done:  # score finished responses only
            rows = done.nonzero().squeeze(-1)
            reward[rows] = self._score(rows, tokens, mask, mask[:, P:], prompt_id)
        if self.token_reward_fn is not None:
            reward = reward + self.token_reward_fn(tokens[:, P:], mask[:, P:], position - P).reshape(N).float()
        return self._next(tensordict, tokens, mask, new_position, prompt_id, reward, terminated, truncated)

    def _next(self, tensordict, tokens, mask, position, prompt_id, reward, terminated, truncated, **turns):
        """The step's output: the next observation (``turns``: a multi-turn env's own entries), reward and flags."""
        N = self.batch_size[0]
        return TensorDict(
            tokens=tokens,
            attention_mask=mask,
            position=position,
            prompt_id=prompt_id,
            group=tensordict.get("group").reshape(N),
            **turns,
            reward=reward[:, None],
            done=(terminated | truncated)[:, None],
            terminated=terminated[:, None],
            truncated=truncated[:, None],
            batch_size=self.batch_size,
            device=self.device,
        )

    # ----------------------------------------------------------------------- #
    # Multi-turn: the environment's turn between the assistant's turns
    # ----------------------------------------------------------------------- #

    def _turn_step(self, tensordict: TensorDictBase) -> TensorDictBase:
        """One token of a multi-turn env: the module docstring's "Multi-turn episodes". A row that is already
        done (stepped again without a reset) is left as it is."""
        N, S, P = self.batch_size[0], self.seq_len, self.prompt_len
        action = self._action(tensordict)
        active = ~tensordict.get("done").reshape(N)
        position = tensordict.get("position").reshape(N)
        col = position.clamp(max=S - 1)[:, None]
        write = active[:, None]
        tokens = tensordict.get("tokens")
        tokens = tokens.scatter(1, col, torch.where(write, action[:, None], tokens.gather(1, col)))
        mask = tensordict.get("attention_mask").clone()
        mask.scatter_(1, col, write | mask.gather(1, col))
        assistant = tensordict.get("assistant_mask").clone()
        assistant.scatter_(1, col, write | assistant.gather(1, col))
        new_position = torch.where(active, position + 1, position)
        turn_start = tensordict.get("turn_start").reshape(N).clone()
        turns = tensordict.get("turns").reshape(N).clone()
        turn_end = active & ((action == self.eos_id) | (new_position - turn_start >= self.max_turn_tokens)
                             | (new_position >= S))
        terminated = tensordict.get("terminated").reshape(N) & ~active
        truncated = tensordict.get("truncated").reshape(N) & ~active
        out_of_vocab = active & ((action < 0) | (action >= self.vocab_size))
        bad, any_end = torch.stack([out_of_vocab.any(), turn_end.any()]).tolist()  # one host sync per step
        if bad:
            self._raise_out_of_vocab(action, out_of_vocab)
        prompt_id = tensordict.get("prompt_id").reshape(N)
        reward = torch.zeros(N, dtype=torch.float32, device=self.device)
        if any_end:
            state = dict(tokens=tokens, mask=mask, assistant=assistant, position=new_position, turn_start=turn_start,
                         turns=turns, terminated=terminated, truncated=truncated)
            for i in turn_end.nonzero().squeeze(-1).tolist():
                self._end_turn(i, state, int(prompt_id[i]))
            rows = (turn_end & (terminated | truncated)).nonzero().squeeze(-1)
            if rows.numel():
                reward[rows] = self._score(rows, tokens, mask, assistant[:, P:], prompt_id)
        if self.token_reward_fn is not None:
            shaping = self.token_reward_fn(tokens[:, P:], assistant[:, P:], position - P).reshape(N).float()
            reward = reward + torch.where(active, shaping, 0.0)
        return self._next(tensordict, tokens, mask, new_position, prompt_id, reward, terminated, truncated,
                          assistant_mask=assistant, turn_start=turn_start, turns=turns)

    def _end_turn(self, i: int, state: dict, prompt_id: int) -> None:
        """Row ``i``'s assistant turn ended: append the environment's turn, or end the episode (``state``'s tensors
        are written in place).

        The episode ends **terminated** when ``env_turn_fn`` returns ``None``, and **truncated** when the token
        budget is spent (no column left), when the turn budget is spent (``max_turns``: the environment's reply is
        not appended), or when the environment's reply does not fit the buffer with a column to spare for the next
        assistant token (the reply is dropped, counted in :attr:`env_turns_cut` and :meth:`turn_cut`). A reply that
        is not appended is taken out of the row's conversation too (what ``env_turn_fn`` appended to it in that
        call), so the episode is scored on the conversation the model read."""
        S, P = self.seq_len, self.prompt_len
        p = int(state["position"][i])
        if p >= S:
            state["truncated"][i] = True
            return
        recorded = len(self._conversations[i])  # what env_turn_fn appends for this turn comes after
        reply = self._env_reply(i, state["tokens"][i, P:p], state["assistant"][i, P:p], prompt_id)
        if reply is None:
            state["terminated"][i] = True
            return
        if self.max_turns is not None and int(state["turns"][i]) + 1 >= self.max_turns:
            del self._conversations[i][recorded:]  # the reply is not appended: the model never reads it
            state["truncated"][i] = True
            return
        k = reply.numel()
        if p + k >= S:  # the model never reads this turn: nothing of it stays in the conversation
            self.env_turns_cut += 1
            self._turn_cut[i] = True
            del self._conversations[i][recorded:]
            state["truncated"][i] = True
            return
        state["tokens"][i, p : p + k] = reply.to(self.device)
        state["mask"][i, p : p + k] = True
        state["position"][i] = state["turn_start"][i] = p + k
        state["turns"][i] += 1

    def _env_reply(self, i: int, response_ids: Tensor, assistant_mask: Tensor, prompt_id: int) -> Tensor | None:
        """``env_turn_fn`` of row ``i``: ``None`` or its reply as 1-D int64 token ids, checked."""
        extra = {"prompt_id": prompt_id} if self._turn_takes_prompt_id else {}
        name = getattr(self.env_turn_fn, "__name__", type(self.env_turn_fn).__name__)
        reply = self.env_turn_fn(response_ids, assistant_mask, conversation=self._conversations[i], **extra)
        if reply is None:
            return None
        if isinstance(reply, Tensor) and (reply.is_floating_point() or reply.dtype == torch.bool):
            ok = False
        else:
            try:
                reply = torch.as_tensor(reply, dtype=torch.long) if not isinstance(reply, Tensor) else reply.long()
                ok = reply.dim() == 1 and reply.numel() > 0
            except (TypeError, ValueError, RuntimeError):
                ok = False
        if not ok:
            raise ValueError(
                f"TokenLMEnv env_turn_fn {name} returned {reply!r} for row {i}: it must return the environment "
                f"turn's token ids (a non-empty 1-D sequence of ints) or None to end the episode"
            )
        bad = (reply < 0) | (reply >= self.vocab_size)
        if bool(bad.any()):
            raise ValueError(
                f"TokenLMEnv env_turn_fn {name} returned token id {int(reply[bad][0])} for row {i}, outside the "
                f"vocabulary [0, {self.vocab_size}); return ids of the env's vocabulary"
            )
        return reply

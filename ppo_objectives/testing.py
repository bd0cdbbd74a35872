"""A testing kit for code built on the package: batch factories, loop references, tiny networks, assertions.

For people who compose the package's modules with their own (a reward shaper,
a custom loss, a new critic) and want to unit-test them without a language
model or a collector. Everything here is deterministic given a seed and small
enough to run in milliseconds.

- **Batch factories** for the layouts of ``ppo_objectives/layouts.py``:
  :func:`response_batch` (what :func:`~ppo_objectives.layouts.trajectories_to_llm_batch`
  produces, plus what the training job adds), :func:`full_sequence_batch`
  (what :class:`~ppo_objectives.layouts.LLMToTokenBatch` produces, plus the
  critic's values) and :func:`collector_batch` (TorchRL collector rows with
  done / terminated / truncated flags). :func:`make_mask` draws the masks:
  ``MASK_KINDS`` names them.
- **Reference implementations**, plain Python loops over floats that share no
  code with the package: :func:`reference_gae_response`,
  :func:`reference_gae_collector` (the semantics of
  :func:`~ppo_objectives.functional.masked_gae`, ``docs/design.md``
  "GAE semantics"), :func:`reference_gae_tensordict` (what
  :class:`~ppo_objectives.value.MaskedGAE` writes), :func:`reference_ppo_policy_loss`
  and :func:`reference_kl` (the k1 / k2 / k3 estimators).
- **Tiny networks**: :func:`tiny_actor_critic` returns a bigram actor (writes
  ``log_prob`` and ``entropy``) and critic (writes ``state_value``) as
  TensorDict modules that read either layout and train with
  :class:`~ppo_objectives.loss.TokenPPOLoss`.
- **A tiny chat model**: :func:`tiny_chat_tokenizer` (a byte-level BPE tokenizer with a
  chat template, trained in code) and :func:`tiny_chat_checkpoint` (a random Llama saved
  with it), to test text tasks and rewards offline as a real instruct model is used.
- **Assertions**: :func:`assert_mask_invariant` (garbage and NaN at masked
  positions of a module's per-token inputs change none of its valid outputs,
  and masked outputs stay 0) and :func:`assert_matches_reference` (a tolerance
  check whose message gives the largest absolute and relative errors and where).

The same helpers are pytest fixtures (``ppo_response_batch``,
``ppo_tiny_actor_critic``, ...) in any test file once the package is installed:
see ``ppo_objectives/pytest_plugin.py``.

Example:
    >>> import torch
    >>> from ppo_objectives import MaskedGAE
    >>> from ppo_objectives.testing import (
    ...     assert_mask_invariant, assert_matches_reference, reference_gae_tensordict, response_batch)
    >>> td = response_batch(batch_size=4, response_len=5, mask="holes", seed=0)
    >>> gae = MaskedGAE(gamma=1.0, lmbda=0.95)
    >>> want = reference_gae_tensordict(td, gamma=1.0, lmbda=0.95)
    >>> assert_matches_reference(gae(td.clone())["advantage"], want[0], name="advantage")
    >>> report = assert_mask_invariant(gae, td)
    >>> report.outputs
    [('advantage',), ('value_target',)]
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import TensorDictModule
from tensordict.utils import NestedKey
from torch import Tensor, nn

__all__ = [
    "CHAT_TEMPLATE",
    "MASK_KINDS",
    "MaskInvariantReport",
    "TinyTokenCritic",
    "TinyTokenPolicy",
    "assert_mask_invariant",
    "assert_matches_reference",
    "collector_batch",
    "full_sequence_batch",
    "make_generator",
    "make_mask",
    "reference_gae_collector",
    "reference_gae_response",
    "reference_gae_tensordict",
    "reference_kl",
    "reference_ppo_policy_loss",
    "response_batch",
    "tiny_actor_critic",
    "tiny_chat_checkpoint",
    "tiny_chat_tokenizer",
]

#: The mask kinds of :func:`make_mask` and of every batch factory's ``mask=``.
MASK_KINDS = ("right", "left", "holes", "empty_rows", "all_valid", "mixed")

_ROW_KINDS = ("right", "left", "holes", "empty_rows", "all_valid")


# --------------------------------------------------------------------------- #
# Randomness and masks
# --------------------------------------------------------------------------- #


def make_generator(seed: int | None = None, generator: torch.Generator | None = None) -> torch.Generator:
    """The CPU generator every factory draws from: ``generator`` itself, or a new one seeded with ``seed``.

    Give at most one of them; with neither the seed is 0, so an unseeded call is
    still reproducible. The factories draw on the CPU and move the result to
    ``device``, so a batch is the same on every device.

    Args:
        seed: an integer seed.
        generator: a ``torch.Generator`` on the CPU (advanced by the draws).

    Returns:
        A ``torch.Generator``.

    Example:
        >>> g = make_generator(seed=3)
        >>> bool(torch.rand(2, generator=g).equal(torch.rand(2, generator=make_generator(seed=3))))
        True
    """
    if seed is not None and generator is not None:
        raise ValueError("give seed= or generator=, not both (a generator already carries its seed)")
    if generator is not None:
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
        if generator.device.type != "cpu":
            raise ValueError(
                f"generator is on {generator.device}: the factories draw on the CPU (pass a CPU generator and "
                f"device= for where the batch goes)"
            )
        return generator
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise TypeError(f"seed must be an int, got {seed!r}")
    return torch.Generator().manual_seed(0 if seed is None else seed)


def _check_size(name: str, x: object, low: int) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or x < low:
        raise ValueError(f"{name} must be an int >= {low}, got {x!r}")
    return x


def _randint(low: int, high: int, g: torch.Generator) -> int:
    """An int in [low, high] (both included)."""
    return int(torch.randint(low, high + 1, (), generator=g))


def _row_mask(kind: str, length: int, g: torch.Generator) -> list[bool]:
    if kind == "all_valid":
        return [True] * length
    if kind == "empty_rows":
        return [False] * length
    if length == 0:
        return []
    if kind in ("right", "left"):
        n = _randint(1, length, g)
        return [j < n for j in range(length)] if kind == "right" else [j >= length - n for j in range(length)]
    # holes: runs of valid and masked tokens (a hole may open the row, as a prompt does), then padding
    end = _randint(max(1, (length + 1) // 2), length, g)
    row, valid = [], bool(torch.rand((), generator=g) < 0.5)
    while len(row) < end:
        row.extend([valid] * _randint(1, 3, g))
        valid = not valid
    row = row[:end] + [False] * (length - end)
    if not any(row):
        row[_randint(0, end - 1, g)] = True
    if end >= 3 and all(row[:end]):  # a hole between two valid tokens (shorter rows end with padding)
        row[_randint(1, end - 2, g)] = False
    return row


def make_mask(
    batch_size: int,
    length: int,
    kind: str = "right",
    *,
    seed: int | None = None,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> Tensor:
    """A random bool mask ``[batch_size, length]`` of one of the :data:`MASK_KINDS`.

    - ``"right"``: each row valid on a prefix of 1 to ``length`` tokens, then padding
      (the response layout);
    - ``"left"``: each row valid on a suffix (left padding);
    - ``"holes"``: runs of valid and masked tokens inside the row, then right padding
      (the full-sequence layout: prompt, user and tool tokens are holes); every row
      has a valid token, and a hole when ``length >= 3``;
    - ``"empty_rows"``: right padding, with at least one row (not all of them when
      ``batch_size > 1``) without any valid token;
    - ``"all_valid"``: all True;
    - ``"mixed"``: each row of one of the five kinds above, every kind present
      when ``batch_size >= 5``.

    Every kind but ``"all_valid"`` has at least one masked position when ``length > 1``.

    Args:
        batch_size: rows ``B``.
        length: columns ``R`` (or ``T``).
        kind: one of :data:`MASK_KINDS`.
        seed / generator: the randomness (see :func:`make_generator`).
        device: where the mask goes.

    Returns:
        ``[batch_size, length]`` bool tensor.

    Example:
        >>> make_mask(3, 4, "right", seed=0).sum(-1).tolist()
        [1, 4, 2]
        >>> make_mask(2, 3, "empty_rows", seed=0).any(-1).tolist()
        [True, False]
    """
    _check_size("batch_size", batch_size, 0)
    _check_size("length", length, 0)
    if kind not in MASK_KINDS:
        raise ValueError(f"kind={kind!r} is not one of {MASK_KINDS}")
    g = make_generator(seed, generator)
    if kind == "mixed":
        offset = _randint(0, len(_ROW_KINDS) - 1, g)
        kinds = [_ROW_KINDS[(offset + b) % len(_ROW_KINDS)] for b in range(batch_size)]
    elif kind == "empty_rows":
        empty = (torch.rand(batch_size, generator=g) < 0.5).tolist()
        if batch_size:
            empty[_randint(0, batch_size - 1, g)] = True
            if batch_size > 1 and all(empty):
                empty[_randint(0, batch_size - 1, g)] = False
        kinds = ["empty_rows" if e else "right" for e in empty]
    else:
        kinds = [kind] * batch_size
    rows = [_row_mask(k, length, g) for k in kinds]
    if kind != "all_valid" and batch_size and length > 1 and all(all(row) for row in rows):
        # nothing masked: a batch of this kind is there to exercise masked positions, so shorten one row
        b, n = _randint(0, batch_size - 1, g), _randint(1, length - 1, g)
        rows[b] = [j >= length - n for j in range(length)] if kind == "left" else [j < n for j in range(length)]
    return torch.tensor(rows, dtype=torch.bool).reshape(batch_size, length).to(device)


def _log_probs(shape: tuple[int, ...], g: torch.Generator) -> Tensor:
    """Plausible log-probs of sampled tokens: in [-3, -0.05]."""
    return -(0.05 + 2.95 * torch.rand(shape, generator=g))


def _fill(x: Tensor, mask: Tensor, value: float) -> Tensor:
    """``x`` on the mask, ``value`` elsewhere (``mask`` broadcast over a trailing 1)."""
    m = mask if mask.shape == x.shape else mask.reshape(x.shape)
    return torch.where(m, x, torch.full((), value, dtype=x.dtype))


def _whiten(adv: Tensor, mask: Tensor) -> Tensor:
    """Whitened over the valid entries (biased variance, eps 1e-8), 0 elsewhere: plain Python sums."""
    vals = [a for a, m in zip(adv.reshape(-1).tolist(), mask.reshape(-1).tolist()) if m]
    n = len(vals)
    mean = sum(vals) / n if n else 0.0
    var = sum((a - mean) ** 2 for a in vals) / n if n else 0.0
    scale = 1.0 / math.sqrt(var + 1e-8)
    out = [(a - mean) * scale if m else 0.0 for a, m in zip(adv.reshape(-1).tolist(), mask.reshape(-1).tolist())]
    return torch.tensor(out, dtype=torch.float64).reshape(adv.shape)


# --------------------------------------------------------------------------- #
# Batch factories
# --------------------------------------------------------------------------- #


def response_batch(
    batch_size: int = 4,
    response_len: int = 6,
    prompt_len: int = 3,
    *,
    mask: str = "right",
    vocab_size: int = 16,
    with_values: bool = True,
    with_ref_log_prob: bool = True,
    with_advantage: bool = False,
    gamma: float = 1.0,
    lmbda: float = 0.95,
    masked_fill: float = 0.0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    seed: int | None = None,
    generator: torch.Generator | None = None,
) -> TensorDict:
    """A random response-layout batch, as :func:`~ppo_objectives.layouts.trajectories_to_llm_batch` returns it.

    A ``[B]`` TensorDict with the ``[B, P + R]`` ``input_ids`` / ``attention_mask``
    (left-padded prompts of 1 to ``P`` tokens, then the response) and the
    ``[B, R]`` per-token entries ``response_ids``, ``mask``, ``sample_log_prob``,
    ``token_reward`` (small shaping on every token, the score on the last one)
    and the per-row ``score`` / ``terminated`` / ``truncated``; then what the
    training job adds before the loss: ``("next", "reward")`` (a copy of
    ``token_reward``), ``state_value`` (the critic at rollout time),
    ``ref_log_prob`` and, with ``with_advantage=True``, ``advantage`` (whitened)
    and ``value_target`` from :func:`reference_gae_response`. Token ids are in
    ``[1, vocab_size)``, 0 is padding. Every ``[B, R]`` float entry holds
    ``masked_fill`` off the mask (0 as the converter writes; NaN to check that a
    module never reads there).

    ``trajectories_to_llm_batch`` only produces right padding (``mask="right"``);
    the other :data:`MASK_KINDS` test the masked semantics every module keeps
    (holes are real tokens in ``attention_mask``, left padding is not). Use
    ``response_len >= 2``: a ``[B]`` TensorDict with ``[B, 1]`` entries reads as
    TorchRL's per-step layout (``ppo_objectives/layouts.py``, "Batch shape").

    Args:
        batch_size / response_len / prompt_len: ``B``, ``R`` and ``P``.
        mask: one of :data:`MASK_KINDS`.
        vocab_size: token ids are below it (the tiny networks' default is the same, 16).
        with_values / with_ref_log_prob / with_advantage: add those entries.
        gamma / lmbda: the GAE parameters of ``advantage`` / ``value_target``.
        masked_fill: the value of the float per-token entries off the mask.
        dtype: float dtype of the float entries.
        device: where the batch goes.
        seed / generator: the randomness (see :func:`make_generator`).

    Returns:
        ``TensorDict`` with ``batch_size=[B]``.

    Example:
        >>> td = response_batch(batch_size=2, response_len=4, prompt_len=3, seed=0)
        >>> td.batch_size, td["input_ids"].shape, td["mask"].shape, td["next", "reward"].shape
        (torch.Size([2]), torch.Size([2, 7]), torch.Size([2, 4]), torch.Size([2, 4]))
        >>> bool((td["sample_log_prob"][~td["mask"]] == 0).all())
        True
    """
    B = _check_size("batch_size", batch_size, 1)
    R = _check_size("response_len", response_len, 1)
    P = _check_size("prompt_len", prompt_len, 1)
    V = _check_size("vocab_size", vocab_size, 2)
    if not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating dtype, got {dtype}")
    g = make_generator(seed, generator)
    m = make_mask(B, R, mask, generator=g)
    ids, attention, last = _response_tokens(m, P, V, g)
    score, terminated, truncated, token_reward = _response_outcome(m, last, g, dtype, masked_fill)
    slp = _fill(_log_probs((B, R), g).to(dtype), m, masked_fill)
    out = TensorDict(
        {
            "input_ids": ids,
            "attention_mask": attention,
            "response_ids": ids[:, P:].clone(),
            "mask": m,
            "sample_log_prob": slp,
            "token_reward": token_reward,
            "score": score,
            "terminated": terminated,
            "truncated": truncated,
            ("next", "reward"): token_reward.clone(),
        },
        batch_size=[B],
    )
    if with_advantage and not with_values:
        raise ValueError("with_advantage=True needs with_values=True (GAE reads state_value)")
    if with_values:
        out.set("state_value", _fill((0.5 * torch.randn(B, R, generator=g)).to(dtype), m, masked_fill))
    if with_ref_log_prob:
        ref = slp.double() + 0.1 * torch.randn(B, R, generator=g, dtype=torch.float64)
        out.set("ref_log_prob", _fill(ref.to(dtype), m, masked_fill))
    if with_advantage:
        adv, ret = reference_gae_response(token_reward, out["state_value"], m, gamma, lmbda, normalize=True)
        out.set("advantage", _fill(adv.to(dtype), m, masked_fill))
        out.set("value_target", _fill(ret.to(dtype), m, masked_fill))
    return out.to(device) if device is not None else out


def _response_outcome(m: Tensor, last: Tensor, g: torch.Generator, dtype, masked_fill):
    """Per row ``score`` / ``terminated`` / ``truncated`` and the ``[B, R]`` ``token_reward``
    (small shaping on every token, the score on the last valid one)."""
    B, R = m.shape
    nonempty = m.any(-1)
    truncated = nonempty & (last == R - 1)
    terminated = nonempty & ~truncated
    score = torch.where(nonempty, torch.randn(B, generator=g), 0.0).to(dtype)
    shaping = 0.1 * torch.randn(B, R, generator=g)
    last_tok = torch.arange(R) == last[:, None]
    token_reward = _fill((shaping + torch.where(last_tok, score[:, None].double(), 0.0)).to(dtype), m, masked_fill)
    return score, terminated, truncated, token_reward


def _response_tokens(m: Tensor, P: int, V: int, g: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
    """``input_ids`` / ``attention_mask`` ``[B, P + R]`` (left-padded prompts of 1 to ``P`` tokens,
    response columns from the first to the last valid token, holes included) and the last valid
    response position of each row (-1 for an empty row)."""
    B, R = m.shape
    pos = torch.arange(R)
    first = torch.where(m, pos, R).amin(-1)
    last = torch.where(m, pos, -1).amax(-1)
    real = (pos >= first[:, None]) & (pos <= last[:, None])  # response columns holding tokens (holes included)
    prompt_lens = torch.randint(1, P + 1, (B,), generator=g)
    prompt_real = torch.arange(P) >= (P - prompt_lens[:, None])
    ids = torch.randint(1, V, (B, P + R), generator=g)
    attention = torch.cat([prompt_real, real], -1)
    return torch.where(attention, ids, 0), attention, last


def _step_flags(m: Tensor, g: torch.Generator, done_prob: float, truncated_prob: float, *, every_step: bool):
    """``(terminated, truncated)`` ``[N, T]``: on random valid steps (or each row's last valid step)."""
    N, T = m.shape
    u = torch.rand(N, T, generator=g)
    kind = torch.rand(N, T, generator=g)
    if every_step:
        done = m & (u < done_prob)
    else:
        last = torch.where(m, torch.arange(T), -1).amax(-1)
        done = m & (torch.arange(T) == last[:, None]) & (u < done_prob)
    truncated = done & (kind < truncated_prob)
    return done & ~truncated, truncated


def _turns(m: Tensor) -> tuple[Tensor, Tensor]:
    """The index of each run of generated tokens (-1 on holes) and where each run ends."""
    B = m.shape[0]
    prev = torch.cat([torch.zeros(B, 1, dtype=torch.bool), m[:, :-1]], -1)
    nxt = torch.cat([m[:, 1:], torch.zeros(B, 1, dtype=torch.bool)], -1)
    return torch.where(m, (m & ~prev).long().cumsum(-1) - 1, -1), m & ~nxt


def full_sequence_batch(
    batch_size: int = 3,
    seq_len: int = 10,
    *,
    mask: str = "holes",
    vocab_size: int = 16,
    done_prob: float = 0.7,
    truncated_prob: float = 0.3,
    with_values: bool = True,
    with_ref_log_prob: bool = False,
    trailing_dim: bool = True,
    masked_fill: float = 0.0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    seed: int | None = None,
    generator: torch.Generator | None = None,
) -> TensorDict:
    """A random full-sequence-layout batch, as :class:`~ppo_objectives.layouts.LLMToTokenBatch` returns it.

    A ``[B, T]`` TensorDict, one dialog per row: ``tokens`` (ids in
    ``[1, vocab_size)``, 0 on the right padding), ``attention_mask`` (True on
    real tokens, holes included), ``mask`` (True on generated tokens; by default
    with holes, as prompts and user/tool turns are), ``turn`` (the index of the
    run of generated tokens, -1 on holes), ``sample_log_prob``, a reward per
    turn on its last generated token ``("next", "reward")`` and the dialog's
    flags ``("next", "done" / "terminated" / "truncated")`` on its last generated
    token (a dialog ends with probability ``done_prob``, truncated with
    probability ``truncated_prob`` given that; the others are cut by the batch
    boundary: all False). With ``with_values`` the critic's ``state_value`` and
    ``("next", "state_value")`` are added; with ``with_ref_log_prob`` the
    reference's ``ref_log_prob``. Per-step entries carry TorchRL's trailing 1
    (``[B, T, 1]``) as the converter writes them; ``trailing_dim=False`` gives
    ``[B, T]`` everywhere. Float entries hold ``masked_fill`` off the mask.

    Args:
        batch_size / seq_len: ``B`` and ``T``.
        mask: one of :data:`MASK_KINDS` (default ``"holes"``).
        vocab_size: token ids are below it.
        done_prob / truncated_prob: how dialogs end (see above).
        with_values / with_ref_log_prob: add those entries.
        trailing_dim: per-step entries as ``[B, T, 1]`` (default) or ``[B, T]``.
        masked_fill: the value of the float per-token entries off the mask.
        dtype: float dtype of the float entries.
        device: where the batch goes.
        seed / generator: the randomness (see :func:`make_generator`).

    Returns:
        ``TensorDict`` with ``batch_size=[B, T]``.

    Example:
        >>> td = full_sequence_batch(batch_size=2, seq_len=8, seed=0)
        >>> td.batch_size, td["next", "done"].shape
        (torch.Size([2, 8]), torch.Size([2, 8, 1]))
        >>> bool((td["turn"][~td["mask"]] == -1).all())
        True
    """
    B = _check_size("batch_size", batch_size, 1)
    T = _check_size("seq_len", seq_len, 1)
    V = _check_size("vocab_size", vocab_size, 2)
    for name, p in (("done_prob", done_prob), ("truncated_prob", truncated_prob)):
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {p!r}")
    g = make_generator(seed, generator)
    m = make_mask(B, T, mask, generator=g)
    pos = torch.arange(T)
    last = torch.where(m, pos, -1).amax(-1)
    length = torch.stack([torch.randint(int(l) + 1, T + 1, (), generator=g) for l in last.tolist()])  # noqa: E741
    attention = pos < length[:, None]
    tokens = torch.where(attention, torch.randint(1, V, (B, T), generator=g), 0)
    turn, turn_end = _turns(m)
    reward = _fill(torch.where(turn_end, torch.randn(B, T, generator=g), 0.0).to(dtype), m, masked_fill)
    terminated, truncated = _step_flags(m, g, done_prob, truncated_prob, every_step=False)
    step = (lambda x: x.unsqueeze(-1)) if trailing_dim else (lambda x: x)  # noqa: E731
    slp = _fill(_log_probs((B, T), g).to(dtype), m, masked_fill)
    out = TensorDict(
        {
            "tokens": tokens,
            "attention_mask": attention,
            "mask": m,
            "turn": turn,
            "sample_log_prob": slp,
            ("next", "reward"): step(reward),
            ("next", "done"): step(terminated | truncated),
            ("next", "terminated"): step(terminated),
            ("next", "truncated"): step(truncated),
        },
        batch_size=[B, T],
    )
    if with_values:
        v = 0.5 * torch.randn(B, T, generator=g)
        nv = torch.cat([v[:, 1:], 0.5 * torch.randn(B, 1, generator=g)], -1)  # the value of the next token
        out.set("state_value", step(_fill(v.to(dtype), m, masked_fill)))
        out.set(("next", "state_value"), step(_fill(nv.to(dtype), m, masked_fill)))
    if with_ref_log_prob:
        ref = slp.double() + 0.1 * torch.randn(B, T, generator=g, dtype=torch.float64)
        out.set("ref_log_prob", _fill(ref.to(dtype), m, masked_fill))
    return out.to(device) if device is not None else out


def collector_batch(
    num_envs: int = 3,
    steps: int = 8,
    *,
    mask: str | None = None,
    done_prob: float = 0.25,
    truncated_prob: float = 0.4,
    flags: Sequence[str] = ("done", "terminated", "truncated"),
    trailing_dim: bool = True,
    masked_fill: float = 0.0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    seed: int | None = None,
    generator: torch.Generator | None = None,
) -> TensorDict:
    """Random TorchRL collector rows ``[N, T]``: several trajectories back to back per row.

    Entries: ``state_value``, ``("next", "state_value")``, ``("next", "reward")``
    and the flags named in ``flags`` among ``("next", "done")``,
    ``("next", "terminated")`` and ``("next", "truncated")`` (a step ends its
    trajectory with probability ``done_prob``, truncated with probability
    ``truncated_prob`` given that; ``done = terminated | truncated``; the last
    trajectory of a row is cut by the batch boundary). The values are
    consistent as a collector's are: inside a trajectory
    ``("next", "state_value")[t]`` is ``state_value[t + 1]``, so
    :class:`torchrl.objectives.value.GAE` gives the same numbers as
    :class:`~ppo_objectives.value.MaskedGAE` on them. ``mask=None`` (the
    default) writes no ``mask``, as TorchRL batches have none; a kind of
    :data:`MASK_KINDS` adds one (flags then only fall on valid steps, and float
    entries hold ``masked_fill`` off the mask). Per-step entries carry TorchRL's
    trailing 1 unless ``trailing_dim=False``.

    Args:
        num_envs / steps: ``N`` and ``T``.
        mask: ``None`` or one of :data:`MASK_KINDS`.
        done_prob / truncated_prob: how often trajectories end, and how.
        flags: which of ``"done"``, ``"terminated"``, ``"truncated"`` to write (at
            least one; ``MaskedGAE`` completes the others with
            :func:`~ppo_objectives.functional.resolve_done_flags`).
        trailing_dim: per-step entries as ``[N, T, 1]`` (default) or ``[N, T]``.
        masked_fill: the value of the float entries off the mask (with ``mask``).
        dtype: float dtype.
        device: where the batch goes.
        seed / generator: the randomness (see :func:`make_generator`).

    Returns:
        ``TensorDict`` with ``batch_size=[N, T]``.

    Example:
        >>> td = collector_batch(num_envs=2, steps=5, seed=0)
        >>> td.batch_size, td["next", "done"].shape, "mask" in td.keys()
        (torch.Size([2, 5]), torch.Size([2, 5, 1]), False)
        >>> d, te, tr = (td["next", k] for k in ("done", "terminated", "truncated"))
        >>> bool((d == (te | tr)).all())
        True
    """
    N = _check_size("num_envs", num_envs, 1)
    T = _check_size("steps", steps, 1)
    flags = tuple(flags)
    if not flags or any(f not in ("done", "terminated", "truncated") for f in flags):
        raise ValueError(f"flags={flags!r}: give one or more of 'done', 'terminated', 'truncated'")
    for name, p in (("done_prob", done_prob), ("truncated_prob", truncated_prob)):
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {p!r}")
    g = make_generator(seed, generator)
    m = torch.ones(N, T, dtype=torch.bool) if mask is None else make_mask(N, T, mask, generator=g)
    terminated, truncated = _step_flags(m, g, done_prob, truncated_prob, every_step=True)
    done = terminated | truncated
    v = 0.5 * torch.randn(N, T, generator=g)
    fresh = 0.5 * torch.randn(N, T, generator=g)  # the state after an end (or after the batch)
    # inside a trajectory the next state's value is the value of the next valid step
    nv_rows, v_rows, m_rows, d_rows = fresh.tolist(), v.tolist(), m.tolist(), done.tolist()
    for n in range(N):
        valid = [t for t in range(T) if m_rows[n][t]]
        for t, t_next in zip(valid, valid[1:]):
            if not d_rows[n][t]:
                nv_rows[n][t] = v_rows[n][t_next]
    nv = torch.tensor(nv_rows, dtype=torch.float32).reshape(N, T)
    reward = torch.randn(N, T, generator=g)
    step = (lambda x: x.unsqueeze(-1)) if trailing_dim else (lambda x: x)  # noqa: E731
    fill = (lambda x: x) if mask is None else (lambda x: _fill(x, m, masked_fill))  # noqa: E731
    entries = {
        "state_value": step(fill(v.to(dtype))),
        ("next", "state_value"): step(fill(nv.to(dtype))),
        ("next", "reward"): step(fill(reward.to(dtype))),
    }
    for name, x in (("done", done), ("terminated", terminated), ("truncated", truncated)):
        if name in flags:
            entries[("next", name)] = step(x)
    if mask is not None:
        entries["mask"] = step(m)
    out = TensorDict(entries, batch_size=[N, T])
    return out.to(device) if device is not None else out


# --------------------------------------------------------------------------- #
# Reference implementations: plain Python loops over floats
# --------------------------------------------------------------------------- #


def _rows_of(x: Tensor | None, shape: torch.Size, name: str, *, as_bool: bool = False) -> list[list] | None:
    """``x`` as a list of rows of Python numbers (``[*B, T]`` flattened to rows)."""
    if x is None:
        return None
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.shape != shape:
        raise ValueError(f"{name} has shape {tuple(x.shape)} but the rewards have shape {tuple(shape)}; use [*B, T]")
    flat = x.detach().reshape(-1, shape[-1]).cpu()
    return (flat > 0.5 if not x.dtype == torch.bool else flat).tolist() if as_bool else flat.double().tolist()


def _gae_rows(r, v, m, gamma, lam, ends, end_values):
    """Raw advantages, row by row, over the valid steps: the recursion of ``docs/design.md``."""
    out = []
    for b in range(len(r)):
        T = len(r[b])
        adv = [0.0] * T
        valid = [t for t in range(T) if m[b][t]]
        next_v, next_a = 0.0, 0.0
        for i in range(len(valid) - 1, -1, -1):
            t = valid[i]
            if i == len(valid) - 1 or ends[b][t]:  # a trajectory ends here: bootstrap, carry nothing
                next_v, next_a = end_values[b][t], 0.0
            delta = r[b][t] + gamma * next_v - v[b][t]
            adv[t] = delta + gamma * lam * next_a
            next_v, next_a = v[b][t], adv[t]
        out.append(adv)
    return out


def _gae_out(adv_rows, v, m, shape, normalize):
    adv = torch.tensor(adv_rows, dtype=torch.float64).reshape(shape)
    values = torch.tensor(v, dtype=torch.float64).reshape(shape)
    mask = torch.tensor(m, dtype=torch.bool).reshape(shape)
    ret = torch.where(mask, adv + values, 0.0)
    return (_whiten(adv, mask) if normalize else adv), ret


def _check_rewards(rewards: Tensor) -> torch.Size:
    if not isinstance(rewards, Tensor) or not rewards.is_floating_point() or rewards.dim() < 1:
        raise TypeError("rewards must be a floating-point tensor [*B, T]")
    return rewards.shape


def reference_gae_response(
    rewards: Tensor,
    values: Tensor,
    mask: Tensor | None,
    gamma: float,
    lam: float,
    *,
    bootstrap_value: Tensor | None = None,
    normalize: bool = False,
) -> tuple[Tensor, Tensor]:
    """GAE of response rows, one trajectory per row, as a plain loop (the response form of ``masked_gae``).

    For each row, backwards over its valid steps only (``t + 1`` is the next
    valid step; masked steps are never read)::

        next_v, next_a = bootstrap_value[b] (0 by default), 0
        delta = r[t] + gamma * next_v - v[t];  A[t] = delta + gamma * lam * next_a
        next_v, next_a = v[t], A[t]

    Returns are the raw advantages plus the values; with ``normalize=True`` the
    advantages are whitened over the valid steps of the whole batch (biased
    variance, ``(A - mean) / sqrt(var + 1e-8)``), as
    :func:`~ppo_objectives.functional.masked_gae` does by default. Both outputs
    are 0 off the mask. Computed in float64 with Python floats.

    Args:
        rewards / values: ``[*B, T]`` float tensors.
        mask: ``[*B, T]`` bool or {0, 1}, or ``None`` (all valid).
        gamma / lam: discount and GAE lambda.
        bootstrap_value: ``[*B]`` value after each row's last valid step.
        normalize: whiten the advantages (default False, unlike ``masked_gae``).

    Returns:
        ``(advantages, returns)``, float64 ``[*B, T]``.

    Example:
        >>> r, v = torch.tensor([[0.0, 0.0, 1.0, 5.0]]), torch.tensor([[0.5, 0.5, 0.5, float("nan")]])
        >>> reference_gae_response(r, v, torch.tensor([[1, 1, 1, 0]]), 1.0, 1.0)[0]
        tensor([[0.5000, 0.5000, 0.5000, 0.0000]], dtype=torch.float64)
    """
    shape = _check_rewards(rewards)
    r, v = _rows_of(rewards, shape, "rewards"), _rows_of(values, shape, "values")
    m = _rows_of(mask, shape, "mask", as_bool=True) if mask is not None else [[True] * shape[-1] for _ in r]
    if bootstrap_value is None:
        boot = [0.0] * len(r)
    else:
        if bootstrap_value.shape != shape[:-1]:
            raise ValueError(f"bootstrap_value has shape {tuple(bootstrap_value.shape)}, expected [*B] = {tuple(shape[:-1])}")
        boot = bootstrap_value.detach().reshape(-1).double().cpu().tolist()
    ends = [[False] * shape[-1] for _ in r]
    end_values = [[boot[b]] * shape[-1] for b in range(len(r))]
    return _gae_out(_gae_rows(r, v, m, gamma, lam, ends, end_values), v, m, shape, normalize)


def _complete_flags(done, terminated, truncated):
    """TorchRL's flag completion, on lists of rows of bools: ``(done, terminated)``."""
    if done is None and terminated is None and truncated is None:
        raise ValueError("give at least one of done, terminated, truncated")
    rows = len(next(f for f in (done, terminated, truncated) if f is not None))
    T = len(next(f for f in (done, terminated, truncated) if f is not None)[0]) if rows else 0

    def get(f, b, t):
        return None if f is None else bool(f[b][t])

    d_out, te_out = [], []
    for b in range(rows):
        d_row, te_row = [], []
        for t in range(T):
            d, te, tr = get(done, b, t), get(terminated, b, t), get(truncated, b, t)
            if d is None:
                d = bool(te) or bool(tr)
            if te is None:
                te = d and not tr if tr is not None else d
            d_row.append(d)
            te_row.append(te)
        d_out.append(d_row)
        te_out.append(te_row)
    return d_out, te_out


def reference_gae_collector(
    rewards: Tensor,
    values: Tensor,
    next_values: Tensor | None,
    gamma: float,
    lam: float,
    *,
    done: Tensor | None = None,
    terminated: Tensor | None = None,
    truncated: Tensor | None = None,
    mask: Tensor | None = None,
    normalize: bool = False,
) -> tuple[Tensor, Tensor]:
    """GAE of TorchRL collector rows (several trajectories per row) as a plain loop.

    The semantics of :func:`~ppo_objectives.functional.masked_gae` with
    ``done`` / ``terminated`` / ``next_values`` (``docs/design.md``, "GAE
    semantics"): backwards over the valid steps of each row; a valid step with
    ``done`` ends a trajectory, and so does the row's last valid step (the batch
    boundary). At an end nothing is carried from the right and the next value is
    0 if the step is ``terminated``, else ``next_values`` there (0 when
    ``next_values`` is ``None``). Missing flags are completed as TorchRL does: no
    ``done`` is ``terminated | truncated``; no ``terminated`` is
    ``done & ~truncated`` (``done`` when ``truncated`` is missing too). Returns,
    whitening and the zeros off the mask as in :func:`reference_gae_response`.

    Args:
        rewards / values / next_values: ``[*B, T]`` float tensors.
        gamma / lam: discount and GAE lambda.
        done / terminated / truncated: ``[*B, T]`` bool flags (at least one).
        mask: ``[*B, T]`` bool or {0, 1}, or ``None`` (all valid).
        normalize: whiten the advantages (default False).

    Returns:
        ``(advantages, returns)``, float64 ``[*B, T]``.

    Example:
        >>> r, v = torch.ones(1, 4), torch.zeros(1, 4)
        >>> done = torch.tensor([[False, True, False, False]])
        >>> nv = torch.tensor([[0.0, 0.0, 0.0, 2.0]])   # the last trajectory is cut: bootstrap 2
        >>> reference_gae_collector(r, v, nv, 1.0, 1.0, done=done)[0]
        tensor([[2., 1., 4., 3.]], dtype=torch.float64)
    """
    shape = _check_rewards(rewards)
    r, v = _rows_of(rewards, shape, "rewards"), _rows_of(values, shape, "values")
    nv = _rows_of(next_values, shape, "next_values") if next_values is not None else [[0.0] * shape[-1] for _ in r]
    m = _rows_of(mask, shape, "mask", as_bool=True) if mask is not None else [[True] * shape[-1] for _ in r]
    d, te = _complete_flags(
        *(_rows_of(f, shape, name, as_bool=True) for f, name in ((done, "done"), (terminated, "terminated"), (truncated, "truncated")))
    )
    end_values = [[0.0 if te[b][t] else nv[b][t] for t in range(shape[-1])] for b in range(len(r))]
    return _gae_out(_gae_rows(r, v, m, gamma, lam, d, end_values), v, m, shape, normalize)


def _time_last(x: Tensor, shape: torch.Size) -> Tensor:
    return x.reshape(shape) if x.shape == shape + (1,) else x


def reference_gae_tensordict(
    td: TensorDictBase, gamma: float, lmbda: float, *, average_gae: bool = False
) -> tuple[Tensor, Tensor]:
    """What :class:`~ppo_objectives.value.MaskedGAE` (default keys) writes for ``td``, from the loops.

    Reads ``("next", "reward")``, ``state_value``, ``mask`` (optional) and, when
    any flag ``("next", "done" / "terminated" / "truncated")`` is present (the
    collector form), the flags and ``("next", "state_value")``; otherwise the
    response form. The time axis is the last of ``state_value``, a trailing 1 is
    TorchRL's per-step layout when the other dims are the TensorDict's batch
    dims; the outputs come back in the layout of ``state_value``.

    Args:
        td: a batch of any of the three layouts.
        gamma / lmbda: discount and GAE lambda.
        average_gae: whiten the advantages (``MaskedGAE(average_gae=...)``).

    Returns:
        ``(advantage, value_target)``, float64, in the layout of ``state_value``.

    Example:
        >>> td = collector_batch(num_envs=2, steps=6, seed=1)
        >>> adv, target = reference_gae_tensordict(td, gamma=0.9, lmbda=0.8)
        >>> adv.shape
        torch.Size([2, 6, 1])
    """
    value = td.get("state_value", None)
    reward = td.get(("next", "reward"), None)
    if value is None or reward is None:
        raise KeyError("reference_gae_tensordict needs 'state_value' and ('next', 'reward') in the TensorDict")
    trailing = value.ndim == td.batch_dims + 1 and value.shape[-1] == 1
    shape = value.shape[:-1] if trailing else value.shape
    r, v = _time_last(reward, shape), _time_last(value, shape)
    m = td.get("mask", None)
    m = None if m is None else _time_last(m, shape)
    flags = {k: td.get(("next", k), None) for k in ("done", "terminated", "truncated")}
    if all(f is None for f in flags.values()):
        adv, ret = reference_gae_response(r, v, m, gamma, lmbda, normalize=average_gae)
    else:
        nv = td.get(("next", "state_value"), None)
        if nv is None:
            raise KeyError("collector form: ('next', 'state_value') is needed to bootstrap truncated trajectories")
        flags = {k: None if f is None else _time_last(f, shape).bool() for k, f in flags.items()}
        adv, ret = reference_gae_collector(r, v, _time_last(nv, shape), gamma, lmbda, mask=m, normalize=average_gae, **flags)
    if trailing:
        adv, ret = adv.unsqueeze(-1), ret.unsqueeze(-1)
    return adv, ret


def reference_ppo_policy_loss(
    new_logps: Tensor,
    old_logps: Tensor,
    advantages: Tensor,
    mask: Tensor | None,
    clip_epsilon: float,
    *,
    clip_epsilon_high: float | None = None,
    dual_clip: float | None = None,
) -> Tensor:
    """PPO's clipped surrogate loss, token mean over the valid tokens, as a plain loop.

    Per valid token, with ``ratio = exp(new - old)``::

        L = max(-A * ratio, -A * clamp(ratio, 1 - eps_low, 1 + eps_high))
        L = min(L, -A * dual_clip)            where A < 0, with dual_clip

    then the mean over the valid tokens (0 for an empty mask), the default of
    :func:`~ppo_objectives.functional.ppo_policy_loss`.

    Args:
        new_logps / old_logps / advantages: ``[*B, R]`` float tensors.
        mask: ``[*B, R]`` bool or {0, 1}, or ``None`` (all valid).
        clip_epsilon: ``eps_low`` (and ``eps_high`` unless ``clip_epsilon_high``).
        clip_epsilon_high: optional ``eps_high``.
        dual_clip: optional constant ``c > 1``.

    Returns:
        A float64 scalar tensor.

    Example:
        >>> new = torch.log(torch.tensor([[1.5, 1.0, 0.5]]))   # ratios 1.5, 1.0, 0.5
        >>> reference_ppo_policy_loss(new, torch.zeros(1, 3), torch.tensor([[1.0, 1.0, -1.0]]), None, 0.2)
        tensor(-0.4667, dtype=torch.float64)
    """
    shape = _check_rewards(new_logps)
    new, old = _rows_of(new_logps, shape, "new_logps"), _rows_of(old_logps, shape, "old_logps")
    adv = _rows_of(advantages, shape, "advantages")
    m = _rows_of(mask, shape, "mask", as_bool=True) if mask is not None else [[True] * shape[-1] for _ in new]
    lo, hi = 1.0 - clip_epsilon, 1.0 + (clip_epsilon if clip_epsilon_high is None else clip_epsilon_high)
    total, n = 0.0, 0
    for b in range(len(new)):
        for t in range(shape[-1]):
            if not m[b][t]:
                continue
            a = adv[b][t]
            ratio = math.exp(new[b][t] - old[b][t])
            loss = max(-a * ratio, -a * min(max(ratio, lo), hi))
            if dual_clip is not None and a < 0:
                loss = min(loss, -a * dual_clip)
            total += loss
            n += 1
    return torch.tensor(total / max(n, 1), dtype=torch.float64)


def reference_kl(logps: Tensor, ref_logps: Tensor, estimator: str = "k3", *, mask: Tensor | None = None) -> Tensor:
    """Per-token KL estimates of ``KL(pi || pi_ref)`` from sampled tokens, element by element.

    With ``d = ref_logp - logp``: ``"k1"`` is ``-d``, ``"k2"`` is ``d^2 / 2``,
    ``"k3"`` is ``exp(d) - d - 1`` (Schulman 2020, "Approximating KL
    Divergence"); ``"k3+"`` has k3's value (its gradient differs, which a value
    reference cannot show). With ``mask``, 0 off the mask (never read there), as
    :func:`~ppo_objectives.functional.masked_kl_estimate`.

    Args:
        logps / ref_logps: ``[*B, R]`` float tensors.
        estimator: ``"k1"``, ``"k2"``, ``"k3"`` or ``"k3+"``.
        mask: optional ``[*B, R]`` bool or {0, 1}.

    Returns:
        float64 ``[*B, R]``.

    Example:
        >>> lp, ref = torch.log(torch.tensor([0.5])), torch.log(torch.tensor([0.25]))
        >>> [round(float(reference_kl(lp, ref, e)), 4) for e in ("k1", "k2", "k3")]
        [0.6931, 0.2402, 0.1931]
    """
    estimators = {
        "k1": lambda d: -d,
        "k2": lambda d: 0.5 * d * d,
        "k3": lambda d: math.expm1(d) - d,
        "k3+": lambda d: math.expm1(d) - d,
    }
    if estimator not in estimators:
        raise ValueError(f"estimator={estimator!r} is not one of {tuple(estimators)}")
    shape = logps.shape
    if shape == torch.Size([]):
        return reference_kl(logps.reshape(1), ref_logps.reshape(1), estimator).reshape(())
    lp, ref = _rows_of(logps, shape, "logps"), _rows_of(ref_logps, shape, "ref_logps")
    m = _rows_of(mask, shape, "mask", as_bool=True) if mask is not None else [[True] * shape[-1] for _ in lp]
    f = estimators[estimator]
    out = [[f(ref[b][t] - lp[b][t]) if m[b][t] else 0.0 for t in range(shape[-1])] for b in range(len(lp))]
    return torch.tensor(out, dtype=torch.float64).reshape(shape)


# --------------------------------------------------------------------------- #
# Tiny deterministic networks
# --------------------------------------------------------------------------- #


def _check_layout(layout: str) -> str:
    if layout not in ("response", "full"):
        raise ValueError(f"layout={layout!r}: use 'response' (trajectories_to_llm_batch) or 'full' (LLMToTokenBatch)")
    return layout


def _previous_tokens(layout: str, ids: Tensor, tokens: Tensor | None, vocab_size: int) -> tuple[Tensor, Tensor]:
    """``(prev, cur)``: the token before each scored token, and the scored token."""
    if ids.is_floating_point():
        raise TypeError(f"token ids must be integers, got {ids.dtype}")
    if ids.numel() and (int(ids.max()) >= vocab_size or int(ids.min()) < 0):
        raise ValueError(
            f"token ids must be in [0, {vocab_size}), got ids up to {int(ids.max())}; build the batch with "
            f"vocab_size={vocab_size} or the network with a larger vocab_size"
        )
    if layout == "response":
        R = tokens.shape[-1]
        return ids[..., -R - 1 : -1], tokens
    bos = torch.zeros_like(ids[..., :1])
    return torch.cat([bos, ids[..., :-1]], -1), ids


class TinyTokenPolicy(nn.Module):
    """A bigram policy: ``log p(token | previous token)`` from a learnable ``[V, V]`` logit table.

    Response layout (``layout="response"``): ``forward(input_ids, response_ids)``
    scores the ``R`` response tokens, each given the token before it in
    ``input_ids`` (``[B, P + R]``), as
    :class:`~ppo_objectives.readouts.ResponseLogProbs` aligns them. Full layout
    (``layout="full"``): ``forward(tokens)`` scores every token given the one
    before it (0 before the first). Returns ``(log_prob, entropy)``, both
    ``[B, R]`` (or ``[B, T]``). The table is drawn from ``seed``, so two policies
    with the same seed are equal.

    Args:
        vocab_size: ``V``.
        layout: ``"response"`` or ``"full"``.
        seed: seed of the initial table.
        scale: standard deviation of the initial logits.
    """

    def __init__(self, vocab_size: int = 16, *, layout: str = "response", seed: int = 0, scale: float = 0.5):
        super().__init__()
        self.vocab_size = _check_size("vocab_size", vocab_size, 2)
        self.layout = _check_layout(layout)
        g = make_generator(seed)
        self.logits = nn.Parameter(scale * torch.randn(vocab_size, vocab_size, generator=g))

    def forward(self, ids: Tensor, tokens: Tensor | None = None) -> tuple[Tensor, Tensor]:
        prev, cur = _previous_tokens(self.layout, ids, tokens, self.vocab_size)
        logp_all = torch.log_softmax(self.logits[prev], -1)
        logp = logp_all.gather(-1, cur.unsqueeze(-1)).squeeze(-1)
        entropy = -(logp_all.exp() * logp_all).sum(-1)
        return logp, entropy


class TinyTokenCritic(nn.Module):
    """A bigram critic: the value of a state is a learnable number per last token, ``table[prev]``.

    Response layout: ``forward(input_ids, response_ids)`` returns ``[B, R]``
    values, ``state_value[b, j]`` the value of ``input_ids[b, :P + j]``. Full
    layout: ``forward(tokens)`` returns ``(state_value, next_state_value)``, both
    ``[B, T, 1]`` (TorchRL's layout, as
    :class:`~ppo_objectives.readouts.CausalLMCritic` writes them): the value
    before and after each token.

    Args:
        vocab_size: ``V``.
        layout: ``"response"`` or ``"full"``.
        seed: seed of the initial table.
        scale: standard deviation of the initial values.
    """

    def __init__(self, vocab_size: int = 16, *, layout: str = "response", seed: int = 0, scale: float = 0.5):
        super().__init__()
        self.vocab_size = _check_size("vocab_size", vocab_size, 2)
        self.layout = _check_layout(layout)
        g = make_generator(seed + 1)
        self.table = nn.Parameter(scale * torch.randn(vocab_size, generator=g))

    def forward(self, ids: Tensor, tokens: Tensor | None = None):
        prev, cur = _previous_tokens(self.layout, ids, tokens, self.vocab_size)
        if self.layout == "response":
            return self.table[prev]
        return self.table[prev].unsqueeze(-1), self.table[cur].unsqueeze(-1)


def tiny_actor_critic(
    vocab_size: int = 16, *, layout: str = "response", seed: int = 0
) -> tuple[TensorDictModule, TensorDictModule]:
    """A deterministic bigram actor and critic as TensorDict modules, for :class:`~ppo_objectives.loss.TokenPPOLoss`.

    ``layout="response"``: both read ``input_ids`` and ``response_ids``; the
    actor writes ``log_prob`` and ``entropy`` ``[B, R]``, the critic
    ``state_value`` ``[B, R]``. ``layout="full"``: both read ``tokens``; the actor
    writes ``[B, T]``, the critic ``state_value`` and ``("next", "state_value")``
    ``[B, T, 1]``. They run on batches of :func:`response_batch` /
    :func:`full_sequence_batch` with the same ``vocab_size``.

    Args:
        vocab_size: ``V``.
        layout: ``"response"`` or ``"full"``.
        seed: seed of the parameters.

    Returns:
        ``(actor, critic)``.

    Example:
        >>> from ppo_objectives import TokenPPOLoss
        >>> actor, critic = tiny_actor_critic()
        >>> td = response_batch(batch_size=3, response_len=4, with_advantage=True, seed=0)
        >>> actor(td.clone())["log_prob"].shape
        torch.Size([3, 4])
        >>> out = TokenPPOLoss(actor, critic)(td)
        >>> sorted(k for k in out.keys() if k.startswith("loss_"))
        ['loss_critic', 'loss_entropy', 'loss_kl_ref', 'loss_objective']
    """
    _check_layout(layout)
    in_keys = ["input_ids", "response_ids"] if layout == "response" else ["tokens"]
    critic_out = ["state_value"] if layout == "response" else ["state_value", ("next", "state_value")]
    actor = TensorDictModule(
        TinyTokenPolicy(vocab_size, layout=layout, seed=seed), in_keys=in_keys, out_keys=["log_prob", "entropy"]
    )
    critic = TensorDictModule(TinyTokenCritic(vocab_size, layout=layout, seed=seed), in_keys=in_keys, out_keys=critic_out)
    return actor, critic


# --------------------------------------------------------------------------- #
# A tiny chat model: a real BPE tokenizer and a random Llama, built in code
# --------------------------------------------------------------------------- #

#: The ChatML template of :func:`tiny_chat_tokenizer` (SmolLM2's and Qwen's format, without a default system turn).
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _chat_corpus() -> list[str]:
    lines = []
    for a in range(20):
        for b in range(0, 20, 3):
            lines += [f"What is {a} + {b}?", f"{a} + {b} = {a + b}", f"The answer is {a + b}."]
    return lines + ["system", "user", "assistant", "Answer briefly.", "Which number is larger?"]


def tiny_chat_tokenizer(vocab_size: int = 320):
    r"""A byte-level BPE tokenizer with a chat template, trained in code (no download), deterministic.

    ``tokenizers``' BPE trainer on a few hundred lines of arithmetic chat text, byte-level
    pre-tokenizer and decoder (any string encodes and decodes back), the special tokens
    ``<|pad|>`` (pad, id 0), ``<|im_start|>`` (1) and ``<|im_end|>`` (2, the EOS: the end of a
    turn), wrapped in ``transformers.PreTrainedTokenizerFast`` with :data:`CHAT_TEMPLATE`. For
    testing text tasks and rewards (:class:`~ppo_objectives.text_tasks.TextTask`) the way a real
    instruct tokenizer is used. Needs ``tokenizers`` and ``transformers``.

    Example:
        >>> tok = tiny_chat_tokenizer()
        >>> len(tok), tok.eos_token, tok.eos_token_id, tok.pad_token_id
        (320, '<|im_end|>', 2, 0)
        >>> text = tok.apply_chat_template([{"role": "user", "content": "What is 3 + 4?"}], tokenize=False,
        ...                                add_generation_prompt=True)
        >>> text
        '<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n<|im_start|>assistant\n'
        >>> tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
        True
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|pad|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    raw.train_from_iterator(_chat_corpus(), trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<|pad|>", bos_token="<|im_start|>",
                                  eos_token="<|im_end|>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_chat_checkpoint(path, *, hidden_size: int = 32, num_layers: int = 2, seed: int = 0,
                         vocab_multiple: int = 64):
    """Write a randomly initialised Llama with :func:`tiny_chat_tokenizer` to ``path`` (``save_pretrained``).

    The embedding has ``len(tokenizer)`` rounded up to a multiple of ``vocab_multiple`` rows (real
    checkpoints pad their vocabulary too, so the model's ``V`` exceeds the tokenizer's), the LM
    head is tied to it, and the weights are drawn under ``torch.manual_seed(seed)`` (the global RNG
    is restored). Returns ``path`` as a ``pathlib.Path``: a directory ``--model`` and
    ``AutoModelForCausalLM.from_pretrained`` load.
    """
    from pathlib import Path

    from transformers import LlamaConfig, LlamaForCausalLM

    tok = tiny_chat_tokenizer()
    vocab = -(-len(tok) // vocab_multiple) * vocab_multiple
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, tie_word_embeddings=True, pad_token_id=tok.pad_token_id,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    path = Path(path)
    model.save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return path


# --------------------------------------------------------------------------- #
# Assertions
# --------------------------------------------------------------------------- #


def _key(k: NestedKey) -> tuple[str, ...]:
    return (k,) if isinstance(k, str) else tuple(k)


def _where(index: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(i) for i in index) + "]"


def assert_matches_reference(
    got: Tensor | float,
    want: Tensor | float,
    *,
    atol: float = 1e-5,
    rtol: float = 1e-4,
    mask: Tensor | None = None,
    name: str = "output",
) -> None:
    """Assert ``|got - want| <= atol + rtol * |want|`` everywhere (or on ``mask``), with a message that helps.

    Both are compared in float64; NaN matches only NaN, and infinities must be
    equal. On failure the ``AssertionError`` names the shapes, how many entries
    fail, the largest absolute error and the largest relative error with the
    index where each occurs and the two values there. The defaults suit float32
    results against a float64 reference of a few hundred terms; tighten them
    for float64 code.

    Args:
        got: the value under test (a tensor or a number).
        want: the reference (same shape; a number is compared to a 0-d ``got``).
        atol / rtol: absolute and relative tolerance.
        mask: optional bool tensor of ``got``'s shape: compare only where True.
        name: what is compared, used in the message.

    Example:
        >>> assert_matches_reference(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0000001]))
        >>> assert_matches_reference(torch.tensor([1.0, 2.5]), torch.tensor([1.0, 2.0]), name="advantage")
        Traceback (most recent call last):
        ...
        AssertionError: advantage does not match the reference: 1 of 2 entries differ (atol=1e-05, rtol=0.0001); largest absolute error 0.5 at [1] (got 2.5, want 2); largest relative error 0.25 at [1] (got 2.5, want 2)
    """
    g = torch.as_tensor(got).detach().cpu()
    w = torch.as_tensor(want).detach().cpu()
    if g.shape != w.shape:
        raise AssertionError(
            f"{name} has shape {tuple(g.shape)} but the reference has shape {tuple(w.shape)}; compare tensors of "
            f"one layout (a trailing 1 is TorchRL's per-step layout: squeeze(-1) or unsqueeze(-1) one of them)"
        )
    g, w = g.double(), w.double()
    if mask is not None:
        mask = torch.as_tensor(mask).cpu()
        if mask.shape != g.shape:
            raise AssertionError(f"mask has shape {tuple(mask.shape)} but {name} has shape {tuple(g.shape)}")
        mask = mask.bool() if mask.dtype == torch.bool else mask > 0.5
    else:
        mask = torch.ones(g.shape, dtype=torch.bool)
    both_nan = torch.isnan(g) & torch.isnan(w)
    same = (g == w) | both_nan  # equal infinities included
    err = (g - w).abs()
    finite = torch.isfinite(err)
    close = same | (finite & (err <= atol + rtol * w.abs()))
    bad = mask & ~close
    if not bool(bad.any()):
        return
    n_bad, n = int(bad.sum()), int(mask.sum())
    parts = [f"{name} does not match the reference: {n_bad} of {n} entries differ (atol={atol}, rtol={rtol})"]
    nonfinite = bad & ~finite
    if bool(nonfinite.any()):
        idx = tuple(int(i) for i in nonfinite.nonzero()[0])
        parts.append(
            f"{int(nonfinite.sum())} non-finite mismatch(es), first at {_where(idx)} "
            f"(got {g[idx].item()}, want {w[idx].item()})"
        )
    fin_bad = bad & finite
    if bool(fin_bad.any()):
        abs_err = torch.where(fin_bad, err, -1.0)
        rel_err = torch.where(fin_bad & (w != 0), err / w.abs().clamp(min=torch.finfo(torch.float64).tiny), -1.0)
        for what, e in (("absolute", abs_err), ("relative", rel_err)):
            if not bool((e >= 0).any()):  # every failing entry has want == 0: no relative error to give
                continue
            flat = int(e.reshape(-1).argmax())
            idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), g.shape)) if g.dim() else ()
            parts.append(
                f"largest {what} error {e[idx].item():.6g} at {_where(idx)} (got {g[idx].item():.6g}, want {w[idx].item():.6g})"
            )
    raise AssertionError("; ".join(parts))


@dataclass
class MaskInvariantReport:
    """What :func:`assert_mask_invariant` checked (returned when every check passed).

    Attributes:
        corrupted: the input keys whose masked positions were overwritten.
        outputs: the output keys compared at the valid positions (whole tensors
            for outputs that are not per-token, such as a loss).
        zero_checked: the per-token outputs checked to be exactly 0 off the mask.
        masked_positions: how many positions of the mask are False.
        fills: the values written there, one run of the module each.
    """

    corrupted: list[tuple[str, ...]] = field(default_factory=list)
    outputs: list[tuple[str, ...]] = field(default_factory=list)
    zero_checked: list[tuple[str, ...]] = field(default_factory=list)
    masked_positions: int = 0
    fills: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        show = lambda keys: ", ".join("/".join(k) for k in keys) or "none"  # noqa: E731
        return (
            f"{self.masked_positions} masked positions filled with {', '.join(self.fills)} in: {show(self.corrupted)}; "
            f"valid outputs unchanged: {show(self.outputs)}; exactly 0 off the mask: {show(self.zero_checked)}"
        )


def _same(a: Tensor | None, b: Tensor) -> bool:
    """Whether ``b`` is the input ``a`` passed through (NaN equal to NaN)."""
    if a is None or not isinstance(a, Tensor) or a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point():
        return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())
    return torch.equal(a, b)


def _per_token(x: Tensor, core: torch.Size) -> bool:
    return isinstance(x, Tensor) and (x.shape == core or x.shape == core + (1,))


def assert_mask_invariant(
    module: Callable[[TensorDictBase], TensorDictBase],
    td: TensorDictBase,
    *,
    mask_key: NestedKey = "mask",
    corrupt_keys: Sequence[NestedKey] | None = None,
    out_keys: Sequence[NestedKey] | None = None,
    zero_at_masked: bool | Sequence[NestedKey] = True,
    atol: float = 0.0,
    rtol: float = 0.0,
    seed: int = 0,
) -> MaskInvariantReport:
    """Assert that what sits at masked positions of ``td`` changes none of ``module``'s valid outputs.

    The convention of every module of the package (``docs/design.md``,
    "Conventions"): values, rewards, log-probs or flags at masked positions may
    be garbage, even NaN, and every output at a valid position is unchanged;
    per-token outputs are exactly 0 at masked positions. The module is run on a
    clone of ``td``, then on clones whose masked positions hold NaN, then large
    random garbage (and flipped step flags), and the outputs are compared.

    Per-token entries are those of the mask's shape ``[*B, T]`` (or
    ``[*B, T, 1]``). By default every floating-point per-token entry is
    corrupted, and every bool per-token entry under ``"next"`` (TorchRL's
    ``done`` / ``terminated`` / ``truncated``) is flipped; integer entries (token
    ids) and root bool entries (``mask``, ``attention_mask``) are left alone,
    since a network legitimately reads the tokens of holes as context. The
    module must be deterministic (no dropout: put it in ``eval()`` mode), since
    its runs are compared exactly by default.

    Args:
        module: called as ``module(td)``; returns a TensorDict (``MaskedGAE``,
            ``KLPenaltyTransform``, ``TokenPPOLoss``, a ``TensorDictModule``, ...).
        td: the batch; not modified.
        mask_key: the mask entry (True = takes part).
        corrupt_keys: the input entries to corrupt, instead of the default.
        out_keys: the outputs to compare; default: every entry the module wrote (an
            entry of its output that is not an input passed through unchanged), loss
            terms and diagnostics included.
        zero_at_masked: check that per-token outputs are exactly 0 at masked
            positions: ``True`` (every per-token entry the module wrote), ``False``, or
            the keys to check.
        atol / rtol: tolerance at the valid positions (default: exactly equal).
        seed: seed of the garbage.

    Returns:
        A :class:`MaskInvariantReport` of what was checked.

    Raises:
        AssertionError: naming the output, the fill and the first position that changed.

    Example:
        >>> from ppo_objectives import KLPenaltyTransform
        >>> td = response_batch(batch_size=3, response_len=5, seed=0)
        >>> report = assert_mask_invariant(KLPenaltyTransform(coeff=0.1), td)
        >>> report.outputs
        [('next', 'reward'), ('kl_penalty',)]
    """
    if not isinstance(td, TensorDictBase):
        raise TypeError(f"td must be a TensorDict, got {type(td).__name__}")
    m = _invariance_mask(td, mask_key)
    core = m.shape
    corrupt = _keys_to_corrupt(td, mask_key, core, corrupt_keys)

    def run(x: TensorDictBase) -> TensorDictBase:
        out = module(x)
        if not isinstance(out, TensorDictBase):
            raise TypeError(f"assert_mask_invariant: the module returned a {type(out).__name__}, expected a TensorDict")
        return out

    clean = run(td.clone())
    out_list = list(clean.keys(include_nested=True, leaves_only=True))
    written = [_key(k) for k in out_list if isinstance(clean.get(k), Tensor) and not _same(td.get(k, None), clean.get(k))]
    compare = written if out_keys is None else [_key(k) for k in out_keys]
    if not compare:
        raise ValueError("assert_mask_invariant: the module wrote no output to compare; pass out_keys=")
    _check_deterministic(run, td, clean, compare)
    if zero_at_masked is True:
        zero_keys = [k for k in compare if k in written and _per_token(clean.get(k), core)]
    else:
        zero_keys = [] if zero_at_masked is False else [_key(k) for k in zero_at_masked]

    g = make_generator(seed)
    report = MaskInvariantReport(corrupted=corrupt, outputs=compare, zero_checked=zero_keys,
                                 masked_positions=int((~m).sum()))  # fmt: skip
    fills = [("NaN", None), ("random garbage (|x| up to 1e4) and flipped flags", 1e4)]
    for label, scale in fills:
        report.fills.append(label.split(" (")[0])
        bad = run(_corrupted(td, corrupt, m, core, scale, g))
        for k in compare:
            _compare_valid(clean.get(k, None), bad.get(k, None), k, m, core, label, atol, rtol)
        for k in zero_keys:
            for which, res in (("the clean batch", clean), (f"the batch with {label} at masked positions", bad)):
                _check_zero(res.get(k, None), k, m, core, which)
    return report


def _check_deterministic(run, td: TensorDictBase, clean: TensorDictBase, compare: list) -> None:
    """The module gives the same outputs twice on the same clean batch; else no difference can be blamed on the mask."""
    again = run(td.clone())
    for k in compare:
        a, b = clean.get(k, None), again.get(k, None)
        if isinstance(a, Tensor) and isinstance(b, Tensor) and not torch.equal(a.nan_to_num(), b.nan_to_num()):
            raise AssertionError(
                f"assert_mask_invariant: the module is not deterministic: two calls on the same clean batch give "
                f"different {k!r}, so a change under corrupted padding could not be blamed on masking; a module with "
                f"dropout in training mode does this: call module.eval() (or seed it) before the check"
            )


def _invariance_mask(td: TensorDictBase, mask_key: NestedKey) -> Tensor:
    """The bool ``[*B, T]`` mask of ``td``, refusing a missing mask or one with nothing masked."""
    mask = td.get(mask_key, None)
    if mask is None:
        raise KeyError(
            f"assert_mask_invariant: the TensorDict has no mask {mask_key!r}; pass mask_key= or build the batch with "
            f"a mask (e.g. collector_batch(mask='holes'))"
        )
    m = mask if mask.dtype == torch.bool else mask > 0.5
    if m.ndim == td.batch_dims + 1 and m.shape[-1] == 1 and m.ndim >= 2:
        m = m.squeeze(-1)
    if bool(m.all()):
        raise ValueError(
            "assert_mask_invariant: the mask has no masked position, so nothing would be checked; build the batch "
            "with another mask kind (e.g. mask='holes' or 'empty_rows')"
        )
    return m


def _keys_to_corrupt(td: TensorDictBase, mask_key, core, corrupt_keys) -> list:
    """The per-token inputs to corrupt: float entries and step flags under ``"next"`` by default."""
    if corrupt_keys is None:
        corrupt = []
        for k in td.keys(include_nested=True, leaves_only=True):
            x, kk = td.get(k), _key(k)
            if kk == _key(mask_key) or not _per_token(x, core):
                continue
            if x.is_floating_point() or (x.dtype == torch.bool and kk[0] == "next"):
                corrupt.append(kk)
        return corrupt
    corrupt = [_key(k) for k in corrupt_keys]
    for k in corrupt:
        x = td.get(k, None)
        if x is None:
            raise KeyError(f"assert_mask_invariant: corrupt_keys names {k!r}, which is not in the TensorDict")
        if not _per_token(x, core):
            raise ValueError(
                f"assert_mask_invariant: {k!r} has shape {tuple(x.shape)}, not the mask's {tuple(core)} "
                f"(or {tuple(core) + (1,)}); only per-token entries have masked positions"
            )
    return corrupt


def _corrupted(td: TensorDictBase, corrupt, m, core, scale, g) -> TensorDictBase:
    """A clone of ``td`` with NaN (``scale=None``) or garbage of size ``scale`` (and flipped flags)
    at the masked positions of the ``corrupt`` entries."""
    bad_in = td.clone()
    for k in corrupt:
        x = bad_in.get(k)
        mm = m.reshape(x.shape) if x.shape != core else m
        if x.is_floating_point():
            junk = torch.full(x.shape, float("nan")) if scale is None else scale * (2 * torch.rand(x.shape, generator=g) - 1)
            bad_in.set(k, torch.where(mm, x, junk.to(dtype=x.dtype, device=x.device)))
        elif x.dtype == torch.bool:
            bad_in.set(k, torch.where(mm, x, ~x) if scale is not None else x)
        else:
            junk = torch.randint(-1000, 1000, x.shape, generator=g).to(dtype=x.dtype, device=x.device)
            bad_in.set(k, torch.where(mm, x, junk) if scale is not None else x)
    return bad_in


def _compare_valid(a, b, key, m, core, label, atol, rtol) -> None:
    if a is None or b is None:
        raise AssertionError(f"assert_mask_invariant: output {key!r} is missing from the module's output")
    per_token = _per_token(a, core)
    valid = (m.reshape(a.shape) if a.shape != core else m) if per_token else torch.ones(a.shape, dtype=torch.bool)
    try:
        assert_matches_reference(b, a, atol=atol, rtol=rtol, mask=valid.cpu(), name=f"output {key!r}")
    except AssertionError as err:
        where = "at valid positions " if per_token else ""
        raise AssertionError(
            f"assert_mask_invariant: {label} at masked positions of the inputs changed output {key!r} {where}"
            f"(the module reads masked positions): {err}"
        ) from None


def _check_zero(x, key, m, core, which) -> None:
    if x is None or not _per_token(x, core):
        raise AssertionError(
            f"assert_mask_invariant: zero_at_masked names {key!r}, which is not a per-token output of the mask's "
            f"shape {tuple(core)}"
        )
    xc = x.detach().cpu()
    mm = (m.reshape(x.shape) if x.shape != core else m).cpu()
    nonzero = ~mm & ((xc != 0) | torch.isnan(xc))
    if bool(nonzero.any()):
        idx = tuple(int(i) for i in nonzero.nonzero()[0])
        raise AssertionError(
            f"assert_mask_invariant: output {key!r} is not 0 at masked positions with {which}: "
            f"{int(nonzero.sum())} of {int((~mm).sum())} masked entries, first {xc[idx].item()} at "
            f"{_where(idx)}; the package's per-token outputs are exactly 0 there (pass zero_at_masked=False "
            f"if this module does not promise that)"
        )

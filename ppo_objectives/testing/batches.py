"""Batch factories for the two layouts, and the masks they draw (see :mod:`ppo_objectives.testing`).

:func:`response_batch` (the response layout, plus what the training job adds),
:func:`full_sequence_batch` (the full-sequence layout, plus the critic's values),
:func:`collector_batch` (TorchRL collector rows with done / terminated / truncated
flags) and :func:`make_mask` (``MASK_KINDS``). Deterministic given a seed.
"""

from __future__ import annotations

from typing import Sequence

import torch
from tensordict import TensorDict
from torch import Tensor

from ppo_objectives.testing.references import reference_gae_response

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


def check_size(name: str, x: object, low: int) -> int:
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
    check_size("batch_size", batch_size, 0)
    check_size("length", length, 0)
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
    """A random response-layout batch, as :func:`~ppo_objectives.llm.layouts.trajectories_to_llm_batch` returns it.

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
    (holes are real tokens in ``attention_mask``, left padding is not).
    ``response_len=1`` gives one-token responses, which every module reads as
    such (``ppo_objectives/llm/layouts.py``, "Batch shape").

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
    B = check_size("batch_size", batch_size, 1)
    R = check_size("response_len", response_len, 1)
    P = check_size("prompt_len", prompt_len, 1)
    V = check_size("vocab_size", vocab_size, 2)
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
        # near the samplers' log-probs, and <= 0 as log-probs are (a check refuses a positive one)
        ref = (slp.double() + 0.1 * torch.randn(B, R, generator=g, dtype=torch.float64)).clamp(max=0.0)
        out.set("ref_log_prob", _fill(ref.to(dtype), m, masked_fill))
    if with_advantage:
        adv, ret = reference_gae_response(token_reward, out["state_value"], m, gamma, lmbda, average_gae=True)
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
    """A random full-sequence-layout batch, as :class:`~ppo_objectives.llm.chat.LLMToTokenBatch` returns it.

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
    B = check_size("batch_size", batch_size, 1)
    T = check_size("seq_len", seq_len, 1)
    V = check_size("vocab_size", vocab_size, 2)
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
        # near the samplers' log-probs, and <= 0 as log-probs are (a check refuses a positive one)
        ref = (slp.double() + 0.1 * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=0.0)
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
    :class:`~ppo_objectives.value.gae.MaskedGAE` on them. ``mask=None`` (the
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
    N = check_size("num_envs", num_envs, 1)
    T = check_size("steps", steps, 1)
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

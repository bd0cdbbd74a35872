"""The TorchRL LLM-stack adapter: ``ChatEnv`` / ``LLMCollector`` batches in a PPO layout, and its read-outs.

TorchRL's LLM stack (``ChatEnv``, ``LLMCollector`` and its wrapped policies) collects one
TensorDict entry per **turn**, with ragged token lists. This module puts such batches in
the dense **full-sequence layout** (below) that :class:`~ppo_objectives.value.gae.MaskedGAE`,
:class:`~ppo_objectives.transforms.KLPenaltyTransform` and
:class:`~ppo_objectives.loss.TokenPPOLoss` read, and reads that layout out of a Hugging Face
causal LM:

- :class:`LLMToTokenBatch`: an ``LLMCollector`` turn batch -> the full-sequence layout ``[B, T]``;
- :func:`bootstrap_from_next_turn`: with ``layout="turn"``, each turn's bootstrap value is the
  value of the next turn's prompt;
- :class:`CausalLMTokenLogProbs` (actor, reference) and :class:`CausalLMCritic`: per-token
  log-probs and values of every token of a row, 0 off the mask, in one forward. They share the
  read-out conventions of :mod:`ppo_objectives.llm.readouts` (``from_hidden=``,
  ``temperature=``, :func:`~ppo_objectives.llm.readouts.value_head`).

The response layout of :class:`~ppo_objectives.llm.env.TokenLMEnv` (what the training job
runs), its converters and its read-outs are in :mod:`ppo_objectives.llm.layouts` and
:mod:`ppo_objectives.llm.readouts`.

Shape letters: ``B`` rows (dialogs, or turns with ``layout="turn"``); ``T`` tokens per row
(right-padded to the longest row of the batch); ``N`` env rows of a collector batch, ``K``
turns per env row; ``H`` hidden size; ``V`` vocabulary.

Full-sequence layout
--------------------

One row per **dialog** (or per turn with ``LLMToTokenBatch(layout="turn")``),
one column per token of the whole sequence: prompt, assistant replies and the
system/user/tool tokens between them. Produced by :class:`LLMToTokenBatch`
from TorchRL ``LLMCollector`` batches. The TensorDict has ``batch_size=[B, T]``;
per-step scalars carry TorchRL's trailing ``1``.

============================== ============ ========= ==================================================
key                            shape        dtype     meaning
============================== ============ ========= ==================================================
``"tokens"``                   [B, T]       int64     token ids of the whole dialog (the last turn's
                                                      ``("tokens", "full")``), right-padded
``"attention_mask"``           [B, T]       bool      True on real tokens (holes included), False on
                                                      padding
``"mask"``                     [B, T]       bool      True on tokens the policy generated (every
                                                      assistant turn, end-of-turn token included);
                                                      the prompt, system/user/tool tokens and padding
                                                      are holes (False)
``"turn"``                     [B, T]       int64     index of the turn that generated the token, -1
                                                      on holes
``"sample_log_prob"``          [B, T]       float     log-prob of the token at sampling time, 0 on holes
``("next", "reward")``         [B, T, 1]    float     a turn's scalar reward on its last generated
                                                      token, or the per-token reward of TorchRL's KL
                                                      transforms on the generated tokens
``("next", "done")``,          [B, T, 1]    bool      the dialog's last turn's flags on its last
``("next", "terminated")``,                           generated token, False elsewhere (all False for a
``("next", "truncated")``                             dialog cut by the batch boundary)
``"ref_log_prob"``             [B, T]       float     (when present upstream) the reference model's
                                                      log-probs, from ``("next", "ref_log_probs", "full")``
``("torchrl", "kl_penalty")``  [B, T]       float     (when present upstream) TorchRL's ``kl_penalty``
``"next_turn_row"``            [B, T]       int64     (``layout="turn"`` only) row of the dialog's next
                                                      turn in the batch, -1 if none; constant along T
============================== ============ ========= ==================================================

The float entries take the promoted dtype of the upstream entries (at least
the default dtype). The critic writes ``state_value`` and
``("next", "state_value")`` ``[B, T, 1]``; ``MaskedGAE`` runs in its
collector form (the done flags are present): the recursion restarts at every
``done``, skips the holes, and bootstraps a dialog cut by the batch boundary
from ``("next", "state_value")``. In the turn layout,
:func:`bootstrap_from_next_turn` sets each turn's bootstrap value to the
value of the next turn's prompt.

Alignment: ``sample_log_prob[b, t] = log p(tokens[b, t] | tokens[b, :t])``,
``state_value[b, t]`` is the value of ``tokens[b, :t]`` (the state in which
token ``t`` was chosen) and ``("next", "state_value")[b, t]`` the value of
``tokens[b, :t + 1]`` (TorchRL's ``("log_probs", "full")`` uses the same
alignment).

Consumers: :class:`CausalLMTokenLogProbs` and
:class:`CausalLMCritic` (also importable from :mod:`ppo_objectives.llm`), :func:`bootstrap_from_next_turn`,
``KLPenaltyTransform`` (with a ``CausalLMTokenLogProbs`` reference),
``MaskedGAE`` (collector form), ``TokenPPOLoss``.

Converters
----------

=================================== ========================================== ===========================
converter                           from                                       to
=================================== ========================================== ===========================
:class:`LLMToTokenBatch`            ``LLMCollector`` turn batch ``[N, K]`` or  full-sequence layout
                                    ``[N * K]`` (ragged per-turn tokens)       ``[B, T]``
:func:`bootstrap_from_next_turn`    full-sequence layout, ``layout="turn"``,   the same batch, bootstrap
                                    after the critic                           values across turns
=================================== ========================================== ===========================
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import TensorDictModuleBase
from tensordict.utils import NestedKey
from torch import Tensor, nn
from torchrl.envs.transforms import Transform

from ppo_objectives import _td as TD
from ppo_objectives import _validate
from ppo_objectives import functional as F
from ppo_objectives.functional import response_log_probs_from_hidden
from ppo_objectives.llm.hf import hf_decoder, hf_forward
from ppo_objectives.llm.policy import check_temperature
from ppo_objectives.llm.readouts import (
    check_from_hidden,
    has_forward_hooks,
    read_log_probs,
    read_values,
    use_hidden,
    value_head,
)

__all__ = ["CausalLMCritic", "CausalLMTokenLogProbs", "LLMToTokenBatch", "bootstrap_from_next_turn"]


# --------------------------------------------------------------------------- #
# LLMCollector turn batch -> full-sequence layout [B, T]
# --------------------------------------------------------------------------- #


def _as_key(key: NestedKey) -> NestedKey:
    """A nested key as a str or a tuple (lists become tuples, so keys compare and slice alike)."""
    return key if isinstance(key, str) else tuple(key)


def _get_1d(td: TensorDictBase, key: NestedKey, what: str, where: str) -> Tensor | None:
    """``td[key]`` for one turn as a 1-D tensor (``[L]``; a trailing ``1`` is dropped), or None."""
    if key is None:
        return None
    try:
        x = td.get(key, None)
    except ValueError:  # tensordict 0.14: a key asked inside a tensor
        x = None
    if x is None and isinstance(key, tuple) and len(key) > 1:
        # ("next", "ref_log_probs", "full") asked, but ("next", "ref_log_probs") is a tensor:
        # TorchRL's KLRewardTransform stores the reference log-probs one level up
        parent = td.get(key[:-1], None)
        x = parent if isinstance(parent, Tensor) else None
    if x is None:
        return None
    if not isinstance(x, Tensor):
        raise TypeError(f"{what} {TD.key_str(key)} of {where} is a {type(x).__name__}, expected a tensor")
    if x.dim() == 2 and x.shape[-1] == 1:
        x = x.squeeze(-1)
    if x.dim() != 1:
        raise ValueError(
            f"{what} {TD.key_str(key)} of {where} has shape {tuple(x.shape)}, expected one value per token ([L] or "
            f"[L, 1]); is the batch a turn-level LLMCollector batch with unpadded tokens (pad_output=False)?"
        )
    return x


def _flat_list(x) -> list:
    if isinstance(x, Tensor):
        return x.reshape(-1).tolist()
    if hasattr(x, "tolist"):
        x = x.tolist()
    if isinstance(x, (list, tuple)):
        out = []
        for item in x:
            out.extend(_flat_list(item))
        return out
    return [x]


def _flag(td: TensorDictBase, key: NestedKey) -> bool | None:
    x = td.get(key, None)
    if x is None:
        return None
    return bool(x.any())


def _is_prefix(prefix: Tensor, seq: Tensor) -> bool:
    n = prefix.numel()
    return n <= seq.numel() and bool(torch.equal(prefix.to(seq.device), seq[:n]))


@dataclass
class _Turn:
    """One assistant turn, already in the coordinates of its own ``("tokens", "full")``."""

    where: str  # for error messages
    prompt_len: int
    full: Tensor  # [L]
    log_prob: Tensor | None  # [L - prompt_len]: the generated tokens' log-probs
    reward: Tensor | None  # [] scalar or [L] per token
    ref_log_prob: Tensor | None  # [L]
    kl: Tensor | None  # [L]
    done: bool
    terminated: bool
    truncated: bool


def _check_turn_batch(tensordict: TensorDictBase, tokens_key: NestedKey) -> None:
    """Refuse what is not a non-empty batch of unpadded turns with tokens at ``tokens_key``."""
    if tensordict.batch_dims == 0:
        raise ValueError(
            "LLMToTokenBatch needs a batch of turns, got a TensorDict with batch_size=[]; "
            "stack single turns with tensordict.lazy_stack([...])"
        )
    if tensordict.batch_size.numel() == 0:
        raise ValueError(
            f"LLMToTokenBatch got an empty batch (batch_size={list(tensordict.batch_size)}): it holds no turns "
            f"to convert; skip empty collector batches before the conversion"
        )
    if tokens_key not in tensordict.keys(True):  # a membership test: reading ragged turns would stack them
        raise TD.missing(tensordict, tokens_key, module="LLMToTokenBatch", what="the turn tokens", collector_fix=False,
                         fix=f"found {sorted(map(str, tensordict.keys()))}; is this an LLMCollector batch of a policy "
                         f"that returns tokens (TransformersWrapper / vLLMWrapper)? Set tokens_key= otherwise")
    padded = tensordict.get(("tokens", "padded"), None) if tokens_key[:1] == ("tokens",) else None
    if padded is not None and any(bool(p) for p in _flat_list(padded)):
        raise ValueError(
            "LLMToTokenBatch reads unpadded turns, but ('tokens', 'padded') is True: build the policy "
            "wrapper with pad_output=False (TransformersWrapper's default)"
        )


def _turn_groups(td: TensorDictBase) -> tuple[list[list[tuple[TensorDictBase, str]]], bool]:
    """The turns of a batch as groups of ``(turn, name)`` (one group per env row of an ``[N, K]``
    batch, one group for a 1-D batch), and whether a break in the tokens starts a new dialog."""
    if td.batch_dims == 1:
        return [[(turn, f"turn {i}") for i, turn in enumerate(td.unbind(0))]], True
    flat = td.reshape(-1, td.shape[-1]) if td.batch_dims > 2 else td
    groups = [[(turn, f"turn [{n}, {s}]") for s, turn in enumerate(row.unbind(0))] for n, row in enumerate(flat.unbind(0))]
    return groups, False


def _one_row_per_turn(dialogs: list[list[_Turn]]) -> tuple[list[list[_Turn]], list[int], list[bool]]:
    """Turn layout: every turn its own row, the row of its dialog's next turn (-1: none), and
    whether it is the dialog's last turn (which carries the dialog's flags)."""
    rows, links, ends = [], [], []
    for dialog in dialogs:
        for k, turn in enumerate(dialog):
            rows.append([turn])
            links.append(len(rows) if k + 1 < len(dialog) else -1)
            ends.append(k + 1 == len(dialog))
    return rows, links, ends


@dataclass
class _Columns:
    """The ``[B, T]`` tensors of a converted batch before they get their keys."""

    tokens: Tensor
    attention_mask: Tensor
    mask: Tensor
    turn: Tensor
    sample_log_prob: Tensor
    reward: Tensor
    ref_log_prob: Tensor
    kl_penalty: Tensor
    done: Tensor
    terminated: Tensor
    truncated: Tensor
    has_log_prob: bool = False
    has_ref: bool = False
    has_kl: bool = False

    @classmethod
    def empty(cls, B: int, T: int, pad_token_id: int, device, fdtype: torch.dtype) -> _Columns:
        def zeros(dtype):
            return torch.zeros(B, T, dtype=dtype, device=device)

        return cls(
            tokens=torch.full((B, T), pad_token_id, dtype=torch.long, device=device),
            attention_mask=zeros(torch.bool),
            mask=zeros(torch.bool),
            turn=torch.full((B, T), -1, dtype=torch.long, device=device),
            sample_log_prob=zeros(fdtype),
            reward=zeros(fdtype),
            ref_log_prob=zeros(fdtype),
            kl_penalty=zeros(fdtype),
            done=zeros(torch.bool),
            terminated=zeros(torch.bool),
            truncated=zeros(torch.bool),
        )


def _float_dtype(rows: list[list[_Turn]]) -> torch.dtype:
    """The default dtype promoted with every floating per-turn entry."""
    fdtype = torch.get_default_dtype()
    for row in rows:
        for t in row:
            for x in (t.log_prob, t.reward, t.ref_log_prob, t.kl):
                if x is not None and x.is_floating_point():
                    fdtype = torch.promote_types(fdtype, x.dtype)
    return fdtype


def _place_turn(cols: _Columns, b: int, k: int, turn: _Turn, last: _Turn) -> None:
    """Write turn ``k`` of row ``b`` (whose tokens are ``last.full``) at its generated positions."""
    lo, hi = turn.prompt_len, turn.full.numel()
    if hi > last.full.numel() or not _is_prefix(turn.full, last.full):
        raise ValueError(
            f"{turn.where} is not a prefix of the last turn of its dialog ({last.where}); the "
            f"tokenizer re-tokenised the history differently. Keep the tokens incremental "
            f"(ChatEnv(with_tokenizer=True) with TransformersWrapper(prefer_tokens=True))"
        )
    if hi == lo:
        if turn.reward is not None and turn.reward.dim() == 0 and bool(turn.reward != 0):
            raise ValueError(
                f"{turn.where} generated no token but has reward {float(turn.reward)}: there is no "
                f"token to carry it; give the policy max_new_tokens >= 1"
            )
        return
    fdtype = cols.reward.dtype
    cols.mask[b, lo:hi] = True
    cols.turn[b, lo:hi] = k
    if turn.log_prob is not None:
        cols.sample_log_prob[b, lo:hi] = turn.log_prob.to(fdtype)
        cols.has_log_prob = True
    if turn.reward is not None:
        if turn.reward.dim() == 0:
            cols.reward[b, hi - 1] += turn.reward.to(fdtype)
        else:
            cols.reward[b, lo:hi] += turn.reward[lo:hi].to(fdtype)
    if turn.ref_log_prob is not None:
        cols.ref_log_prob[b, lo:hi] = turn.ref_log_prob[lo:hi].to(fdtype)
        cols.has_ref = True
    if turn.kl is not None:
        cols.kl_penalty[b, lo:hi] = turn.kl[lo:hi].to(fdtype)
        cols.has_kl = True


def _pack_rows(rows: list[list[_Turn]], ends: list[bool] | None, pad_token_id: int) -> _Columns:
    """Row ``b`` holds the tokens of ``rows[b][-1]`` and every turn of ``rows[b]`` at its positions; the
    dialog's end flags go on the row's last generated token (with ``ends``: only where ``ends[b]``)."""
    B = len(rows)
    T = max(row[-1].full.numel() for row in rows)
    cols = _Columns.empty(B, T, pad_token_id, rows[0][-1].full.device, _float_dtype(rows))
    for b, row in enumerate(rows):
        last = row[-1]
        L = last.full.numel()
        cols.tokens[b, :L] = last.full
        cols.attention_mask[b, :L] = True
        for k, turn in enumerate(row):
            _place_turn(cols, b, k, turn, last)
        pos = cols.mask[b].nonzero()
        if pos.numel() and (ends is None or ends[b]):
            end = int(pos[-1])
            cols.done[b, end] = last.done
            cols.terminated[b, end] = last.terminated
            cols.truncated[b, end] = last.truncated
    return cols


class LLMToTokenBatch(Transform):
    """Convert a turn-level ``LLMCollector`` batch into the full-sequence ``[B, T]`` PPO layout.

    Each row of the output is one dialog: the token ids of its last turn's
    ``("tokens", "full")`` (which contain every earlier turn), with ``mask``
    True exactly on the tokens the policy generated — in a multi-turn dialog
    the assistant turns, while system/user/tool tokens between them are holes
    that :class:`~ppo_objectives.value.gae.MaskedGAE` skips. Turn ``k`` generated
    the tokens ``[len(prompt_k), len(full_k))`` of its own ``("tokens", "full")``;
    since every turn's full tokens are a prefix of the next turn's prompt, these
    are positions of the dialog row too (checked; an error says what to change
    when the tokenizer re-tokenises the history differently). The module
    docstring lists the keys, shapes and alignment of the output.

    Which turns form a dialog: in an ``[N, S]`` batch (``LLMCollector``'s default,
    ``flatten_data=False``) each row ``n`` holds consecutive turns of one
    environment; a new dialog starts after a turn with ``("next", "done")``.
    In a 1-D batch (``flatten_data=True`` or ``yield_completed_trajectories=True``)
    a new dialog also starts whenever a turn does not continue the previous one
    (its prompt does not begin with the previous turn's full tokens). A dialog
    whose first turns were collected in an earlier batch keeps those turns as
    context (holes); one still running at the end of the batch has all its
    flags False, so ``MaskedGAE`` bootstraps it from ``("next", "state_value")``.

    Two layouts:

    - ``layout="dialog"`` (default): one row per dialog, as above. It needs
      *incremental* tokens: each turn's ``("tokens", "full")`` must be a prefix of
      the next turn's prompt. TorchRL's history mode re-renders the history from
      text at every turn and its ``History`` parsing strips the whitespace
      around a reply, so a reply that starts or ends with a space or newline
      breaks this (the error says so); so can a BPE tokenizer that merges across
      the end of a reply.
    - ``layout="turn"``: one row per turn — the prompt the model saw and the
      tokens it sampled, exactly — whatever the tokenizer does. The dialog's
      flags go on its last turn; earlier turns have none, and
      ``"next_turn_row"`` ``[B, T]`` (constant along ``T``) holds the row of the
      dialog's next turn in this batch (-1 if none). After the critic ran, call
      :func:`bootstrap_from_next_turn` to bootstrap each turn from the value of
      the next turn's prompt (the state after the tool/user reply); GAE is then
      truncated at turn ends, as at any bootstrapped segment end.

    The per-turn entries go to the turn's generated positions:

    - ``log_prob_key`` (default ``("log_probs", "response")``, ``[L - len(prompt)]``;
      a key ending in ``"full"`` is read as ``[L]`` and sliced) -> ``sample_log_prob``.
    - ``reward_key`` (default ``("next", "reward")``): a scalar turn reward
      (``[1]``) goes on the turn's last generated token, never broadcast over
      the turn; a per-token reward (``[L, 1]``, as TorchRL's ``KLComputation``
      / ``KLRewardTransform`` write it) is taken on the generated tokens.
    - ``ref_log_prob_key`` (default ``("next", "ref_log_probs", "full")``, from
      TorchRL's ``RetrieveKL``; ``KLRewardTransform`` writes a tensor at
      ``("next", "ref_log_probs")``, which is read in its place) -> ``ref_log_prob``,
      so our ``KLPenaltyTransform`` can run on the converted batch.
    - ``kl_key`` (default ``("next", "kl_penalty")``) -> ``("torchrl", "kl_penalty")``:
      the KL TorchRL computed (and, with its ``add_to_reward=True``, already
      took from the reward). It is kept out of our ``"kl_penalty"`` entry on
      purpose: :class:`~ppo_objectives.transforms.KLPenaltyTransform` skips a
      batch that has ``"kl_penalty"``, so after ``RetrieveKL(add_to_reward=False)``
      our transform still applies the penalty from ``ref_log_prob``. After
      ``RetrieveKL(add_to_reward=True)`` call ``set_out_keys(kl_penalty="kl_penalty")``
      (or do not run ours) so the penalty is not taken twice.

    Only the turn's own generated positions are read from per-token entries:
    TorchRL's KL transforms score every assistant message of the history at
    every turn, so summing them over turns would count earlier turns again.
    They score the chat-template rendering of ``("history", "full")``, which
    may end with one or two more tokens than ``("tokens", "full")`` (the
    template closes the assistant message); the first ``L`` entries are the
    turn's tokens and the rest is dropped. Every entry is detached.

    .. note:: TorchRL 0.14's ``TransformersWrapper(generate=True)`` stores 0 as
       the log-prob of the **first** generated token of every turn
       (``_log_probs_generate`` sets ``log_probs[:, 0] = 0``), and
       ``RetrieveKL(assistant_only=True)`` leaves the end-of-turn token of each
       assistant message unscored (its chat-template mask stops before it).
       For exact PPO ratios recompute the sampling log-probs on the converted
       batch with the policy (:class:`CausalLMTokenLogProbs`
       with ``out_key="sample_log_prob"`` under ``torch.no_grad()``), and compute the
       reference log-probs the same way, or use ``RetrieveKL(assistant_only=False)``.
       Turns generated at a sampling temperature ``T`` (``generate_kwargs={"temperature": T}``)
       are recomputed with ``CausalLMTokenLogProbs(..., temperature=T)``, and the loss's
       actor read-out takes the same ``temperature=T``: the stored log-probs must be those
       of the distribution sampled (TRL issue #4159). This conversion copies log-probs, it
       computes none, so it takes no temperature itself.

    Args:
        pad_token_id: the id written at padding positions of ``tokens``.

    Keyword Args:
        layout: ``"dialog"`` (default) or ``"turn"``, see above.
        tokens_key, prompt_key: a turn's full and prompt token ids.
        log_prob_key, reward_key, ref_log_prob_key, kl_key: see above; ``None``
            skips an entry. Missing optional entries are skipped too; a
            missing reward is an error (use ``reward_key=None`` for all zeros).
        done_key, terminated_key, truncated_key: the turn's flags.

    Where it runs: ``LLMCollector(..., postproc=LLMToTokenBatch())``,
    ``ReplayBuffer(transform=...)`` / ``rb.append_transform(...)`` (converts on
    ``extend``; a batch that is already converted passes through ``forward``),
    or called directly. Not inside an environment: it changes the batch shape.

    Example:
        >>> import torch
        >>> from tensordict import TensorDict, lazy_stack
        >>> turn = TensorDict(
        ...     {
        ...         ("tokens", "prompt"): torch.tensor([5, 6]),
        ...         ("tokens", "full"): torch.tensor([5, 6, 7, 8]),       # generated: 7, 8
        ...         ("log_probs", "response"): torch.tensor([-0.5, -0.25]),
        ...         ("next", "reward"): torch.tensor([1.0]),
        ...         ("next", "done"): torch.tensor([True]),
        ...         ("next", "terminated"): torch.tensor([True]),
        ...     }
        ... )
        >>> batch = lazy_stack([lazy_stack([turn])])                      # [N=1, S=1]
        >>> out = LLMToTokenBatch()(batch)
        >>> out.batch_size
        torch.Size([1, 4])
        >>> out["mask"]
        tensor([[False, False,  True,  True]])
        >>> out["sample_log_prob"]
        tensor([[ 0.0000,  0.0000, -0.5000, -0.2500]])
        >>> out["next", "reward"].squeeze(-1)                             # on the last generated token
        tensor([[0., 0., 0., 1.]])
    """

    @dataclass
    class _OutKeys:
        """Keys of the converted batch (set them with :meth:`LLMToTokenBatch.set_out_keys`)."""

        tokens: NestedKey = "tokens"
        attention_mask: NestedKey = "attention_mask"
        mask: NestedKey = "mask"
        turn: NestedKey = "turn"
        sample_log_prob: NestedKey = "sample_log_prob"
        reward: NestedKey = ("next", "reward")
        done: NestedKey = ("next", "done")
        terminated: NestedKey = ("next", "terminated")
        truncated: NestedKey = ("next", "truncated")
        ref_log_prob: NestedKey = "ref_log_prob"
        kl_penalty: NestedKey = ("torchrl", "kl_penalty")
        next_turn_row: NestedKey = "next_turn_row"

    def __init__(
        self,
        pad_token_id: int = 0,
        *,
        layout: str = "dialog",
        tokens_key: NestedKey = ("tokens", "full"),
        prompt_key: NestedKey = ("tokens", "prompt"),
        log_prob_key: NestedKey | None = ("log_probs", "response"),
        reward_key: NestedKey | None = ("next", "reward"),
        ref_log_prob_key: NestedKey | None = ("next", "ref_log_probs", "full"),
        kl_key: NestedKey | None = ("next", "kl_penalty"),
        done_key: NestedKey = ("next", "done"),
        terminated_key: NestedKey = ("next", "terminated"),
        truncated_key: NestedKey = ("next", "truncated"),
    ):
        if isinstance(pad_token_id, bool) or not isinstance(pad_token_id, int) or pad_token_id < 0:
            raise ValueError(f"pad_token_id={pad_token_id!r} must be a non-negative int (the tokenizer's pad id)")
        if layout not in ("dialog", "turn"):
            raise ValueError(f"layout={layout!r} must be 'dialog' (one row per dialog) or 'turn' (one row per turn)")
        super().__init__(in_keys=[], out_keys=[])
        self.pad_token_id = pad_token_id
        self.layout = layout
        self.tokens_key = _as_key(tokens_key)
        self.prompt_key = _as_key(prompt_key)
        self.log_prob_key = None if log_prob_key is None else _as_key(log_prob_key)
        self.reward_key = None if reward_key is None else _as_key(reward_key)
        self.ref_log_prob_key = None if ref_log_prob_key is None else _as_key(ref_log_prob_key)
        self.kl_key = None if kl_key is None else _as_key(kl_key)
        self.done_key = _as_key(done_key)
        self.terminated_key = _as_key(terminated_key)
        self.truncated_key = _as_key(truncated_key)
        self.out_keys_ = self._OutKeys()

    def set_out_keys(self, **kwargs: NestedKey) -> LLMToTokenBatch:
        """Rename output entries, e.g. ``set_out_keys(mask="response_mask")``; returns ``self``."""
        names = {f.name for f in fields(self._OutKeys)}
        for name, key in kwargs.items():
            if name not in names:
                raise ValueError(f"unknown out key {name!r}; the out keys are {sorted(names)}")
            setattr(self.out_keys_, name, _as_key(key))
        return self

    # ------------------------------------------------------------------ #
    # Transform entry points
    # ------------------------------------------------------------------ #
    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        """Convert ``tensordict`` (a turn-level batch); an already converted batch is returned as is."""
        if self._is_converted(tensordict):
            return tensordict
        return self.convert(tensordict)

    def _inv_call(self, tensordict: TensorDictBase) -> TensorDictBase:
        # replay buffer ``extend``: store the token-level rows
        return self.forward(tensordict)

    def _call(self, next_tensordict: TensorDictBase) -> TensorDictBase:
        raise RuntimeError(
            "LLMToTokenBatch changes the batch shape (turns -> [dialogs, tokens]) and cannot run inside an "
            "environment; use it as LLMCollector(postproc=...) or as a replay-buffer transform"
        )

    def _step(self, tensordict: TensorDictBase, next_tensordict: TensorDictBase) -> TensorDictBase:
        return self._call(next_tensordict)

    def _is_converted(self, td: TensorDictBase) -> bool:
        return self.tokens_key not in td.keys(True) and self.out_keys_.mask in td.keys(True)

    # ------------------------------------------------------------------ #
    # The conversion: read each turn -> pack rows -> build the TensorDict
    # ------------------------------------------------------------------ #
    def convert(self, tensordict: TensorDictBase) -> TensorDict:
        """Return the full-sequence ``[B, T]`` batch of the turn-level ``tensordict`` (not modified)."""
        _check_turn_batch(tensordict, self.tokens_key)
        groups, split_on_break = _turn_groups(tensordict)
        dialogs = [dialog for group in groups for dialog in self._read_dialogs(group, split_on_break)]
        if self.layout == "dialog":
            return self._to_tensordict(_pack_rows(dialogs, None, self.pad_token_id), links=None)
        rows, links, ends = _one_row_per_turn(dialogs)
        return self._to_tensordict(_pack_rows(rows, ends, self.pad_token_id), links=links)

    def _read_dialogs(self, group: list[tuple[TensorDictBase, str]], split_on_break: bool) -> list[list[_Turn]]:
        """Read the turns of one group in order and cut them into dialogs."""
        dialogs: list[list[_Turn]] = []
        current: list[_Turn] = []
        for turn_td, where in group:
            turn = self._read_turn(turn_td, where)
            if current and self._starts_new_dialog(current[-1], turn, split_on_break):
                dialogs.append(current)
                current = []
            current.append(turn)
        if current:
            dialogs.append(current)
        return dialogs

    def _starts_new_dialog(self, prev: _Turn, turn: _Turn, split_on_break: bool) -> bool:
        """After a done turn, yes; after a turn ``turn`` does not continue: yes in a 1-D batch, an error in
        the dialog layout of an ``[N, K]`` batch, no in its turn layout."""
        dialog_layout = self.layout == "dialog"
        # dialog layout: the previous turn's tokens must be a prefix of this prompt;
        # turn layout (no such promise): at least the previous prompt must be
        prefix = prev.full if dialog_layout else prev.full[: prev.prompt_len]
        continues = _is_prefix(prefix, turn.full[: turn.prompt_len])
        if prev.done:
            return True
        if continues:
            return False
        if not split_on_break and dialog_layout:
            raise ValueError(
                f"{turn.where} does not continue {prev.where} although {prev.where} is not done: its "
                f"prompt {TD.key_str(self.prompt_key)} does not start with the previous turn's "
                f"{TD.key_str(self.tokens_key)} (the history was re-tokenised differently, e.g. "
                f"TorchRL's History parsing strips the whitespace around a reply). The generated "
                f"tokens of the earlier turn cannot be located in the dialog. Use "
                f"LLMToTokenBatch(layout='turn') (one row per turn, bootstrapped from the next "
                f"turn with bootstrap_from_next_turn), or keep the tokens incremental."
            )
        return split_on_break

    def _read_turn(self, td: TensorDictBase, where: str) -> _Turn:
        full, prompt = self._read_tokens(td, where)
        p, L = prompt.numel(), full.numel()
        log_prob = self._read_log_prob(td, where, p, L)
        reward = self._read_reward(td, where, L)
        ref_log_prob = self._read_per_token(td, self.ref_log_prob_key, "ref_log_prob", where, L)
        kl = self._read_per_token(td, self.kl_key, "kl", where, L)
        flags = [_flag(td, k) for k in (self.done_key, self.terminated_key, self.truncated_key)]
        if all(f is None for f in flags):
            done = terminated = truncated = False
        else:
            done, terminated, truncated = F.resolve_done_flags(*flags)
        return _Turn(
            where=where,
            prompt_len=p,
            full=full,
            log_prob=log_prob,
            reward=reward,
            ref_log_prob=ref_log_prob,
            kl=kl,
            done=bool(done),
            terminated=bool(terminated),
            truncated=bool(truncated),
        )

    def _read_tokens(self, td: TensorDictBase, where: str) -> tuple[Tensor, Tensor]:
        """The turn's full and prompt token ids, the prompt checked to be a prefix of the full tokens."""
        full = _get_1d(td, self.tokens_key, "tokens", where)
        prompt = _get_1d(td, self.prompt_key, "prompt tokens", where)
        if full is None:
            raise TD.missing(td, self.tokens_key, module=where, what="the turn tokens", collector_fix=False)
        if prompt is None:
            raise TD.missing(td, self.prompt_key, module=where, what="the prompt tokens", collector_fix=False,
                             fix=f"they locate the generated tokens inside {TD.key_str(self.tokens_key)}")
        if full.is_floating_point() or prompt.is_floating_point():
            raise TypeError(f"{where}: token ids must be integers, got {full.dtype} and {prompt.dtype}")
        p, L = prompt.numel(), full.numel()
        if p > L or not _is_prefix(prompt, full):
            raise ValueError(
                f"{where}: the prompt {TD.key_str(self.prompt_key)} (length {p}) is not a prefix of "
                f"{TD.key_str(self.tokens_key)} (length {L}); the generated tokens cannot be located"
            )
        return full, prompt

    def _read_log_prob(self, td: TensorDictBase, where: str, p: int, L: int) -> Tensor | None:
        """The generated tokens' log-probs ``[L - p]`` (a ``*full`` key is sliced), detached, or None."""
        if self.log_prob_key is None:
            return None
        lp = _get_1d(td, self.log_prob_key, "log-probs", where)
        if lp is None:
            return None
        if self.log_prob_key[-1] == "full":
            if lp.numel() < L:
                raise ValueError(
                    f"{where}: {TD.key_str(self.log_prob_key)} has {lp.numel()} entries but "
                    f"{TD.key_str(self.tokens_key)} has {L} tokens; a '*full' log-prob key needs one per token"
                )
            lp = lp[p:L]
        elif lp.numel() != L - p:
            raise ValueError(
                f"{where}: {TD.key_str(self.log_prob_key)} has {lp.numel()} entries but the turn generated "
                f"{L - p} tokens ({TD.key_str(self.tokens_key)} length {L} minus prompt length {p}); "
                f"pass the full log-probs with a key ending in 'full' instead"
            )
        return lp.detach()

    def _read_reward(self, td: TensorDictBase, where: str, L: int) -> Tensor | None:
        """A scalar turn reward ``[]`` or per-token rewards ``[L]``, detached; None with ``reward_key=None``."""
        if self.reward_key is None:
            return None
        r = TD.require(td, self.reward_key, module=where, what="the reward", collector_fix=False,
                       fix="add a reward transform to the environment, or pass reward_key=None for zero rewards")
        if r.numel() == 1:
            return r.reshape(()).detach()
        reward = _get_1d(td, self.reward_key, "reward", where)
        if reward.numel() < L:
            raise ValueError(
                f"{where}: the reward {TD.key_str(self.reward_key)} has shape {tuple(r.shape)}: expected one "
                f"turn-level value ([1]) or one per token of {TD.key_str(self.tokens_key)} ([{L}, 1])"
            )
        return reward[:L].detach()

    def _read_per_token(self, td: TensorDictBase, key: NestedKey | None, name: str, where: str, L: int):
        """A per-token entry of TorchRL's KL transforms, its first ``L`` values detached, or None."""
        x = _get_1d(td, key, name, where)
        if x is None:
            return None
        if x.numel() < L:
            raise ValueError(
                f"{where}: {TD.key_str(key)} has {x.numel()} entries but {TD.key_str(self.tokens_key)} has {L} "
                f"tokens; TorchRL's KL transforms write one value per token of the full sequence"
            )
        return x[:L].detach()

    def _to_tensordict(self, cols: _Columns, links: list[int] | None) -> TensorDict:
        keys = self.out_keys_
        B, T = cols.tokens.shape
        out = TensorDict(
            {
                keys.tokens: cols.tokens,
                keys.attention_mask: cols.attention_mask,
                keys.mask: cols.mask,
                keys.turn: cols.turn,
                keys.reward: cols.reward.unsqueeze(-1),
                keys.done: cols.done.unsqueeze(-1),
                keys.terminated: cols.terminated.unsqueeze(-1),
                keys.truncated: cols.truncated.unsqueeze(-1),
            },
            batch_size=[B, T],
            device=None,
        )
        if links is not None:
            link = torch.tensor(links, dtype=torch.long, device=cols.tokens.device)
            out.set(keys.next_turn_row, link.unsqueeze(-1).expand(B, T).clone())
        if cols.has_log_prob:
            out.set(keys.sample_log_prob, cols.sample_log_prob)
        if cols.has_ref:
            out.set(keys.ref_log_prob, cols.ref_log_prob)
        if cols.has_kl:
            out.set(keys.kl_penalty, cols.kl_penalty)
        return out


# --------------------------------------------------------------------------- #
# Full-sequence layout, one row per turn: bootstrap values across turns
# --------------------------------------------------------------------------- #


def bootstrap_from_next_turn(
    tensordict: TensorDictBase,
    *,
    value_key: NestedKey = "state_value",
    next_value_key: NestedKey = ("next", "state_value"),
    mask_key: NestedKey = "mask",
    link_key: NestedKey = "next_turn_row",
) -> TensorDictBase:
    """Turn layout: set each turn's bootstrap value to the value of the next turn's prompt.

    For a row ``b`` whose dialog continues in row ``n = next_turn_row[b]``::

        next_state_value[b, last(b)] = state_value[n, first(n)]

    where ``last(b)`` is the last generated token of row ``b`` and ``first(n)``
    the first of row ``n``: ``state_value[n, first(n)]`` is the critic's value of
    the next turn's whole prompt (the history plus the tool/user reply), the
    state the environment moved to. Rows without a next turn in the batch keep
    their value (a dialog cut by the batch boundary), and terminal rows are not
    bootstrapped by :class:`~ppo_objectives.value.gae.MaskedGAE` anyway. Call it on
    the whole converted batch, after the critic and before a replay buffer
    shuffles rows (``next_turn_row`` indexes rows of this batch). Modifies and
    returns ``tensordict``.

    Shapes: ``state_value`` and ``("next", "state_value")`` ``[B, T, 1]`` or
    ``[B, T]``, ``mask`` and ``next_turn_row`` ``[B, T]``.

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> td = TensorDict(
        ...     {
        ...         "mask": torch.tensor([[False, True, True, False], [False, False, True, True]]),
        ...         "next_turn_row": torch.tensor([[1] * 4, [-1] * 4]),       # row 0 continues in row 1
        ...         "state_value": torch.tensor([[0.0, 1.0, 2.0, 0.0], [0.0, 0.0, 5.0, 6.0]]),
        ...         ("next", "state_value"): torch.tensor([[0.0, 2.0, 3.0, 0.0], [0.0, 0.0, 6.0, 7.0]]),
        ...     },
        ...     batch_size=[2, 4],
        ... )
        >>> bootstrap_from_next_turn(td)["next", "state_value"]            # 3. -> V(next prompt) = 5.
        tensor([[0., 2., 5., 0.],
                [0., 0., 6., 7.]])
    """
    def need(key, what, fix):
        return TD.require(tensordict, key, module="bootstrap_from_next_turn", what=what, fix=fix, collector_fix=False)

    mask = need(mask_key, "the response mask", "it is written by LLMToTokenBatch (set mask_key= if it lives elsewhere)")
    link = need(link_key, "the next turn's row", "it is written by LLMToTokenBatch(layout='turn')")
    critic = "run the critic first (e.g. CausalLMCritic)"
    value, next_value = need(value_key, "the values", critic), need(next_value_key, "the next values", critic)
    mask = _validate.check_mask(mask, link.shape, "next_turn_row")
    B, T = mask.shape
    trailing = next_value.dim() == 3
    v = value.reshape(B, T)
    nv = next_value.reshape(B, T).clone()
    pos = torch.arange(T, device=mask.device).expand(B, T)
    last = torch.where(mask, pos, -1).amax(-1)  # [B], -1 for an empty row
    first = torch.where(mask, pos, T).amin(-1)  # [B], T for an empty row
    nxt = link[:, 0]
    ok = (nxt >= 0) & (last >= 0)
    safe_next = nxt.clamp(min=0)
    first_of_next = first[safe_next]
    ok = ok & (first_of_next < T)
    boot = v[safe_next, first_of_next.clamp(max=T - 1)]
    rows = torch.arange(B, device=mask.device)
    cur = nv[rows, last.clamp(min=0)]
    nv[rows, last.clamp(min=0)] = torch.where(ok, boot.to(nv.dtype), cur)
    tensordict.set(next_value_key, nv.unsqueeze(-1) if trailing else nv)
    return tensordict


# --------------------------------------------------------------------------- #
# Read-outs of the full-sequence layout [B, T]: every token of a row, 0 off the mask
# --------------------------------------------------------------------------- #


def _check_row_inputs(tokens: Tensor, attention_mask: Tensor | None, mask: Tensor | None, who: str):
    if not isinstance(tokens, Tensor) or tokens.dim() != 2:
        shape = tuple(tokens.shape) if isinstance(tokens, Tensor) else type(tokens).__name__
        raise ValueError(
            f"{who}: tokens must be a [B, T] tensor of token ids, got {shape}; convert TorchRL turn batches "
            f"with LLMToTokenBatch first"
        )
    if tokens.is_floating_point() or tokens.dtype == torch.bool:
        raise TypeError(f"{who}: tokens must hold integer token ids, got dtype {tokens.dtype}")
    _validate.check_same_device(tokens=tokens, attention_mask=attention_mask, mask=mask)
    if attention_mask is not None:
        attention_mask = _validate.check_mask(attention_mask, tokens.shape, "tokens")
    if mask is not None:
        mask = _validate.check_mask(mask, tokens.shape, "tokens")
    return attention_mask, mask


def _zero_off_mask(mask: Tensor | None, *xs: Tensor) -> tuple[Tensor, ...]:
    if mask is None:
        return xs
    return tuple(torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device)) for x in xs)


class CausalLMCritic(TensorDictModuleBase):
    """A value head on a causal LM: one forward pass scores every token of every row.

    ``state_value[b, t] = w . h[b, t - 1] + c`` is the value of the prefix
    ``tokens[b, :t]`` — the state in which token ``t`` was chosen — where ``h``
    are the LM's last hidden states (the decoder only; the LM head is not run)
    and ``(w, c)`` a linear head (:func:`~ppo_objectives.llm.readouts.value_head` with ``init="normal"``).
    ``("next", "state_value")[b, t] = w . h[b, t] + c``
    is the value after token ``t`` (equal to ``state_value[b, t + 1]``); on the
    last token of a dialog cut by the batch boundary it is the bootstrap value
    :class:`~ppo_objectives.value.gae.MaskedGAE` reads. Both are exactly 0 where
    ``mask`` is False (holes and padding) and have the TorchRL layout ``[B, T, 1]``.

    This is the token-level critic of RLHF-PPO (Ouyang et al. 2022; Ziegler et
    al. 2019): a copy of the policy LM with a scalar head instead of the LM head.

    Args:
        model: a Hugging Face causal LM (``AutoModelForCausalLM.from_config(...)``,
            or a copy of the policy's model) or its decoder; any module called
            as ``model(input_ids=..., attention_mask=...)`` returning
            ``.last_hidden_state`` of size ``hidden_size``. Its decoder is found by
            :func:`~ppo_objectives.llm.hf.hf_decoder` and called through
            :func:`~ppo_objectives.llm.hf.hf_forward`, as in ``HFCausalLMAdapter``.

    Keyword Args:
        hidden_size: defaults to ``model.config.hidden_size``.
        tokens_key, attention_mask_key, mask_key: inputs (``[B, T]``).
        out_key, next_out_key: outputs; ``next_out_key=None`` skips it.

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> class Embed(torch.nn.Module):                 # stands in for a causal LM's decoder
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.emb = torch.nn.Embedding(10, 4)
        ...     def forward(self, input_ids, attention_mask=None):
        ...         return type("Out", (), {"last_hidden_state": self.emb(input_ids)})()
        >>> critic = CausalLMCritic(Embed(), hidden_size=4)
        >>> td = TensorDict(
        ...     {"tokens": torch.tensor([[1, 2, 3, 0]]), "attention_mask": torch.tensor([[1, 1, 1, 0]]).bool(),
        ...      "mask": torch.tensor([[False, True, True, False]])},
        ...     batch_size=[1, 4],
        ... )
        >>> critic(td)["state_value"].shape
        torch.Size([1, 4, 1])
        >>> (td["state_value"].squeeze(-1) != 0).tolist()     # exactly 0 off the mask
        [[False, True, True, False]]
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        hidden_size: int | None = None,
        tokens_key: NestedKey = "tokens",
        attention_mask_key: NestedKey | None = "attention_mask",
        mask_key: NestedKey = "mask",
        out_key: NestedKey = "state_value",
        next_out_key: NestedKey | None = ("next", "state_value"),
    ):
        super().__init__()
        if hidden_size is None:
            config = getattr(model, "config", None)
            hidden_size = getattr(config, "hidden_size", None)
            if hidden_size is None:
                raise ValueError(
                    f"CausalLMCritic: cannot read hidden_size from {type(model).__name__}.config; pass hidden_size="
                )
        self.backbone = hf_decoder(model)
        self.head = value_head(int(hidden_size), init="normal")
        self.tokens_key, self.attention_mask_key, self.mask_key = tokens_key, attention_mask_key, mask_key
        self.out_key, self.next_out_key = out_key, next_out_key
        self.in_keys = [k for k in (tokens_key, attention_mask_key, mask_key) if k is not None]
        self.out_keys = [k for k in (out_key, next_out_key) if k is not None]

    def values(self, tokens: Tensor, attention_mask: Tensor | None = None, mask: Tensor | None = None):
        """``(state_value, next_state_value)``, both ``[B, T]``, from ``[B, T]`` inputs."""
        attention_mask, mask = _check_row_inputs(tokens, attention_mask, mask, "CausalLMCritic")
        h = hf_forward(self.backbone, tokens, attention_mask, output="last_hidden_state")  # [B, T, H]
        after = read_values(self.head, h)  # [B, T]: value after token t
        before = torch.cat([after.new_zeros(after.shape[0], 1), after[:, :-1]], dim=1)  # value before token t
        before, after = _zero_off_mask(mask, before, after)
        return before, after

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        get = lambda k: None if k is None else tensordict.get(k, None)  # noqa: E731
        before, after = self.values(tensordict.get(self.tokens_key), get(self.attention_mask_key), get(self.mask_key))
        tensordict.set(self.out_key, before.unsqueeze(-1))
        if self.next_out_key is not None:
            tensordict.set(self.next_out_key, after.unsqueeze(-1))
        return tensordict


class CausalLMTokenLogProbs(TensorDictModuleBase):
    """Per-token log-probs (and entropies) of every row under a causal LM, in one forward pass.

    ``log_prob[b, t] = log_softmax(logits[b, t - 1])[tokens[b, t]]`` for ``t >= 1``
    (the alignment of ``sample_log_prob`` in
    :class:`LLMToTokenBatch`), in float32 without a full
    ``[B, T, V]`` float32 log-softmax. Exactly 0 where ``mask`` is False.
    ``entropy[b, t]`` is the entropy of the same distribution.

    Two paths, the same numbers (up to float rounding):

    - **logits** (``from_hidden=False``): the model's own forward (hooks and
      model-specific logit processing apply) and :func:`~ppo_objectives.llm.readouts.read_log_probs`.
    - **hidden states** (``from_hidden=True``): the decoder only
      (:func:`~ppo_objectives.llm.hf.hf_decoder` through
      :func:`~ppo_objectives.llm.hf.hf_forward`, ``last_hidden_state``), then the head
      ``model.get_output_embeddings()`` folded into
      :func:`~ppo_objectives.functional.response_log_probs_from_hidden`: the
      ``[B, T, V]`` logits are never formed and positions where ``mask`` is False are
      not projected. Only for a head that is exactly an ``nn.Linear`` without forward
      hooks, on a model without forward hooks whose config neither soft-caps nor
      scales the logits (``final_logit_softcapping``, ``logit_scale``,
      ``logits_scaling``): then the logits are ``hidden @ W^T + b`` and the paths agree.
    - ``from_hidden="auto"`` (the default): hidden states when the model qualifies and
      ``V >= FROM_HIDDEN_MIN_VOCAB`` (:data:`~ppo_objectives.llm.readouts.FROM_HIDDEN_MIN_VOCAB`), else logits.

    Use it as the actor read-out of ``TokenPPOLoss`` (gradients flow into the
    LM), and under ``torch.no_grad()`` with ``out_key="sample_log_prob"`` to
    recompute the sampling log-probs of a converted batch.

    ``temperature=T`` scores ``log_softmax(logits / T)`` on both paths (the entropy too):
    when the turns were generated at a temperature (``TransformersWrapper``'s
    ``generate_kwargs={"temperature": T}``, vLLM's ``SamplingParams(temperature=T)``), give
    the same ``T`` both to the actor read-out and to the recompute of ``sample_log_prob``
    (after :class:`LLMToTokenBatch`), or the PPO ratio is not 1
    before the first update (TRL issue #4159). Top-k / top-p truncation is not modelled:
    recompute with a sampler that used none.

    Args:
        model: a Hugging Face causal LM (the one inside ``TransformersWrapper``,
            ``wrapper.model``), called through :func:`~ppo_objectives.llm.hf.hf_forward`
            as ``model(input_ids=..., attention_mask=...)`` and returning
            ``.logits`` ``[B, T, V]``.

    Keyword Args:
        tokens_key, attention_mask_key, mask_key: inputs (``[B, T]``).
        out_key: the log-prob output. Defaults to ``"log_prob"``.
        entropy_key: the entropy output; ``None`` skips it. Defaults to ``"entropy"``.
        from_hidden: ``True``, ``False`` or ``"auto"`` (above).
        temperature: the sampling temperature (above). Defaults to 1.0 (no division).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        tokens_key: NestedKey = "tokens",
        attention_mask_key: NestedKey | None = "attention_mask",
        mask_key: NestedKey = "mask",
        out_key: NestedKey = "log_prob",
        entropy_key: NestedKey | None = "entropy",
        from_hidden: bool | str = "auto",
        temperature: float = 1.0,
    ):
        super().__init__()
        check_from_hidden(from_hidden, "CausalLMTokenLogProbs")
        self.temperature = check_temperature(temperature, "CausalLMTokenLogProbs: ")
        self.model = model
        self.tokens_key, self.attention_mask_key, self.mask_key = tokens_key, attention_mask_key, mask_key
        self.out_key, self.entropy_key = out_key, entropy_key
        self.in_keys = [k for k in (tokens_key, attention_mask_key, mask_key) if k is not None]
        self.out_keys = [k for k in (out_key, entropy_key) if k is not None]
        fix = (
            "the hidden-state path needs model.get_output_embeddings() to be a plain nn.Linear without hooks and "
            "no logit soft-capping / scaling in the config; use from_hidden=False (the model's own logits)"
        )
        #: Whether this read-out scores hidden states (True) or the model's logits (False).
        self.from_hidden = use_hidden(from_hidden, _hf_linear_head(model), "CausalLMTokenLogProbs", fix)

    def log_probs(self, tokens: Tensor, attention_mask: Tensor | None = None, mask: Tensor | None = None):
        """``(log_prob, entropy)``, both ``[B, T]`` float32, from ``[B, T]`` inputs."""
        attention_mask, mask = _check_row_inputs(tokens, attention_mask, mask, "CausalLMTokenLogProbs")
        B, T = tokens.shape
        if self.from_hidden:
            return self._from_hidden(tokens, attention_mask, mask)
        logits = hf_forward(self.model, tokens, attention_mask, output="logits")  # [B, T, V]
        if T < 2:
            zeros = logits.new_zeros(B, T, dtype=torch.float32)
            return zeros, zeros.clone()
        ones = torch.ones(B, dtype=torch.long, device=tokens.device)
        lp, ent = read_log_probs(logits, tokens, ones, T - 1, return_entropy=True,
                                 temperature=self.temperature)  # tokens 1..T-1
        pad = lp.new_zeros(B, 1)
        lp, ent = torch.cat([pad, lp], dim=1), torch.cat([pad, ent], dim=1)
        return _zero_off_mask(mask, lp, ent)

    def _from_hidden(self, tokens: Tensor, attention_mask: Tensor | None, mask: Tensor | None):
        B, T = tokens.shape
        hidden = hf_forward(hf_decoder(self.model), tokens, attention_mask, output="last_hidden_state")  # [B, T, C]
        if T < 2:
            zeros = hidden.new_zeros(B, T, dtype=torch.float32)
            return zeros, zeros.clone()
        weight, bias = _hf_linear_head(self.model)
        ones = torch.ones(B, dtype=torch.long, device=tokens.device)
        lp, ent = response_log_probs_from_hidden(
            hidden, weight, tokens, ones, T - 1, lm_head_bias=bias, mask=None if mask is None else mask[:, 1:],
            return_entropy=True, temperature=self.temperature,
        )  # fmt: skip
        pad = lp.new_zeros(B, 1)
        lp, ent = torch.cat([pad, lp], dim=1), torch.cat([pad, ent], dim=1)
        return _zero_off_mask(mask, lp, ent)

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        get = lambda k: None if k is None else tensordict.get(k, None)  # noqa: E731
        lp, ent = self.log_probs(tensordict.get(self.tokens_key), get(self.attention_mask_key), get(self.mask_key))
        tensordict.set(self.out_key, lp)
        if self.entropy_key is not None:
            tensordict.set(self.entropy_key, ent)
        return tensordict


#: Config fields that change the logits after the head: a soft cap, and scales (1 is none).
_LOGIT_CAPS = ("final_logit_softcapping",)
_LOGIT_SCALES = ("logit_scale", "logits_scaling")


def _hf_linear_head(model: nn.Module) -> tuple[Tensor, Tensor | None] | None:
    """``(weight, bias)`` of a Hugging Face causal LM whose logits are exactly ``head(last_hidden_state)``,
    else ``None``."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if type(head) is not nn.Linear or has_forward_hooks(head) or has_forward_hooks(model):
        return None
    if hf_decoder(model) is model:  # a decoder alone: no head after it
        return None
    config = getattr(model, "config", None)
    if any(getattr(config, name, None) is not None for name in _LOGIT_CAPS):
        return None
    if any(getattr(config, name, None) not in (None, 1, 1.0) for name in _LOGIT_SCALES):
        return None
    return head.weight, head.bias

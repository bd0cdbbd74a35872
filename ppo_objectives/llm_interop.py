"""Interop with TorchRL's LLM stack: ``ChatEnv`` / ``LLMCollector`` batches into token-level PPO.

TorchRL's LLM tooling (:class:`~torchrl.envs.llm.ChatEnv`,
:class:`~torchrl.collectors.llm.LLMCollector`,
:class:`~torchrl.modules.llm.TransformersWrapper`) makes **one environment step
per assistant turn**; each step holds ragged token tensors
(``("tokens", "prompt" | "response" | "full")``, ``("log_probs", "response")``,
...). Our components (:class:`~ppo_objectives.value.MaskedGAE`,
``TokenPPOLoss``, ``KLPenaltyTransform``) read **one row per dialog and one
column per token**. This module bridges the two:

- :class:`LLMToTokenBatch`: a :class:`~torchrl.envs.transforms.Transform`
  (collector ``postproc`` or replay-buffer transform) from the turn-level batch
  to the token-level ``[B, T]`` layout.
- :class:`CausalLMCritic`: a value head on a Hugging Face causal LM that scores
  every token of a row in one forward pass and writes ``state_value``.
- :class:`CausalLMTokenLogProbs`: the matching actor read-out, the log-prob of
  every token of a row under the LM (for ``TokenPPOLoss`` and for recomputing
  the sampling log-probs, see the note in :class:`LLMToTokenBatch`).
- :func:`bootstrap_from_next_turn`: for the one-row-per-turn layout, the value
  of the next turn's prompt as each turn's bootstrap value.

``transformers`` is an optional extra (``pip install ppo_objectives[hf]``):
nothing here imports it; the two modules take an already built model.

Shape letters:

- ``B``: dialogs (rows) of the converted batch.
- ``T``: tokens per row, right-padded to the longest dialog of the batch.
- ``N, S``: rows and turns of the collector batch (``LLMCollector`` yields
  ``[N, S]``, or ``[N * S]`` when it flattens).
- ``L``: tokens of one turn's ``("tokens", "full")`` (ragged across turns).
- ``H``: hidden size of the language model; ``V`` its vocabulary size.

The token-level layout (``batch_size=[B, T]``; one row per dialog, or per
turn with ``layout="turn"``), per token ``t`` of row ``b``:

============================== ============ ==================================================
key                            shape        meaning
============================== ============ ==================================================
``"tokens"``                   [B, T]       token ids of the whole dialog (the last turn's
                                            ``("tokens", "full")``), right-padded
``"attention_mask"``           [B, T]       True on real tokens, False on padding
``"mask"``                     [B, T]       True on tokens the policy generated (every
                                            assistant turn, end-of-turn token included);
                                            system/user/tool tokens and padding are holes
``"turn"``                     [B, T]       index of the turn that generated the token, -1
                                            on holes
``"sample_log_prob"``          [B, T]       log-prob of the token at sampling time, 0 on holes
``("next", "reward")``         [B, T, 1]    a turn's scalar reward on its last generated
                                            token, or the per-token reward of TorchRL's KL
                                            transforms on the generated tokens
``("next", "done")`` etc.      [B, T, 1]    the dialog's last turn's ``done`` /
                                            ``terminated`` / ``truncated`` on its last
                                            generated token, False elsewhere
``"ref_log_prob"``             [B, T]       (when present upstream) the reference model's
                                            log-probs, from ``("next", "ref_log_probs", "full")``
``("torchrl", "kl_penalty")``  [B, T]       (when present upstream) TorchRL's ``kl_penalty``
``"next_turn_row"``            [B, T]       (``layout="turn"`` only) row of the dialog's next
                                            turn in the batch, -1 if none; constant along T
============================== ============ ==================================================

Log-prob, value and token alignment: ``sample_log_prob[b, t]`` is
``log p(tokens[b, t] | tokens[b, :t])`` and ``state_value[b, t]`` is the value
of the prefix ``tokens[b, :t]``, the state in which token ``t`` was chosen
(TorchRL's ``("log_probs", "full")`` uses the same alignment).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import TensorDictModuleBase
from tensordict.utils import NestedKey
from torch import Tensor, nn
from torchrl.envs.transforms import Transform

from ppo_objectives import functional as F
from ppo_objectives import _validate

__all__ = ["CausalLMCritic", "CausalLMTokenLogProbs", "LLMToTokenBatch", "bootstrap_from_next_turn"]


def _key_str(key: NestedKey) -> str:
    return repr(key if isinstance(key, str) else tuple(key))


def _as_key(key: NestedKey) -> NestedKey:
    return key if isinstance(key, str) else tuple(key)


def _get_1d(td: TensorDictBase, key: NestedKey, what: str, where: str) -> Tensor | None:
    """``td[key]`` for one turn as a 1-D tensor (``[L]``; a trailing ``1`` is dropped), or None."""
    if key is None:
        return None
    try:
        x = td.get(key, None)
    except ValueError:
        # ("next", "ref_log_probs", "full") asked, but ("next", "ref_log_probs") is a tensor:
        # TorchRL's KLRewardTransform stores the reference log-probs one level up
        x = td.get(key[:-1], None) if isinstance(key, tuple) and len(key) > 1 else None
    if x is None:
        return None
    if not isinstance(x, Tensor):
        raise TypeError(f"{what} {_key_str(key)} of {where} is a {type(x).__name__}, expected a tensor")
    if x.dim() == 2 and x.shape[-1] == 1:
        x = x.squeeze(-1)
    if x.dim() != 1:
        raise ValueError(
            f"{what} {_key_str(key)} of {where} has shape {tuple(x.shape)}, expected one value per token ([L] or "
            f"[L, 1]); is the batch a turn-level LLMCollector batch with unpadded tokens (pad_output=False)?"
        )
    return x


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


class LLMToTokenBatch(Transform):
    """Convert a turn-level ``LLMCollector`` batch into the token-level ``[B, T]`` PPO layout.

    Each row of the output is one dialog: the token ids of its last turn's
    ``("tokens", "full")`` (which contain every earlier turn), with ``mask``
    True exactly on the tokens the policy generated — in a multi-turn dialog
    the assistant turns, while system/user/tool tokens between them are holes
    that :class:`~ppo_objectives.value.MaskedGAE` skips. Turn ``k`` generated
    the tokens ``[len(prompt_k), len(full_k))`` of its own ``("tokens", "full")``;
    since every turn's full tokens are a prefix of the next turn's prompt, these
    are positions of the dialog row too (checked; an error says what to change
    when the tokenizer re-tokenises the history differently).

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
       batch with the policy (:class:`CausalLMTokenLogProbs` with
       ``out_key="sample_log_prob"`` under ``torch.no_grad()``), and compute the
       reference log-probs the same way, or use ``RetrieveKL(assistant_only=False)``.

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
    # The conversion
    # ------------------------------------------------------------------ #
    def convert(self, tensordict: TensorDictBase) -> TensorDict:
        """Return the token-level ``[B, T]`` batch of the turn-level ``tensordict`` (not modified)."""
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
        if self.tokens_key not in tensordict.keys(True):
            raise KeyError(
                f"LLMToTokenBatch: the turn tokens {_key_str(self.tokens_key)} are missing "
                f"(found {sorted(map(str, tensordict.keys()))}); is this an LLMCollector batch of a policy that "
                f"returns tokens (TransformersWrapper / vLLMWrapper)? Set tokens_key= otherwise"
            )
        padded = tensordict.get(("tokens", "padded"), None) if self.tokens_key[:1] == ("tokens",) else None
        if padded is not None and any(bool(p) for p in _flat_list(padded)):
            raise ValueError(
                "LLMToTokenBatch reads unpadded turns, but ('tokens', 'padded') is True: build the policy "
                "wrapper with pad_output=False (TransformersWrapper's default)"
            )
        if tensordict.batch_dims == 1:
            groups = [list(tensordict.unbind(0))]
            names = [[f"turn {i}" for i in range(tensordict.shape[0])]]
            split_on_break = True
        else:
            flat = tensordict.reshape(-1, tensordict.shape[-1]) if tensordict.batch_dims > 2 else tensordict
            groups = [list(row.unbind(0)) for row in flat.unbind(0)]
            names = [[f"turn [{n}, {s}]" for s in range(len(g))] for n, g in enumerate(groups)]
            split_on_break = False
        dialog_layout = self.layout == "dialog"
        dialogs: list[list[_Turn]] = []
        for group, group_names in zip(groups, names):
            current: list[_Turn] = []
            for turn_td, where in zip(group, group_names):
                turn = self._read_turn(turn_td, where)
                if current:
                    prev = current[-1]
                    # dialog layout: the previous turn's tokens must be a prefix of this prompt;
                    # turn layout (no such promise): at least the previous prompt must be
                    prefix = prev.full if dialog_layout else prev.full[: prev.prompt_len]
                    continues = _is_prefix(prefix, turn.full[: turn.prompt_len])
                    if prev.done:
                        dialogs.append(current)
                        current = []
                    elif not continues:
                        if not split_on_break and dialog_layout:
                            raise ValueError(
                                f"{where} does not continue {prev.where} although {prev.where} is not done: its "
                                f"prompt {_key_str(self.prompt_key)} does not start with the previous turn's "
                                f"{_key_str(self.tokens_key)} (the history was re-tokenised differently, e.g. "
                                f"TorchRL's History parsing strips the whitespace around a reply). The generated "
                                f"tokens of the earlier turn cannot be located in the dialog. Use "
                                f"LLMToTokenBatch(layout='turn') (one row per turn, bootstrapped from the next "
                                f"turn with bootstrap_from_next_turn), or keep the tokens incremental."
                            )
                        if split_on_break:
                            dialogs.append(current)
                            current = []
                current.append(turn)
            if current:
                dialogs.append(current)
        if dialog_layout:
            return self._pack(dialogs)
        rows, links, dialog_ends = [], [], []
        for dialog in dialogs:
            for k, turn in enumerate(dialog):
                rows.append([turn])
                links.append(len(rows) if k + 1 < len(dialog) else -1)
                dialog_ends.append(k + 1 == len(dialog))
        return self._pack(rows, links=links, ends=dialog_ends)

    def _read_turn(self, td: TensorDictBase, where: str) -> _Turn:
        full = _get_1d(td, self.tokens_key, "tokens", where)
        prompt = _get_1d(td, self.prompt_key, "prompt tokens", where)
        if full is None:
            raise KeyError(f"{where}: {_key_str(self.tokens_key)} is missing")
        if prompt is None:
            raise KeyError(
                f"{where}: the prompt tokens {_key_str(self.prompt_key)} are missing; they locate the generated "
                f"tokens inside {_key_str(self.tokens_key)}"
            )
        if full.is_floating_point() or prompt.is_floating_point():
            raise TypeError(f"{where}: token ids must be integers, got {full.dtype} and {prompt.dtype}")
        p, L = prompt.numel(), full.numel()
        if p > L or not _is_prefix(prompt, full):
            raise ValueError(
                f"{where}: the prompt {_key_str(self.prompt_key)} (length {p}) is not a prefix of "
                f"{_key_str(self.tokens_key)} (length {L}); the generated tokens cannot be located"
            )
        lp = None
        if self.log_prob_key is not None:
            lp = _get_1d(td, self.log_prob_key, "log-probs", where)
            if lp is not None:
                if self.log_prob_key[-1] == "full":
                    if lp.numel() < L:
                        raise ValueError(
                            f"{where}: {_key_str(self.log_prob_key)} has {lp.numel()} entries but "
                            f"{_key_str(self.tokens_key)} has {L} tokens; a '*full' log-prob key needs one per token"
                        )
                    lp = lp[p:L]
                elif lp.numel() != L - p:
                    raise ValueError(
                        f"{where}: {_key_str(self.log_prob_key)} has {lp.numel()} entries but the turn generated "
                        f"{L - p} tokens ({_key_str(self.tokens_key)} length {L} minus prompt length {p}); "
                        f"pass the full log-probs with a key ending in 'full' instead"
                    )
                lp = lp.detach()
        reward = None
        if self.reward_key is not None:
            r = td.get(self.reward_key, None)
            if r is None:
                raise KeyError(
                    f"{where}: the reward {_key_str(self.reward_key)} is missing; add a reward transform to the "
                    f"environment, or pass reward_key=None for zero rewards"
                )
            if r.numel() == 1:
                reward = r.reshape(()).detach()
            else:
                reward = _get_1d(td, self.reward_key, "reward", where)
                if reward.numel() < L:
                    raise ValueError(
                        f"{where}: the reward {_key_str(self.reward_key)} has shape {tuple(r.shape)}: expected one "
                        f"turn-level value ([1]) or one per token of {_key_str(self.tokens_key)} ([{L}, 1])"
                    )
                reward = reward[:L].detach()
        per_token = {}
        for name, key in (("ref_log_prob", self.ref_log_prob_key), ("kl", self.kl_key)):
            x = _get_1d(td, key, name, where)
            if x is not None:
                if x.numel() < L:
                    raise ValueError(
                        f"{where}: {_key_str(key)} has {x.numel()} entries but {_key_str(self.tokens_key)} has {L} "
                        f"tokens; TorchRL's KL transforms write one value per token of the full sequence"
                    )
                x = x[:L].detach()
            per_token[name] = x
        flags = [_flag(td, k) for k in (self.done_key, self.terminated_key, self.truncated_key)]
        if all(f is None for f in flags):
            done = terminated = truncated = False
        else:
            done, terminated, truncated = F.resolve_done_flags(*flags)
        return _Turn(
            where=where,
            prompt_len=p,
            full=full,
            log_prob=lp,
            reward=reward,
            ref_log_prob=per_token["ref_log_prob"],
            kl=per_token["kl"],
            done=bool(done),
            terminated=bool(terminated),
            truncated=bool(truncated),
        )

    def _pack(
        self, dialogs: list[list[_Turn]], links: list[int] | None = None, ends: list[bool] | None = None
    ) -> TensorDict:
        keys = self.out_keys_
        B = len(dialogs)
        T = max(d[-1].full.numel() for d in dialogs)
        device = dialogs[0][-1].full.device
        fdtype = torch.get_default_dtype()
        for d in dialogs:
            for t in d:
                for x in (t.log_prob, t.reward, t.ref_log_prob, t.kl):
                    if x is not None and x.is_floating_point():
                        fdtype = torch.promote_types(fdtype, x.dtype)
        tokens = torch.full((B, T), self.pad_token_id, dtype=torch.long, device=device)
        attention = torch.zeros(B, T, dtype=torch.bool, device=device)
        mask = torch.zeros(B, T, dtype=torch.bool, device=device)
        turn_id = torch.full((B, T), -1, dtype=torch.long, device=device)
        logp = torch.zeros(B, T, dtype=fdtype, device=device)
        reward = torch.zeros(B, T, dtype=fdtype, device=device)
        ref = torch.zeros(B, T, dtype=fdtype, device=device)
        kl = torch.zeros(B, T, dtype=fdtype, device=device)
        flags = {n: torch.zeros(B, T, dtype=torch.bool, device=device) for n in ("done", "terminated", "truncated")}
        has = {"log_prob": False, "ref": False, "kl": False}
        for b, dialog in enumerate(dialogs):
            last = dialog[-1]
            L = last.full.numel()
            tokens[b, :L] = last.full
            attention[b, :L] = True
            for k, turn in enumerate(dialog):
                lo, hi = turn.prompt_len, turn.full.numel()
                if hi > L or not _is_prefix(turn.full, last.full):
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
                    continue
                mask[b, lo:hi] = True
                turn_id[b, lo:hi] = k
                if turn.log_prob is not None:
                    logp[b, lo:hi] = turn.log_prob.to(fdtype)
                    has["log_prob"] = True
                if turn.reward is not None:
                    if turn.reward.dim() == 0:
                        reward[b, hi - 1] += turn.reward.to(fdtype)
                    else:
                        reward[b, lo:hi] += turn.reward[lo:hi].to(fdtype)
                if turn.ref_log_prob is not None:
                    ref[b, lo:hi] = turn.ref_log_prob[lo:hi].to(fdtype)
                    has["ref"] = True
                if turn.kl is not None:
                    kl[b, lo:hi] = turn.kl[lo:hi].to(fdtype)
                    has["kl"] = True
            # the dialog's end flags go on its last generated token (turn layout: only on its last turn)
            pos = mask[b].nonzero()
            if pos.numel() and (ends is None or ends[b]):
                end = int(pos[-1])
                flags["done"][b, end] = last.done
                flags["terminated"][b, end] = last.terminated
                flags["truncated"][b, end] = last.truncated
        out = TensorDict(
            {
                keys.tokens: tokens,
                keys.attention_mask: attention,
                keys.mask: mask,
                keys.turn: turn_id,
                keys.reward: reward.unsqueeze(-1),
                keys.done: flags["done"].unsqueeze(-1),
                keys.terminated: flags["terminated"].unsqueeze(-1),
                keys.truncated: flags["truncated"].unsqueeze(-1),
            },
            batch_size=[B, T],
            device=None,
        )
        if links is not None:
            link = torch.tensor(links, dtype=torch.long, device=device)
            out.set(keys.next_turn_row, link.unsqueeze(-1).expand(B, T).clone())
        if has["log_prob"]:
            out.set(keys.sample_log_prob, logp)
        if has["ref"]:
            out.set(keys.ref_log_prob, ref)
        if has["kl"]:
            out.set(keys.kl_penalty, kl)
        return out


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
    bootstrapped by :class:`~ppo_objectives.value.MaskedGAE` anyway. Call it on
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
    mask = tensordict.get(mask_key, None)
    if mask is None:
        raise KeyError(
            f"bootstrap_from_next_turn: the response mask {_key_str(mask_key)} is missing; it is written by "
            f"LLMToTokenBatch (set mask_key= if it lives elsewhere)"
        )
    link = tensordict.get(link_key, None)
    if link is None:
        raise KeyError(
            f"bootstrap_from_next_turn: {_key_str(link_key)} is missing; it is written by "
            f"LLMToTokenBatch(layout='turn')"
        )
    value, next_value = tensordict.get(value_key), tensordict.get(next_value_key)
    if value is None or next_value is None:
        raise KeyError(
            f"bootstrap_from_next_turn: run the critic first ({_key_str(value_key)} and "
            f"{_key_str(next_value_key)} are needed, e.g. from CausalLMCritic)"
        )
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
# Critic and actor read-outs on a causal LM
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


def _backbone_hidden(model: nn.Module, tokens: Tensor, attention_mask: Tensor | None) -> Tensor:
    """Last hidden states ``[B, T, H]`` of a Hugging Face causal LM (its decoder only, no LM head)."""
    am = None if attention_mask is None else attention_mask.long()
    out = model(input_ids=tokens, attention_mask=am)
    h = getattr(out, "last_hidden_state", None)
    if h is None:
        raise TypeError(
            f"{type(model).__name__} returned no last_hidden_state; pass the decoder of a Hugging Face causal "
            f"LM (model.base_model), or a module whose output has .last_hidden_state"
        )
    return h


def _decoder_of(model: nn.Module) -> nn.Module:
    base = getattr(model, "base_model", None)
    return base if isinstance(base, nn.Module) and base is not model else model


class CausalLMCritic(TensorDictModuleBase):
    """A value head on a causal LM: one forward pass scores every token of every row.

    ``state_value[b, t] = w . h[b, t - 1] + c`` is the value of the prefix
    ``tokens[b, :t]`` — the state in which token ``t`` was chosen — where ``h``
    are the LM's last hidden states (the decoder only; the LM head is not run)
    and ``(w, c)`` a linear head. ``("next", "state_value")[b, t] = w . h[b, t] + c``
    is the value after token ``t`` (equal to ``state_value[b, t + 1]``); on the
    last token of a dialog cut by the batch boundary it is the bootstrap value
    :class:`~ppo_objectives.value.MaskedGAE` reads. Both are exactly 0 where
    ``mask`` is False (holes and padding) and have the TorchRL layout ``[B, T, 1]``.

    This is the token-level critic of RLHF-PPO (Ouyang et al. 2022; Ziegler et
    al. 2019): a copy of the policy LM with a scalar head instead of the LM head.

    Args:
        model: a Hugging Face causal LM (``AutoModelForCausalLM.from_config(...)``,
            or a copy of the policy's model) or its decoder; any module called
            as ``model(input_ids=..., attention_mask=...)`` returning
            ``.last_hidden_state`` of size ``hidden_size``.

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
        self.backbone = _decoder_of(model)
        self.head = nn.Linear(int(hidden_size), 1)
        nn.init.normal_(self.head.weight, std=1.0 / (int(hidden_size) + 1) ** 0.5)
        nn.init.zeros_(self.head.bias)
        self.tokens_key, self.attention_mask_key, self.mask_key = tokens_key, attention_mask_key, mask_key
        self.out_key, self.next_out_key = out_key, next_out_key
        self.in_keys = [k for k in (tokens_key, attention_mask_key, mask_key) if k is not None]
        self.out_keys = [k for k in (out_key, next_out_key) if k is not None]

    def values(self, tokens: Tensor, attention_mask: Tensor | None = None, mask: Tensor | None = None):
        """``(state_value, next_state_value)``, both ``[B, T]``, from ``[B, T]`` inputs."""
        attention_mask, mask = _check_row_inputs(tokens, attention_mask, mask, "CausalLMCritic")
        h = _backbone_hidden(self.backbone, tokens, attention_mask)  # [B, T, H]
        after = self.head(h).squeeze(-1).float()  # [B, T]: value after token t
        before = torch.cat([after.new_zeros(after.shape[0], 1), after[:, :-1]], dim=1)  # value before token t
        if mask is not None:
            after = torch.where(mask, after, torch.zeros((), dtype=after.dtype, device=after.device))
            before = torch.where(mask, before, torch.zeros((), dtype=before.dtype, device=before.device))
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
    (the alignment of ``sample_log_prob`` in :class:`LLMToTokenBatch`),
    computed by :func:`ppo_objectives.functional.response_log_probs` in float32
    without a full ``[B, T, V]`` float32 log-softmax. Exactly 0 where ``mask``
    is False. ``entropy[b, t]`` is the entropy of the same distribution.

    Use it as the actor read-out of ``TokenPPOLoss`` (gradients flow into the
    LM), and under ``torch.no_grad()`` with ``out_key="sample_log_prob"`` to
    recompute the sampling log-probs of a converted batch.

    Args:
        model: a Hugging Face causal LM (the one inside ``TransformersWrapper``,
            ``wrapper.model``), called as ``model(input_ids=..., attention_mask=...)``
            and returning ``.logits`` ``[B, T, V]``.

    Keyword Args:
        tokens_key, attention_mask_key, mask_key: inputs (``[B, T]``).
        out_key: the log-prob output. Defaults to ``"log_prob"``.
        entropy_key: the entropy output; ``None`` skips it. Defaults to ``"entropy"``.
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
    ):
        super().__init__()
        self.model = model
        self.tokens_key, self.attention_mask_key, self.mask_key = tokens_key, attention_mask_key, mask_key
        self.out_key, self.entropy_key = out_key, entropy_key
        self.in_keys = [k for k in (tokens_key, attention_mask_key, mask_key) if k is not None]
        self.out_keys = [k for k in (out_key, entropy_key) if k is not None]

    def log_probs(self, tokens: Tensor, attention_mask: Tensor | None = None, mask: Tensor | None = None):
        """``(log_prob, entropy)``, both ``[B, T]`` float32, from ``[B, T]`` inputs."""
        attention_mask, mask = _check_row_inputs(tokens, attention_mask, mask, "CausalLMTokenLogProbs")
        B, T = tokens.shape
        am = None if attention_mask is None else attention_mask.long()
        logits = self.model(input_ids=tokens, attention_mask=am).logits  # [B, T, V]
        if T < 2:
            zeros = logits.new_zeros(B, T, dtype=torch.float32)
            return zeros, zeros.clone()
        ones = torch.ones(B, dtype=torch.long, device=tokens.device)
        lp, ent = F.response_log_probs(logits, tokens, ones, T - 1, return_entropy=True)  # tokens 1..T-1
        pad = lp.new_zeros(B, 1)
        lp, ent = torch.cat([pad, lp], dim=1), torch.cat([pad, ent], dim=1)
        if mask is not None:
            zero = torch.zeros((), dtype=lp.dtype, device=lp.device)
            lp, ent = torch.where(mask, lp, zero), torch.where(mask, ent, zero)
        return lp, ent

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        get = lambda k: None if k is None else tensordict.get(k, None)  # noqa: E731
        lp, ent = self.log_probs(tensordict.get(self.tokens_key), get(self.attention_mask_key), get(self.mask_key))
        tensordict.set(self.out_key, lp)
        if self.entropy_key is not None:
            tensordict.set(self.entropy_key, ent)
        return tensordict

"""The two batch layouts the PPO components read, and the converters that produce them.

Token-level PPO needs **one row per sequence and one column per token**, with a
boolean ``mask`` saying which tokens the policy generated (the tokens that get
a log-prob ratio, a value and an advantage). The package has two such layouts,
one per kind of source, and this module is their contract.

Shape letters:

- ``B``: rows of a converted batch (responses, dialogs or turns).
- ``P``: prompt width of :class:`~ppo_objectives.llm.env.TokenLMEnv` (prompts
  are left-padded to it); ``R``: response length (``max_new_tokens``);
  ``S = P + R``: the env's token buffer.
- ``T``: tokens per row of the full-sequence layout (right-padded to the
  longest row of the batch).
- ``N``: env rows of a collector batch; ``K``: collector steps (TokenLMEnv)
  or turns (``LLMCollector``) per env row.

Response layout
---------------

One row per **finished response** of :class:`~ppo_objectives.llm.env.TokenLMEnv`
(one env step per token), response tokens aligned on a common axis ``R``
(called the "LLM layout" in some docstrings). Produced by
:func:`trajectories_to_llm_batch` from a TorchRL collector batch.

The TensorDict has ``batch_size=[B]``: it holds the ``[B, S]`` inputs of the
actor and critic next to the ``[B, R]`` per-token entries, and a ``[B, R]``
TensorDict cannot hold a ``[B, S]`` entry.

================================ ============= ========= ==========================================
key                              shape         dtype     meaning
================================ ============= ========= ==========================================
``"input_ids"``                  [B, S]        int64     left-padded prompt (columns ``< P``), then
                                                         the response, padded after its end
``"attention_mask"``             [B, S]        bool      True on real tokens (prompt and response)
``"response_ids"``               [B, R]        int64     ``input_ids[:, P:]``
``"mask"``                       [B, R]        bool      True on the generated tokens (EOS
                                                         included); False on the padding after the
                                                         response's end. The prompt is not on this
                                                         axis, and there are no holes inside a row
``"sample_log_prob"``            [B, R]        float32   log-prob of the token at sampling time,
                                                         0 off the mask
``"token_reward"``               [B, R]        float32   the env's per-step reward (the score on the
                                                         last token plus any shaping), 0 off the mask
``"score"``                      [B]           float32   the reward of the response's last step
``"terminated"``                 [B]           bool      the response ended with EOS
``"truncated"``                  [B]           bool      it reached ``max_new_tokens`` without EOS
                                                         (both flags are per-row summaries, not
                                                         read by ``MaskedGAE``)
``"prompt_id"``                  [B]           int64     the env's ``prompt_id`` of the response's
                                                         prompt (when the env has one)
``"group"``                      [B]           int64     the env's ``group`` id: the responses to
                                                         one prompt drawn for ``group_size`` rows
                                                         share it (``GroupAdvantage`` reads it)
``"state_value"``                [B, R]        float32   (when the policy writes one per step: a
                                                         critic on the actor's trunk) the value of
                                                         the state each token was sampled in, 0
                                                         off the mask
================================ ============= ========= ==========================================

Written later by the training components (all ``[B, R]``, 0 off the mask
where they are per-token): ``("next", "reward")`` (a copy of ``token_reward``,
where ``MaskedGAE`` reads it: :class:`ToLLMBatch` writes it, and the training job
copies it by hand; :class:`~ppo_objectives.transforms.KLPenaltyTransform`
subtracts the KL penalty from it and writes ``ref_log_prob`` / ``kl_penalty``),
``state_value`` (the critic), ``advantage`` / ``value_target``
(:class:`~ppo_objectives.value.gae.MaskedGAE`), ``log_prob`` / ``entropy`` (the
actor). There are **no done flags**: ``MaskedGAE`` selects its response form
when ``("next", "done")`` is absent, and the next value after a row's last
valid token is 0 (the response ended).

Alignment: ``sample_log_prob[b, j] = log p(input_ids[b, P + j] | input_ids[b, :P + j])``
and ``state_value[b, j]`` is the value of ``input_ids[b, :P + j]``, the state
in which response token ``j`` was chosen.

Batch shape: ``MaskedGAE``, ``KLPenaltyTransform``, ``TokenPPOLoss`` and the
read-outs of :func:`~ppo_objectives.llm.readouts.make_actor_critic` all run on the
``[B]`` TensorDict as it comes. ``MaskedGAE`` prefers ``batch_size=[B, R]``
when only ``[B, R]`` entries are in the TensorDict (as in a hand-built batch).
One-token responses (``R == 1``) keep their token axis: a ``[B]`` TensorDict with
``[B, 1]`` entries is read as TorchRL's per-step layout (one trajectory of ``B``
steps) only when it carries TorchRL's ``("next", "done" | "terminated" |
"truncated")`` flags, which this layout never has (``ppo_objectives._td.step_shape``).

Consumers: :class:`~ppo_objectives.llm.readouts.ResponseLogProbs` and
:class:`~ppo_objectives.llm.readouts.ResponseValues` (the actor and critic of
:func:`~ppo_objectives.llm.readouts.make_actor_critic`, used by
``ppo_objectives/train/``), ``KLPenaltyTransform``, ``MaskedGAE`` (response
form), ``TokenPPOLoss``.

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

Consumers: :class:`~ppo_objectives.llm.readouts.CausalLMTokenLogProbs` and
:class:`~ppo_objectives.llm.readouts.CausalLMCritic` (also importable from
:mod:`ppo_objectives.llm`), :func:`bootstrap_from_next_turn`,
``KLPenaltyTransform`` (with a ``CausalLMTokenLogProbs`` reference),
``MaskedGAE`` (collector form), ``TokenPPOLoss``.

Converters
----------

=================================== ========================================== ===========================
converter                           from                                       to
=================================== ========================================== ===========================
:func:`trajectories_to_llm_batch`   TokenLMEnv collector batch ``[N, K]``      response layout ``[B]``
                                    (per-token steps; ``[K]`` or ``[W, N, K]``
                                    too)
:class:`ToLLMBatch`                 the same, as a collector ``postproc``      response layout ``[B]``
                                                                               with ``("next", "reward")``
:class:`LLMToTokenBatch`            ``LLMCollector`` turn batch ``[N, K]`` or  full-sequence layout
                                    ``[N * K]`` (ragged per-turn tokens)       ``[B, T]``
:func:`bootstrap_from_next_turn`    full-sequence layout, ``layout="turn"``,   the same batch, bootstrap
                                    after the critic                           values across turns
=================================== ========================================== ===========================

The old import paths keep working: ``ppo_objectives.llm.layouts.trajectories_to_llm_batch``,
``ppo_objectives.llm.layouts.LLMToTokenBatch`` and
``ppo_objectives.llm.layouts.bootstrap_from_next_turn``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.utils import NestedKey
from torch import Tensor
from torchrl.envs.transforms import Transform

from ppo_objectives import _td as TD
from ppo_objectives import _validate
from ppo_objectives import functional as F

__all__ = ["LLMToTokenBatch", "ToLLMBatch", "bootstrap_from_next_turn", "trajectories_to_llm_batch"]


# --------------------------------------------------------------------------- #
# TokenLMEnv collector batch [N, K] -> response layout [B] with [B, R] entries
# --------------------------------------------------------------------------- #

_COLLECTOR_KEYS = (
    "action",
    "sample_log_prob",
    ("next", "tokens"),
    ("next", "attention_mask"),
    ("next", "position"),
    ("next", "reward"),
    ("next", "done"),
    ("next", "terminated"),
    ("next", "truncated"),
)


def trajectories_to_llm_batch(batch: TensorDictBase, prompt_len: int, max_new_tokens: int) -> TensorDict:
    """Finished responses of a per-token collector batch, one row each (the response layout).

    A TorchRL collector returns ``[N, T]`` steps (``[T]`` for one env, ``[W, N, T]``
    from a ``MultiSyncCollector`` with stacked results), each
    row a stream of episodes of varying length. Every step whose
    ``("next", "done")`` is set closes one response; it is kept when its first
    token is inside the batch (episodes cut by the batch's start are
    dropped -- with ``reset_at_each_iter=True`` none are). Response token
    ``j`` of an episode ending at step ``t`` with length ``n`` was produced at
    step ``t - n + 1 + j``.

    Args:
        batch: collector output with ``action``, ``sample_log_prob`` and ``("next", ...)``
            ``tokens`` / ``attention_mask`` / ``position`` / ``reward`` /
            ``terminated`` / ``truncated``.
        prompt_len / max_new_tokens: ``P`` and ``M = R`` of the env.

    Returns:
        ``TensorDict`` with ``batch_size [B]``: ``input_ids [B, S]``,
        ``attention_mask [B, S]`` (prompt + response), ``response_ids [B, R]``,
        ``mask [B, R]`` (True = generated token), ``sample_log_prob [B, R]``
        (behaviour log-probs, 0 at padding), ``token_reward [B, R]`` (the env's
        per-step rewards: the score on the last token plus any shaping),
        ``score [B]`` (the last step's reward), ``terminated [B]`` and
        ``truncated [B]`` (bool), and ``prompt_id [B]`` when the env writes one. The module
        docstring states the layout in full.

    Example:
        >>> import torch
        >>> from torchrl.collectors import Collector  # torchrl 0.14's name for SyncDataCollector
        >>> from ppo_objectives.train.digit import DigitTask
        >>> from ppo_objectives.llm.env import TokenLMEnv
        >>> from ppo_objectives.llm.models import TinyCausalLM, TinyLMConfig
        >>> from ppo_objectives.llm.policy import make_actor
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <torch._C.Generator object at ...>
        >>> task = DigitTask("reverse", 2)
        >>> env = TokenLMEnv.from_task(task, num_envs=4, seed=0)
        >>> actor = make_actor(TinyCausalLM(TinyLMConfig.preset("pico", vocab_size=16, block_size=6)))
        >>> collector = Collector(env, actor, frames_per_batch=4 * 3, total_frames=12, reset_at_each_iter=True,
        ...                       auto_register_policy_transforms=False)
        >>> llm = trajectories_to_llm_batch(next(iter(collector)), env.prompt_len, env.max_new_tokens)
        >>> collector.shutdown()
        >>> llm["response_ids"].shape[1], llm["mask"].dtype, bool((llm["sample_log_prob"] <= 0).all())
        (3, torch.bool, True)
    """
    P, M = prompt_len, max_new_tokens
    if batch.batch_dims == 0:
        raise ValueError(
            f"expected a collector batch [*N, T] (time last), got batch_size {tuple(batch.batch_size)}: "
            "pass the collector's output, not a single step"
        )
    if batch.batch_dims == 1:
        batch = batch.unsqueeze(0)
    elif batch.batch_dims > 2:  # MultiSyncCollector stacks [workers, N, T]
        batch = batch.reshape(-1, batch.shape[-1])
    for key in _COLLECTOR_KEYS:
        TD.require(batch, key, module="trajectories_to_llm_batch", what="an entry of the collector batch",
                   fix="it needs the TokenLMEnv observations under 'next' and a policy that writes 'action' and "
                   "'sample_log_prob'", collector_fix=False)  # fmt: skip
    nxt = batch.get("next")
    _check_prompt_and_budget(batch, P, M)
    done = nxt.get("done").reshape(batch.shape)  # [N, T]
    n_idx, t_idx = done.nonzero(as_tuple=True)  # one entry per finished episode (host sync: plumbing)
    length = nxt.get("position")[n_idx, t_idx] - P  # [B] tokens generated
    start = t_idx - length + 1
    keep = start >= 0
    n_idx, t_idx, length, start = n_idx[keep], t_idx[keep], length[keep], start[keep]
    B = n_idx.numel()
    j = torch.arange(M, device=done.device)
    in_resp = j[None, :] < length[:, None]  # [B, M]
    steps = (start[:, None] + j[None, :]).clamp(max=batch.shape[1] - 1)  # [B, M]
    rows = n_idx[:, None].expand(B, M)
    logp = batch.get("sample_log_prob").reshape(batch.shape)[rows, steps].float()
    token_reward = nxt.get("reward").reshape(batch.shape)[rows, steps].float()
    input_ids = nxt.get("tokens")[n_idx, t_idx]  # [B, S]
    attention_mask = nxt.get("attention_mask")[n_idx, t_idx].bool()
    zero = torch.zeros((), device=done.device)
    extra = {}
    for key in ("prompt_id", "group"):  # the env's per-row ids, one per response
        if ("next", key) in batch.keys(include_nested=True):
            extra[key] = nxt.get(key).reshape(batch.shape)[n_idx, t_idx]
    if "state_value" in batch.keys():  # a policy with a value head wrote V_old at each step
        value = batch.get("state_value").reshape(batch.shape)[rows, steps].float()
        extra["state_value"] = torch.where(in_resp, value, zero)
    return TensorDict(
        **extra,
        input_ids=input_ids,
        attention_mask=attention_mask,
        response_ids=input_ids[:, P:],
        mask=in_resp,
        sample_log_prob=torch.where(in_resp, logp, zero),
        token_reward=torch.where(in_resp, token_reward, zero),
        score=nxt.get("reward").reshape(batch.shape)[n_idx, t_idx].float(),
        terminated=nxt.get("terminated").reshape(batch.shape)[n_idx, t_idx].bool(),
        truncated=nxt.get("truncated").reshape(batch.shape)[n_idx, t_idx].bool(),
        batch_size=[B],
        device=batch.device,
    )


def _check_prompt_and_budget(batch: TensorDictBase, P: int, M: int) -> None:
    """``P`` and ``M`` fit the batch: its token buffer is ``P + M`` wide, no step's next token goes left of
    column ``P``, and the batch does not start with every row one column past ``P`` while no step writes
    column ``P`` (fresh rows of a larger prompt: ``P`` and ``M`` swapped). One host read."""
    S = batch.get(("next", "tokens")).shape[-1]
    fix = "pass the env's values, ToLLMBatch(env.prompt_len, env.max_new_tokens)"
    if S != P + M:
        raise ValueError(f"trajectories_to_llm_batch: the env's token buffer has S={S} columns, but prompt_len + "
                         f"max_new_tokens = {P} + {M} = {P + M}; {fix}")
    position = batch.get("position", None)
    if position is None or not position.numel():
        return
    first = position.reshape(batch.shape)[:, 0]
    lo, fresh = torch.stack([position.min(), (first == first[0]).all().long() * first[0]]).tolist()
    # no token left of column P; and rows that all start at one column past P, with no step at P, are fresh rows
    # of a larger prompt (a batch cut mid-episode has steps at P where its next episodes start)
    if lo < P or (lo > P and fresh and fresh != P):
        raise ValueError(
            f"trajectories_to_llm_batch: the responses of this batch start at column {fresh or lo}, but prompt_len is "
            f"{P} (max_new_tokens {M}): were the two swapped? Every response would be dropped; {fix}"
        )


class ToLLMBatch:
    """A collector ``postproc``: TokenLMEnv trajectories -> the response layout, reward where GAE reads it.

    ``ToLLMBatch(P, M)(batch)`` is :func:`trajectories_to_llm_batch` followed by a copy of
    ``token_reward`` (the env's per-step reward: the score on the last token plus any
    shaping) into ``("next", "reward")`` ``[B, R]``, where
    :class:`~ppo_objectives.value.gae.MaskedGAE` and
    :class:`~ppo_objectives.transforms.KLPenaltyTransform` read the reward; the copy
    keeps ``token_reward`` as the env gave it when the KL penalty is subtracted. So a
    collector built with ``postproc=ToLLMBatch(env.prompt_len, env.max_new_tokens)``
    yields batches ``[B]`` (one row per finished response) that the critic,
    ``KLPenaltyTransform``, ``MaskedGAE`` and :class:`~ppo_objectives.loss.TokenPPOLoss`
    read as they come. It is the first step of ``rollout_batch`` in
    ``ppo_objectives/train/``.

    Use it with ``reset_at_each_iter=True`` (as the training job does), or the
    responses cut by the start of a batch are dropped (see
    :func:`trajectories_to_llm_batch`). A batch with no finished response gives
    ``B = 0`` rows.

    Args:
        prompt_len: ``P``, the env's prompt width (``env.prompt_len``).
        max_new_tokens: ``M = R``, the env's response budget (``env.max_new_tokens``).

    Example:
        >>> import torch
        >>> from torchrl.collectors import Collector
        >>> from ppo_objectives.train.digit import DigitTask
        >>> from ppo_objectives.llm.env import TokenLMEnv
        >>> from ppo_objectives.llm.models import TinyCausalLM, TinyLMConfig
        >>> from ppo_objectives.llm.policy import make_actor
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <torch._C.Generator object at ...>
        >>> env = TokenLMEnv.from_task(DigitTask("reverse", 2), num_envs=4, seed=0)
        >>> actor = make_actor(TinyCausalLM(TinyLMConfig.preset("pico", vocab_size=16, block_size=6)))
        >>> collector = Collector(env, actor, frames_per_batch=4 * 3, total_frames=12, reset_at_each_iter=True,
        ...                       auto_register_policy_transforms=False,
        ...                       postproc=ToLLMBatch(env.prompt_len, env.max_new_tokens))
        >>> llm = next(iter(collector))
        >>> collector.shutdown()
        >>> llm.batch_dims, llm["next", "reward"].shape[1], torch.equal(llm["next", "reward"], llm["token_reward"])
        (1, 3, True)
    """

    def __init__(self, prompt_len: int, max_new_tokens: int):
        self.prompt_len = _validate.check_int("prompt_len", prompt_len, low=1, where="ToLLMBatch ",
                                              what=" (the env's prompt width, env.prompt_len)")
        self.max_new_tokens = _validate.check_int("max_new_tokens", max_new_tokens, low=1, where="ToLLMBatch ",
                                                  what=" (the env's response budget, env.max_new_tokens)")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(prompt_len={self.prompt_len}, max_new_tokens={self.max_new_tokens})"

    def __call__(self, batch: TensorDictBase) -> TensorDict:
        llm = trajectories_to_llm_batch(batch, self.prompt_len, self.max_new_tokens)
        llm.set(("next", "reward"), llm.get("token_reward").clone())
        return llm


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
       batch with the policy (:class:`~ppo_objectives.llm.readouts.CausalLMTokenLogProbs`
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

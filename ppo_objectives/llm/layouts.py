"""The two batch layouts the PPO components read, and the converters that produce them.

Token-level PPO needs **one row per sequence and one column per token**, with a
boolean ``mask`` saying which tokens the policy generated (the tokens that get
a log-prob ratio, a value and an advantage). The package has two such layouts,
one per kind of source; this module is the contract of the **response layout**
(:class:`~ppo_objectives.llm.env.TokenLMEnv` rollouts, what the training job
runs) and its converters. The full-sequence layout of TorchRL's LLM stack is
:mod:`ppo_objectives.llm.chat`'s.

Shape letters:

- ``B``: rows of a converted batch (responses).
- ``P``: prompt width of :class:`~ppo_objectives.llm.env.TokenLMEnv` (prompts
  are left-padded to it); ``R``: response length (``max_new_tokens``);
  ``S = P + R``: the env's token buffer.
- ``N``: env rows of a collector batch; ``K``: collector steps per env row.

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
                                                         response's end, and on the holes of a
                                                         multi-turn response: the environment's
                                                         turns (in ``attention_mask``, read as
                                                         context). The prompt is not on this axis
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

The other layout, one row per dialog (or per turn) and one column per token of
the whole sequence, comes from TorchRL's ``LLMCollector``: its contract, its
converter and its read-outs are in :mod:`ppo_objectives.llm.chat`.

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
=================================== ========================================== ===========================
"""

from __future__ import annotations

import torch
from tensordict import TensorDict, TensorDictBase
from torch import Tensor

from ppo_objectives import _td as TD
from ppo_objectives import _validate

__all__ = ["ToLLMBatch", "trajectories_to_llm_batch"]


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
    dropped -- with ``reset_at_each_iter=True`` none are). Each step's token goes
    to its response column, the step's ``position`` minus ``P``: one column per
    step in a single-turn episode; in a multi-turn one the environment's turns
    (written by the step that ended an assistant turn) are holes between them,
    ``mask`` False, in ``input_ids`` and ``attention_mask`` as context.

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
    n_idx, t_idx, step_b, step_col = _episodes(batch, done, P)
    B = n_idx.numel()
    placed = step_b >= 0  # [N, T] the steps of a kept episode, each at its response column
    flat = (step_b * M + step_col)[placed]

    def per_token(x: Tensor, fill) -> Tensor:
        out = torch.full((B * M,), fill, dtype=x.dtype, device=done.device)
        return out.index_put_((flat,), x.reshape(batch.shape)[placed]).reshape(B, M)

    in_resp = per_token(torch.ones(batch.shape, dtype=torch.bool, device=done.device), False)  # [B, M]
    logp = per_token(batch.get("sample_log_prob").float(), 0.0)
    token_reward = per_token(nxt.get("reward").float(), 0.0)
    input_ids = nxt.get("tokens")[n_idx, t_idx]  # [B, S]
    attention_mask = nxt.get("attention_mask")[n_idx, t_idx].bool()
    extra = {}
    for key in ("prompt_id", "group"):  # the env's per-row ids, one per response
        if ("next", key) in batch.keys(include_nested=True):
            extra[key] = nxt.get(key).reshape(batch.shape)[n_idx, t_idx]
    if "state_value" in batch.keys():  # a policy with a value head wrote V_old at each step
        extra["state_value"] = per_token(batch.get("state_value").float(), 0.0)
    return TensorDict(
        **extra,
        input_ids=input_ids,
        attention_mask=attention_mask,
        response_ids=input_ids[:, P:],
        mask=in_resp,
        sample_log_prob=logp,
        token_reward=token_reward,
        score=nxt.get("reward").reshape(batch.shape)[n_idx, t_idx].float(),
        terminated=nxt.get("terminated").reshape(batch.shape)[n_idx, t_idx].bool(),
        truncated=nxt.get("truncated").reshape(batch.shape)[n_idx, t_idx].bool(),
        batch_size=[B],
        device=batch.device,
    )


def _episodes(batch: TensorDictBase, done: Tensor, P: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The finished episodes of a collector batch and where each step's token goes.

    Returns ``(n_idx [B], t_idx [B], step_b [N, T], step_col [N, T])``: the row and the step of each kept
    episode's last step (in row-major order), and for every step the response it belongs to (``-1``: an episode
    cut by the batch's start or not finished in it) and the response column of its token (its ``position`` minus
    ``P``: in a multi-turn episode the environment's turns sit between the steps, as holes). An episode is kept
    when its first step in the batch writes column ``P`` (it started inside the batch)."""
    N, T = done.shape
    position = batch.get("position", None)
    if position is None:  # a batch without the env's observation: one token per step
        position = batch.get(("next", "position")) - 1
    position = position.reshape(N, T)
    episode = done.long().cumsum(1) - done.long()  # [N, T] the episode of each step inside its row
    n_idx, t_idx = done.nonzero(as_tuple=True)  # one entry per finished episode (host sync: plumbing)
    same_row = torch.zeros_like(n_idx, dtype=torch.bool)
    same_row[1:] = n_idx[1:] == n_idx[:-1]
    start = torch.where(same_row, t_idx.roll(1) + 1, 0)  # the step after the row's previous end, else 0
    keep = position[n_idx, start] == P
    n_idx, t_idx = n_idx[keep], t_idx[keep]
    table = torch.full((N, int(episode.max()) + 1 if episode.numel() else 1), -1, dtype=torch.long,
                       device=done.device)
    table[n_idx, episode[n_idx, t_idx]] = torch.arange(n_idx.numel(), device=done.device)
    step_b = table.gather(1, episode)
    return n_idx, t_idx, step_b, position - P


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

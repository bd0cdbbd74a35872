"""PPO read-outs on a causal LM: per-token log-probs (actor) and per-token values (critic).

The read-outs of the response layout of :mod:`ppo_objectives.llm.layouts`, and the read-out
helpers that :mod:`ppo_objectives.llm.chat` shares for the full-sequence layout:

- **log-probs**: :func:`read_log_probs` turns logits into the log-probs (and
  entropies) of the tokens at given positions, always through
  :func:`ppo_objectives.functional.response_log_probs` (float32, chunked, no
  ``[B, T, V]`` float32 log-softmax). When the model exposes its LM head
  (:func:`lm_head_parameters`) and the vocabulary is large, the actor read-outs
  skip the logits altogether: they run the trunk only and score the hidden
  states with :func:`ppo_objectives.functional.response_log_probs_from_hidden`,
  which never forms the ``[B, T, V]`` logits (``from_hidden=``, see
  :data:`FROM_HIDDEN_MIN_VOCAB`).
- **values**: :func:`read_values` turns hidden states into values with a
  scalar head built by :func:`value_head`, the one value-head construction.

The modules read the response slice of a ``[B, P + R]`` forward of our LM interface
(``TinyCausalLM``, ``HFCausalLMAdapter``: ``LMOutput``):

==================================== ================================= =========================================
module                               positions                         model
==================================== ================================= =========================================
:class:`ResponseLogProbs`            response slice ``[P - 1, T - 1)`` our LM interface (``TinyCausalLM``,
:class:`ResponseValues`              -> ``[B, R]``                     ``HFCausalLMAdapter``): ``LMOutput``
==================================== ================================= =========================================

:func:`make_actor_critic` wraps them (plus the env policy of
:func:`ppo_objectives.llm.policy.make_actor`) for the response layout; it is what
``ppo_objectives/train/`` runs. :func:`frozen_reference` is the job's
reference policy: a frozen copy of the actor's LM read out like the actor. The
read-outs of the full-sequence layout of TorchRL's LLM stack
(``CausalLMTokenLogProbs``, ``CausalLMCritic``) use the same helpers and are in
:mod:`ppo_objectives.llm.chat`.

**Sampling temperature.** Every log-prob read-out takes ``temperature=T``
(default 1.0) and scores ``log_softmax(logits / T)``, the distribution a policy
sampling at ``T`` draws from (:mod:`ppo_objectives.llm.policy`): give it the
rollout's temperature, or the PPO ratio is not 1 before the first update (TRL
issue #4159). :func:`make_actor_critic` gives its env policy and its actor the same
``T``; :func:`frozen_reference` scores the reference at ``T`` as well, so the KL
penalty compares two distributions at one temperature (0 before the first update).
At ``T = 1`` nothing is divided.

Shape letters: ``B`` rows; ``P`` prompt width (left-padded prompts); ``R``
response length; ``T`` tokens per row; ``H`` hidden size; ``V`` vocabulary.
"""

from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass

import torch
from tensordict import TensorDictBase
from tensordict.nn import ProbabilisticTensorDictSequential, TensorDictModule, TensorDictModuleBase
from torch import Tensor, nn

from ppo_objectives import _validate
from ppo_objectives.functional import response_log_probs, response_log_probs_from_hidden, value_checks
from ppo_objectives.llm.models import TinyCausalLM, TinyLMConfig
from ppo_objectives.llm.policy import check_temperature, make_actor

__all__ = [
    "FROM_HIDDEN_MIN_VOCAB",
    "VALUE_HEAD_INITS",
    "ActorCritic",
    "ResponseLogProbs",
    "ResponseValues",
    "SharedForward",
    "attended_end",
    "frozen_reference",
    "lm_head_parameters",
    "make_actor_critic",
    "read_log_probs",
    "read_values",
    "shared_prefix",
    "value_head",
]

# --------------------------------------------------------------------------- #
# The shared read-outs
# --------------------------------------------------------------------------- #

#: The value-head initialisations :func:`value_head` knows.
VALUE_HEAD_INITS = ("zeros", "normal")


def value_head(hidden_size: int, *, init: str = "zeros") -> nn.Linear:
    """The critic's scalar head ``nn.Linear(hidden_size, 1)``: ``value = w·h + c``.

    Two initialisations, each kept because the results built on it depend on it:

    - ``init="zeros"`` (``w = 0``, ``c = 0``; :func:`make_actor_critic` and
      :class:`ResponseValues`, hence the training job): every value starts at
      exactly 0, so the first advantages are the returns themselves and no
      random value noise enters the first policy update. The trunk gets no value
      gradient until the head has moved away from 0 (one optimizer step).
    - ``init="normal"`` (``w ~ Normal(0, std = 1 / sqrt(H + 1))``, ``c = 0``;
      :class:`~ppo_objectives.llm.chat.CausalLMCritic`): a fan-in scaled head (``H`` inputs plus the
      bias), so values start at the scale of the hidden states (order one after
      the LM's final norm) and the trunk gets a value gradient from the first step.

    The head is built as an ``nn.Linear`` (whose default initialisation draws
    from the global RNG) and then overwritten; ``"normal"`` draws once more.

    Example:
        >>> head = value_head(4)
        >>> head.weight.abs().sum().item(), head.bias.item()
        (0.0, 0.0)
        >>> value_head(4, init="normal").weight.shape
        torch.Size([1, 4])
    """
    _validate.check_int("hidden_size", hidden_size, low=1, where="value_head ")
    if init not in VALUE_HEAD_INITS:
        raise ValueError(f"value_head init={init!r} is unknown; choose one of {VALUE_HEAD_INITS}")
    head = nn.Linear(hidden_size, 1)
    if init == "zeros":
        nn.init.zeros_(head.weight)
    else:
        nn.init.normal_(head.weight, std=1.0 / (hidden_size + 1) ** 0.5)
    nn.init.zeros_(head.bias)
    return head


def read_values(head: nn.Module, hidden: Tensor) -> Tensor:
    """Values ``[B, n]`` float32 of hidden states ``[B, n, H]``: ``head(hidden)`` without its feature dim
    (hidden states made under autocast are cast to the head's dtype first)."""
    return head(hidden.to(head.weight.dtype)).squeeze(-1).float()


class SharedForward:
    """One trunk forward per batch for an actor and a critic that share the trunk.

    :func:`make_actor_critic` with ``shared_trunk=True`` gives the actor's and the critic's
    read-outs one ``SharedForward``. The first read-out of a batch runs the model and keeps its
    output; the next call with the **same** ``input_ids`` and ``attention_mask`` tensors (the
    same objects, unmodified), the same parameter versions and the same grad mode takes that
    output instead of running the trunk again, and releases it. So
    :class:`~ppo_objectives.loss.TokenPPOLoss` (actor, then critic, on one minibatch) runs the
    trunk once, and its summed loss backpropagates through it once, with the gradients of two
    forwards. A backward pass through the kept output releases it too (its graph is gone), and
    any other call runs the model (and replaces what was kept).
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self._kept: tuple | None = None

    def _key(self, input_ids: Tensor, attention_mask: Tensor | None) -> tuple:
        versions = sum(p._version for p in self.model.parameters())
        mask_version = None if attention_mask is None else attention_mask._version
        return (input_ids._version, mask_version, versions, torch.is_grad_enabled(),
                getattr(self.model, "autocast_dtype", None))

    def __call__(self, input_ids: Tensor, attention_mask: Tensor | None, *, compute_logits: bool, end: int | None = None,
                 prompt_len: int = 0):
        """The model's output on ``input_ids[:, :end]`` (every column when ``end`` is ``None``), run as
        :func:`_run` runs it for prompts of width ``prompt_len``."""
        kept, self._kept = self._kept, None
        key = (*self._key(input_ids, attention_mask), end)
        if kept is not None:
            ids, mask, kept_key, out, _ = kept
            if (ids is input_ids and mask is attention_mask and kept_key == key
                    and (out.logits is not None or not compute_logits)):
                return out
        out = _run(self.model, input_ids[:, :end], _columns(attention_mask, end), prompt_len, compute_logits)
        token = object()  # names this forward; the hook must not reference ``out``
        kept = (input_ids, attention_mask, key, out, token)
        if out.hidden.requires_grad:  # a backward through it frees its graph: it can no longer be shared
            # The hook lives on the autograd graph, which the garbage collector cannot see through: a hook that held
            # ``out`` (or this object strongly) would keep a forward's graph, every activation saved for backward,
            # alive after its last user dropped it, whenever no backward ran (a minibatch the trust region stopped).
            owner = weakref.ref(self)
            out.hidden.register_hook(lambda grad, owner=owner, token=token: _release(owner, token))
        self._kept = kept
        return out


def _release(owner: weakref.ref, token: object) -> None:
    """A backward ran through the kept forward named ``token``: its graph is gone, so it can no longer be shared."""
    shared = owner()
    if shared is not None and shared._kept is not None and shared._kept[-1] is token:
        shared._kept = None


def _columns(attention_mask: Tensor | None, end: int | None) -> Tensor | None:
    return attention_mask if attention_mask is None or end is None else attention_mask[:, :end]


def attended_end(attention_mask: Tensor | None, prompt_len: int) -> int | None:
    """The columns a response-layout forward runs: ``[0, end)``, ``end`` one past the last column that some row
    attends (at least one response column); ``None`` (every column) without a mask.

    A causal model's output at a column does not depend on the columns after it, so cutting the columns that
    every row pads changes no number that is read, and a batch of short responses in a wide budget (a
    multi-turn task's 80 tokens, ``chat-calc``'s conversations of 5 to 49) pays for its tokens, not the
    budget's. One host synchronisation.

    Example:
        >>> attended_end(torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0]]), prompt_len=2)
        4
    """
    if attention_mask is None:
        return None
    attended = attention_mask[:, prompt_len:].bool().any(0)  # [R]
    last = int((attended * torch.arange(1, attended.numel() + 1, device=attended.device)).max())
    return prompt_len + max(last, 1)


def _pad_response(x: Tensor, R: int) -> Tensor:
    """``[B, R']`` -> ``[B, R]``: zeros after the columns a forward cut (:func:`attended_end`)."""
    return x if x.shape[1] == R else torch.nn.functional.pad(x, (0, R - x.shape[1]))


def shared_prefix(input_ids: Tensor, attention_mask: Tensor | None, prompt_len: int) -> tuple[int, Tensor | None]:
    """``(k, order)``: the longest run of tokens that every row's left-padded prompt starts with, and how to put
    it in the first ``k`` columns of every row.

    ``k`` stops one token short of the shortest prompt. ``order`` ``[B, T]`` (``None`` when no row is padded)
    gathers each row's columns as: its first ``k`` prompt tokens, then its padding, then the rest, which stays
    in its own columns; positions come from the mask, so a model that honours the mask computes the same
    numbers for every column from ``P - 1`` on. ``(0, None)``: one row, no mask, no common token, or a prompt
    that is not left-padded. Three host synchronisations.

    Example:
        >>> ids = torch.tensor([[0, 7, 8, 5, 1], [7, 8, 9, 6, 2]])     # row 0's prompt padded by one column
        >>> am = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
        >>> k, order = shared_prefix(ids, am, prompt_len=4)
        >>> k, ids.gather(1, order).tolist()                           # [7, 8] first; the response column stays
        (2, [[7, 8, 0, 5, 1], [7, 8, 9, 6, 2]])
    """
    if attention_mask is None or input_ids.shape[0] < 2:
        return 0, None
    prompt = attention_mask[:, :prompt_len].bool()
    pads = (~prompt).sum(1)  # [B]
    cols = torch.arange(prompt_len, device=input_ids.device)
    if not torch.equal(prompt, cols >= pads[:, None]):  # a prompt with a hole: not this layout
        return 0, None
    most_padding = int(pads.max())
    shortest = prompt_len - most_padding
    if shortest < 2:
        return 0, None
    tokens = input_ids.gather(1, pads[:, None] + cols[: shortest - 1])  # each row's prompt, from its first token
    k = int((tokens == tokens[:1]).all(0).long().cumprod(0).sum())
    if k == 0 or most_padding == 0:
        return k, None
    j = torch.arange(input_ids.shape[1], device=input_ids.device)
    order = torch.where(j < k, pads[:, None] + j, torch.where(j < k + pads[:, None], j - k, j))
    return k, order


def _can_share_prefix(model: nn.Module) -> bool:
    """Whether ``model``'s own class runs ``shared_prefix=k`` (``supports_shared_prefix``): a wrapper that forwards
    attribute reads to the model it wraps (FSDP's) does not count, for it would call the decoder twice per
    forward under its own hooks."""
    return isinstance(getattr(type(model), "supports_shared_prefix", None), property) and bool(
        model.supports_shared_prefix)


def _run(model: nn.Module, input_ids: Tensor, attention_mask: Tensor | None, prompt_len: int, compute_logits: bool):
    """``model``'s output for a response-layout batch: with the prompts' common prefix run once when the model
    can (``supports_shared_prefix``, :func:`shared_prefix`), whose prompt columns are then in that order (the
    read-outs read from column ``P - 1`` on, which is each row's own)."""
    kwargs = {} if compute_logits else {"compute_logits": False}
    if prompt_len and _can_share_prefix(model):
        k, order = shared_prefix(input_ids, attention_mask, prompt_len)
        if k:
            if order is not None:
                input_ids, attention_mask = input_ids.gather(1, order), attention_mask.gather(1, order)
            kwargs["shared_prefix"] = k
    return model(input_ids, attention_mask, **kwargs)  # the plain call: any model with the LM interface


def _trunk(readout: nn.Module, input_ids: Tensor, attention_mask: Tensor | None, *, compute_logits: bool):
    """The read-out's model output on the attended columns (:func:`attended_end`), the prompts' common prefix
    run once (:func:`_run`): through its :class:`SharedForward` when it has one."""
    end = attended_end(attention_mask, readout.prompt_len)
    shared = getattr(readout, "shared_forward", None)
    if shared is not None and shared.model is readout.model:
        return shared(input_ids, attention_mask, compute_logits=compute_logits, end=end, prompt_len=readout.prompt_len)
    return _run(readout.model, input_ids[:, :end], _columns(attention_mask, end), readout.prompt_len, compute_logits)


def read_log_probs(
    logits: Tensor,
    input_ids: Tensor,
    starts: Tensor,
    length: int,
    *,
    return_entropy: bool = False,
    entropy_grad: bool = True,
    temperature: float = 1.0,
) -> Tensor | tuple[Tensor, Tensor]:
    """Log-probs ``[B, length]`` (and entropies) of the tokens ``input_ids[b, starts[b] + j]``.

    ``logp[b, j] = log_softmax(logits[b, starts[b] - 1 + j] / temperature)[input_ids[b, starts[b] + j]]``,
    by :func:`ppo_objectives.functional.response_log_probs`. With ``entropy_grad=False`` (and
    gradients enabled) the entropy is computed without gradient: a logged diagnostic with a
    cheaper backward pass.

    Example:
        >>> logits = torch.zeros(1, 3, 4)                       # uniform over 4 tokens
        >>> read_log_probs(logits, torch.tensor([[1, 2, 3]]), torch.tensor([1]), 2)
        tensor([[-1.3863, -1.3863]])
    """
    kw = dict(temperature=temperature)
    if not return_entropy or entropy_grad or not torch.is_grad_enabled():
        return response_log_probs(logits, input_ids, starts, length, return_entropy=return_entropy, **kw)
    logp = response_log_probs(logits, input_ids, starts, length, **kw)
    with torch.no_grad():  # entropy for logging only: keep it out of the backward pass
        _, entropy = response_log_probs(logits.detach(), input_ids, starts, length, return_entropy=True, **kw)
    return logp, entropy


#: Smallest vocabulary for which ``from_hidden="auto"`` scores hidden states instead of logits.
#: Below it the ``[B, T, V]`` logits are small, and one full-size head matmul followed by the
#: chunked log-softmax is faster than a projection per chunk; it also keeps the tiny-vocabulary
#: models (the training job's ``TinyCausalLM``, ``V`` of a few dozen) on the logits path, number
#: for number.
FROM_HIDDEN_MIN_VOCAB = 4096

#: The values ``from_hidden=`` accepts.
_FROM_HIDDEN_CHOICES = (True, False, "auto")


def lm_head_parameters(model: nn.Module) -> tuple[Tensor, Tensor | None] | None:
    """``(weight [V, C], bias [V] | None)`` of the LM head a model applies to its hidden states, or ``None``.

    The protocol the hidden-state read-outs rely on (``logits = hidden @ weight^T + bias``):

    - ``model.lm_head_parameters()`` when the model defines that method (a wrapper that
      restricts or transforms its head says so this way; it may return ``None``);
    - else ``(model.lm_head.weight, model.lm_head.bias)`` when ``model.lm_head`` is exactly an
      ``nn.Linear`` (not a subclass, whose forward may differ) without forward hooks;
    - else ``None``: the head is unknown and only the model's own logits can be used. Also
      ``None`` for a head whose weight is a sharded ``DTensor`` (FSDP): it is whole only
      inside the model's forward.

    Example:
        >>> lm = TinyCausalLM(TinyLMConfig.preset("pico", vocab_size=10, block_size=8))
        >>> weight, bias = lm_head_parameters(lm)
        >>> weight.shape, bias, weight is lm.wte.weight          # tied to the embedding
        (torch.Size([10, 16]), None, True)
        >>> handle = lm.lm_head.register_forward_hook(lambda m, i, o: o * 2)
        >>> lm_head_parameters(lm) is None                       # a hook changes what the head computes
        True
    """
    method = getattr(model, "lm_head_parameters", None)
    if callable(method):
        params = method()
    else:
        head = getattr(model, "lm_head", None)
        plain = type(head) is nn.Linear and not has_forward_hooks(head)
        params = (head.weight, head.bias) if plain else None
    return None if params is None or _is_sharded(params[0]) else params


def has_forward_hooks(module: nn.Module) -> bool:
    """Whether ``module`` has forward (pre-)hooks, which may change what it computes."""
    return bool(module._forward_hooks or module._forward_pre_hooks)


def _is_sharded(weight: Tensor) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(weight, DTensor)


def check_from_hidden(from_hidden: object, who: str) -> None:
    """A ``ValueError`` naming ``who`` unless ``from_hidden`` is ``True``, ``False`` or ``"auto"``."""
    if not any(from_hidden is c or (isinstance(from_hidden, str) and from_hidden == c) for c in _FROM_HIDDEN_CHOICES):
        raise ValueError(
            f"{who}: from_hidden={from_hidden!r} must be True (score hidden states through the exposed LM head), "
            f"False (score the model's logits) or 'auto' (hidden states when V >= {FROM_HIDDEN_MIN_VOCAB})"
        )


def use_hidden(from_hidden: bool | str, head: tuple | None, who: str, fix: str) -> bool:
    """Whether the read-out scores hidden states: ``from_hidden`` against the head found (or not)."""
    if from_hidden is True and head is None:
        raise ValueError(
            f"{who}: from_hidden=True but the model exposes no LM head to project hidden states with; {fix}"
        )
    if from_hidden == "auto":
        return head is not None and head[0].shape[0] >= FROM_HIDDEN_MIN_VOCAB
    return from_hidden is True


# --------------------------------------------------------------------------- #
# Response layout [B, R]: the response slice of a [B, P + R] forward
# --------------------------------------------------------------------------- #


def _response_len(input_ids: Tensor, prompt_len: int, what: str, who: str) -> int:
    """``R = T - P`` of ``[B, T]`` token ids, or an error naming the expected shape."""
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2:
        shape = tuple(input_ids.shape) if isinstance(input_ids, Tensor) else type(input_ids).__name__
        raise ValueError(
            f"{who}: input_ids has shape {shape} but [B, P + R] is expected (one row per response): run it on a "
            f"TensorDict with batch_size=[B], the response layout of trajectories_to_llm_batch; for one "
            f"response add the batch dim with td.unsqueeze(0)"
        )
    T = input_ids.shape[1]
    if T - prompt_len < 1:
        raise ValueError(
            f"input_ids has T={T} columns but prompt_len={prompt_len}: there is no response to {what}; "
            f"pass prompt + response ([B, P + R])"
        )
    return T - prompt_len


class ResponseLogProbs(nn.Module):
    """Per-token log-probs (and entropies) of the response tokens, one full forward.

    ``input_ids [B, P + R]`` holds a left-padded prompt of width ``P`` and the
    response; ``logp[b, j] = log_softmax(logits[b, P - 1 + j] / temperature)[input_ids[b, P + j]]``
    (``temperature`` defaults to 1: pass the one the responses were sampled at, see
    :func:`~ppo_objectives.llm.policy.make_actor`; the entropy is that distribution's).
    Outputs ``[B, R]`` float32. With ``entropy_grad=False`` the entropy is computed
    without gradient (a logged diagnostic, no entropy bonus): cheaper backward.

    Two paths, the same numbers (up to float rounding):

    - **logits** (``from_hidden=False``): the model's ``logits`` through
      :func:`read_log_probs`; positions after a response's end are garbage to be
      masked by the caller.
    - **hidden states** (``from_hidden=True``): the model runs with
      ``compute_logits=False`` and its ``hidden`` ``[B, P + R, C]`` are scored through
      the head of :func:`lm_head_parameters` by
      :func:`~ppo_objectives.functional.response_log_probs_from_hidden`, so the
      ``[B, P + R, V]`` logits are never formed. Positions after a response's end
      (``attention_mask[:, P:]`` False) are not projected and are exactly 0. When the
      model has an ``autocast_dtype``, the hidden states are cast to it first, so the
      projection runs in the precision the model's own head runs in under autocast.
    - ``from_hidden="auto"`` (the default): hidden states when the model exposes its
      head and ``V >= FROM_HIDDEN_MIN_VOCAB`` (:data:`FROM_HIDDEN_MIN_VOCAB`), else logits
      (decided at construction; a call that finds the head no longer exposed, e.g.
      sharded, reads the logits).

    Both run the model on the columns up to the last one some row attends
    (:func:`attended_end`), read exactly 0 after it, and run the prompts' common
    prefix once when the model can (:func:`shared_prefix`).

    Example:
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <torch._C.Generator object at ...>
        >>> lm = TinyCausalLM(TinyLMConfig.preset("pico", vocab_size=10, block_size=8))
        >>> ids, am = torch.randint(10, (2, 6)), torch.ones(2, 6, dtype=torch.bool)
        >>> am[1, 5] = False                                  # row 1's response ends one token early
        >>> auto, hid = ResponseLogProbs(lm, 3), ResponseLogProbs(lm, 3, from_hidden=True)
        >>> auto.from_hidden, hid.from_hidden                 # V = 10: "auto" keeps the logits path
        (False, True)
        >>> (lp, _), (lp_h, _) = auto(ids, am), hid(ids, am)
        >>> torch.allclose(lp[am[:, 3:]], lp_h[am[:, 3:]], atol=1e-6), lp_h[1, 2].item()
        (True, 0.0)
    """

    def __init__(
        self,
        model: nn.Module,
        prompt_len: int,
        *,
        return_entropy: bool = True,
        entropy_grad: bool = True,
        from_hidden: bool | str = "auto",
        temperature: float = 1.0,
    ):
        super().__init__()
        _validate.check_int("prompt_len", prompt_len, low=1, what=" (the prompt width P)")
        check_from_hidden(from_hidden, "ResponseLogProbs")
        self.temperature = check_temperature(temperature, "ResponseLogProbs: ")
        self.model = model
        self.prompt_len = prompt_len
        self.return_entropy = return_entropy
        self.entropy_grad = entropy_grad
        fix = "define model.lm_head_parameters() -> (weight, bias), or use from_hidden=False (the logits path)"
        #: Whether this read-out scores hidden states (True) or the model's logits (False).
        self.from_hidden = use_hidden(from_hidden, lm_head_parameters(model), "ResponseLogProbs", fix)
        self._required = from_hidden is True

    def forward(self, input_ids: Tensor, attention_mask: Tensor):
        R = _response_len(input_ids, self.prompt_len, "score", "ResponseLogProbs")
        B = input_ids.shape[0]
        starts = torch.full((B,), self.prompt_len, dtype=torch.long, device=input_ids.device)
        head = lm_head_parameters(self.model) if self.from_hidden else None
        if head is None and self.from_hidden and self._required:
            raise ValueError(
                f"ResponseLogProbs: {type(self.model).__name__} no longer exposes its LM head (lm_head_parameters "
                f"returned None, e.g. a hook was added or the head was sharded); rebuild the read-out with "
                f"from_hidden=False"
            )
        if head is not None:
            out = self._from_hidden(head, input_ids, attention_mask, starts)
        else:
            logits = _trunk(self, input_ids, attention_mask, compute_logits=True).logits  # [B, P + R', V]
            end = logits.shape[1]
            with value_checks(False):  # the positions are in range by construction
                out = read_log_probs(
                    logits, input_ids[:, :end], starts, end - self.prompt_len, return_entropy=self.return_entropy,
                    entropy_grad=self.entropy_grad, temperature=self.temperature,
                )
        if isinstance(out, tuple):
            return tuple(_pad_response(x, R) for x in out)
        return _pad_response(out, R)

    def _from_hidden(self, head: tuple, input_ids: Tensor, attention_mask: Tensor | None, starts: Tensor):
        hidden = _trunk(self, input_ids, attention_mask, compute_logits=False).hidden  # [B, P + R', C]
        end = hidden.shape[1]
        R = end - self.prompt_len
        autocast_dtype = getattr(self.model, "autocast_dtype", None)
        if autocast_dtype is not None and hidden.dtype != autocast_dtype:
            hidden = hidden.to(autocast_dtype)  # the head's precision under the model's autocast
        mask = None
        if attention_mask is not None:  # no projection after a response's end
            mask = _validate.check_mask(attention_mask, input_ids.shape, "input_ids")[:, self.prompt_len : end]
        weight, bias = head
        entropy = self.return_entropy
        with value_checks(False):  # positions and token ids were checked by construction and by the model
            out = response_log_probs_from_hidden(
                hidden, weight, input_ids[:, :end], starts, R, lm_head_bias=bias, mask=mask, return_entropy=entropy,
                temperature=self.temperature,
            )
        if entropy and not self.entropy_grad:
            return out[0], out[1].detach()  # for logging only: no gradient flows through it
        return out


class ResponseValues(nn.Module):
    """Critic: ``values[b, j] = head(hidden[b, P - 1 + j])``, the value of the state
    before response token ``j`` (MiniMind's critic convention), ``[B, R]`` float32; 0 after the
    last column some row attends (:func:`attended_end`: those columns are not run).

    The head is :func:`value_head` with ``init="zeros"``."""

    def __init__(self, model: nn.Module, prompt_len: int):
        super().__init__()
        _validate.check_int("prompt_len", prompt_len, low=1, what=" (the prompt width P)")
        self.model = model
        self.prompt_len = prompt_len
        self.value_head = value_head(model.hidden_size, init="zeros")

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        _response_len(input_ids, self.prompt_len, "value", "ResponseValues")
        R = input_ids.shape[1] - self.prompt_len
        hidden = _trunk(self, input_ids, attention_mask, compute_logits=False).hidden  # [B, P + R', C]
        return _pad_response(read_values(self.value_head, hidden[:, self.prompt_len - 1 : -1]), R)  # [B, R]


class _ResponseReadout(TensorDictModule):
    """A response-layout read-out (:class:`ResponseLogProbs`, :class:`ResponseValues`) as a TensorDict module that
    first checks its ``prompt_len`` against the batch: when the batch carries ``response_ids`` ``[B, R]`` next to
    ``input_ids`` ``[B, S]``, its prompts are ``S - R`` wide, and a read-out built with another width would take
    its ``[B, S - prompt_len]`` outputs from the wrong columns (a shape error further on that never names
    ``prompt_len``). A shape check: nothing is read from the tensors."""

    def __init__(self, module: nn.Module, in_keys: list, out_keys: list, *, prompt_len: int, who: str, fix: str):
        super().__init__(module, in_keys=in_keys, out_keys=out_keys)
        self.prompt_len, self._who, self._fix = prompt_len, who, fix

    def forward(self, *args, **kwargs):
        td = args[0] if args else kwargs.get("tensordict")
        if isinstance(td, TensorDictBase):
            self._check_prompt_len(td)
        return super().forward(*args, **kwargs)

    def _check_prompt_len(self, td: TensorDictBase) -> None:
        ids, response = td.get(self.in_keys[0], None), td.get("response_ids", None)
        if not (isinstance(ids, Tensor) and isinstance(response, Tensor)) or ids.dim() < 2 or response.dim() < 2:
            return
        S, R = ids.shape[-1], response.shape[-1]
        if S - R != self.prompt_len:
            raise ValueError(
                f"{self._who} was built with prompt_len={self.prompt_len}, but this batch's prompts are P={S - R} "
                f"wide (input_ids has S={S} columns and response_ids R={R}: P = S - R), so it would read "
                f"{S - self.prompt_len} response columns instead of {R}; build it with the env's prompt width, "
                f"{self._fix}"
            )


@dataclass
class ActorCritic:
    """The networks of one PPO run (see :func:`make_actor_critic`).

    Attributes:
        policy: env policy (:func:`~ppo_objectives.llm.policy.make_actor`), writes ``action`` / ``sample_log_prob``.
        actor: TensorDictModule ``(input_ids, attention_mask) -> (log_prob, entropy)`` ``[B, R]``.
        critic: TensorDictModule ``(input_ids, attention_mask) -> state_value`` ``[B, R]``.
        actor_model / critic_model: the underlying causal LMs (the same object when shared).
        critic_head: the value head (an ``nn.Linear``, :func:`value_head`).
    """

    policy: ProbabilisticTensorDictSequential
    actor: TensorDictModule
    critic: TensorDictModule
    actor_model: nn.Module
    critic_model: nn.Module
    critic_head: nn.Module

    @property
    def shared_trunk(self) -> bool:
        return self.actor_model is self.critic_model

    def actor_parameters(self):
        """The actor's trainable parameters (frozen ones, e.g. the base weights under LoRA adapters, are left out)."""
        return [p for p in self.actor_model.parameters() if p.requires_grad]

    def critic_parameters(self):
        """The critic's own trainable parameters (just the head when the trunk is shared)."""
        own = list(self.critic_head.parameters())
        trunk = [] if self.shared_trunk else list(self.critic_model.parameters())
        return [p for p in trunk + own if p.requires_grad]


def make_actor_critic(
    model: nn.Module | TinyLMConfig,
    prompt_len: int,
    *,
    shared_trunk: bool = False,
    critic_model: nn.Module | None = None,
    use_kv_cache: bool = True,
    entropy_grad: bool = True,
    from_hidden: bool | str = "auto",
    log_prob_key: str = "log_prob",
    entropy_key: str = "entropy",
    value_key: str = "state_value",
    temperature: float = 1.0,
) -> ActorCritic:
    """Actor and critic built from one causal LM, for the response layout.

    Batch shape: ``actor`` and ``critic`` read ``input_ids`` / ``attention_mask``
    ``[B, P + R]`` and write ``[B, R]`` entries, so they run on a TensorDict with
    ``batch_size=[B]``: the response layout as
    :func:`~ppo_objectives.llm.layouts.trajectories_to_llm_batch` returns it (a
    ``[B, R]`` TensorDict cannot hold the ``[B, P + R]`` inputs).
    :class:`~ppo_objectives.value.gae.MaskedGAE` reads that same ``[B]`` TensorDict
    (its "``[B]`` TensorDict with ``[B, R]`` entries" form), ``R == 1`` included
    (see :mod:`ppo_objectives.llm.layouts`, "Batch shape").

    Args:
        model: a causal LM (:class:`~ppo_objectives.llm.models.TinyCausalLM`,
            :class:`~ppo_objectives.llm.hf.HFCausalLMAdapter`) or a config.
        prompt_len: ``P``, the prompt width of the env (left-padded prompts): ``env.prompt_len``.
            The actor and critic refuse a batch whose ``response_ids`` ``[B, R]`` and
            ``input_ids`` ``[B, S]`` say its prompts are ``S - R != P`` wide.
        shared_trunk: the critic's value head sits on the actor's trunk (one set of
            weights) instead of on its own copy (MiniMind's separate critic, the default).
            The read-outs then share one trunk forward per batch (:class:`SharedForward`),
            and the env policy writes the value of each state it samples from
            (``value_key``, per step), so the rollout's ``V_old`` needs no forward of its own.
        critic_model: an explicit critic trunk (overrides ``shared_trunk``).
        entropy_grad: let gradients flow through the actor's entropy (needed for an
            entropy bonus; ``False`` makes it a cheaper logged diagnostic).
        from_hidden: how the actor scores tokens: ``True`` from the hidden states
            through the exposed LM head (no ``[B, T, V]`` logits), ``False`` from the
            model's logits, ``"auto"`` hidden states when the head is exposed and
            ``V >= FROM_HIDDEN_MIN_VOCAB`` (:class:`ResponseLogProbs`).
        temperature: the sampling temperature, given to both the env policy (which samples
            from ``softmax(logits / temperature)`` and stores those log-probs) and the actor
            read-out (which scores the same distribution), so the PPO ratio is exactly the
            policy change: 1 before the first update at any temperature. Default 1.0.

    **The value head starts at zero.** It is :func:`value_head` with
    ``init="zeros"`` (``w = 0``, ``c = 0``): every value is exactly 0 before the
    first update, so the first advantages are the returns themselves; and since
    the value gradient reaching the trunk is ``w`` times the error, the critic
    trunk (its own copy, or the shared trunk) gets exactly zero value gradient on
    the first update, and only the head moves. From the second update on the
    trunk learns too. The training job (``ppo_objectives/train/``) is built
    on this default. For a critic whose trunk learns from the first step, replace
    the head before building the optimizer, e.g.
    ``ac.critic_head.weight.data.copy_(value_head(H, init="normal").weight)``
    (the head :class:`~ppo_objectives.llm.chat.CausalLMCritic` uses).

    Example:
        >>> ac = make_actor_critic(TinyLMConfig.preset("pico", vocab_size=10, block_size=8), prompt_len=3)
        >>> from tensordict import TensorDict
        >>> td = TensorDict(input_ids=torch.randint(10, (2, 7)), attention_mask=torch.ones(2, 7, dtype=torch.bool),
        ...                 batch_size=[2])
        >>> ac.actor(td)["log_prob"].shape, ac.critic(td)["state_value"].shape
        (torch.Size([2, 4]), torch.Size([2, 4]))
        >>> ac.shared_trunk
        False
    """
    if isinstance(model, TinyLMConfig):
        model = TinyCausalLM(model)
    if critic_model is None:
        critic_model = model if shared_trunk else copy.deepcopy(model)
    temperature = check_temperature(temperature, "make_actor_critic: ")
    log_probs = ResponseLogProbs(model, prompt_len, return_entropy=True, entropy_grad=entropy_grad,
                                 from_hidden=from_hidden, temperature=temperature)
    values = ResponseValues(critic_model, prompt_len)
    shared = critic_model is model
    if shared:  # one trunk forward serves both read-outs of a batch; the env policy writes V_old too
        log_probs.shared_forward = values.shared_forward = SharedForward(model)
    policy = make_actor(model, use_kv_cache=use_kv_cache, value_head=values.value_head if shared else None,
                        value_key=value_key, temperature=temperature)
    fix = "make_actor_critic(model, prompt_len=env.prompt_len)"
    actor = _ResponseReadout(log_probs, ["input_ids", "attention_mask"], [log_prob_key, entropy_key],
                             prompt_len=prompt_len, who="make_actor_critic's actor", fix=fix)
    critic = _ResponseReadout(values, ["input_ids", "attention_mask"], [value_key],
                              prompt_len=prompt_len, who="make_actor_critic's critic", fix=fix)
    return ActorCritic(policy, actor, critic, model, critic_model, values.value_head)


def frozen_reference(actor_model: torch.nn.Module, prompt_len: int, *, dtype: torch.dtype | None = None,
                     copy_model: bool = True, temperature: float = 1.0) -> TensorDictModule:
    """The frozen reference policy of the KL penalty: a copy of the actor's causal LM, in eval mode
    and without gradients, read out as per-token log-probabilities of the response.

    Args:
        actor_model: the actor's causal LM (``ActorCritic.actor_model``), copied as it is now
            (after the warm start): later optimizer steps of the actor do not move the copy.
        prompt_len: ``P``, the prompt width of the env (left-padded prompts): ``env.prompt_len``;
            a batch whose ``response_ids`` ``[B, R]`` say otherwise (``S - R != P``) is refused.
        dtype: convert the reference's weights to it (``torch.bfloat16`` under ``--dtype bfloat16``)
            and run it in it, without autocast; ``None`` keeps the actor's dtype and autocast setting.
        copy_model: ``False`` uses ``actor_model`` itself (a network of its own, e.g. the
            checkpoint loaded again under ``--model``) instead of a ``copy.deepcopy``.
        temperature: score ``log_softmax(logits / temperature)``: the rollout's sampling
            temperature (as TRL does for its reference), so the KL penalty compares the policy
            and the reference at one temperature and is 0 before the first update.

    Returns:
        A ``TensorDictModule`` reading ``input_ids`` and ``attention_mask`` (``[B, P + R]``) and
        writing ``log_prob`` (``[B, R]``): the reference
        :class:`~ppo_objectives.transforms.KLPenaltyTransform` takes. Its copy of the network is
        ``ref.module.model``.

    Example:
        >>> from tensordict import TensorDict
        >>> lm = TinyCausalLM(TinyLMConfig.preset("pico", vocab_size=10, block_size=8))
        >>> ref = frozen_reference(lm, prompt_len=3)
        >>> td = TensorDict(input_ids=torch.randint(10, (2, 7)), attention_mask=torch.ones(2, 7, dtype=torch.bool),
        ...                 batch_size=[2])
        >>> ref(td)["log_prob"].shape
        torch.Size([2, 4])
        >>> ref.module.model is lm, any(p.requires_grad for p in ref.parameters())
        (False, False)
    """
    if isinstance(actor_model, TensorDictModuleBase) or not isinstance(actor_model, torch.nn.Module):
        raise TypeError(
            f"frozen_reference: actor_model must be the causal LM (ActorCritic.actor_model, e.g. a TinyCausalLM or "
            f"an HFCausalLMAdapter), got {type(actor_model).__name__}; pass ac.actor_model, not the TensorDict "
            f"read-out ac.actor"
        )
    temperature = check_temperature(temperature, "frozen_reference: ")
    ref = (copy.deepcopy(actor_model) if copy_model else actor_model).eval().requires_grad_(False)
    if dtype is not None:
        ref = ref.to(dtype)
        ref.autocast_dtype = None  # its weights are in dtype already
    return _ResponseReadout(
        ResponseLogProbs(ref, prompt_len, return_entropy=False, temperature=temperature),
        ["input_ids", "attention_mask"], ["log_prob"], prompt_len=prompt_len, who="frozen_reference",
        fix="frozen_reference(actor_model, prompt_len=env.prompt_len)",
    )

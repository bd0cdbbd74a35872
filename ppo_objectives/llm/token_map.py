"""A causal LM behind the task's tokens: :class:`TokenMappedLM`.

An env (:class:`~ppo_objectives.llm.env.TokenLMEnv`) works in its task's token ids
(``V_task`` of them), a pretrained model in its own vocabulary of ``V`` tokens.
Given ``token_ids [V_task]``, the model id of each task token (the training job's
:func:`~ppo_objectives.train.pretrained.task_token_ids` takes them from the
checkpoint's tokenizer), :class:`TokenMappedLM` puts the model behind our LM
interface in the task's ids: input ids are mapped task -> model, the model runs
without its LM head, and the logits are the head's rows of the task's tokens only,

    ``logits[b, t, i] = hidden[b, t] . W[token_ids[i]] (+ bias[token_ids[i]])``,

so **the policy is the model's next-token distribution renormalised over the
task's tokens** (``softmax`` over ``V_task`` columns instead of ``V``): the
policy cannot sample a token the env does not know, and the KL to the
reference, the entropy and the PPO ratio are all over that distribution.

Shape letters: ``B`` rows; ``T`` tokens per call; ``C`` hidden size; ``V`` the
model's vocabulary; ``V_task`` the task's vocabulary (the policy's actions).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ppo_objectives import _validate
from ppo_objectives.llm.models import LMOutput

__all__ = ["TokenMappedLM"]


class TokenMappedLM(nn.Module):
    """A causal LM of vocabulary ``V`` behind our LM interface in the task's ``V_task`` token ids.

    ``forward(input_ids [B, T] task ids, attention_mask [B, T] | None, *, position_ids=None,
    cache=None, cache_slots=None, compute_logits=True, shared_prefix=0) -> LMOutput(logits [B, T, V_task]
    float32 | None, hidden [B, T, C])``: the ids are mapped to the model's
    (``token_ids[input_ids]``), the model runs with ``compute_logits=False``, and the
    logits are ``hidden @ W[token_ids].T (+ b[token_ids])`` for the model's LM-head
    weight ``W [V, C]`` (and bias): the model's distribution renormalised over the
    task's tokens (module docstring). The head is computed in float32, outside any
    autocast, from the hidden states as the model returns them (``V_task`` is small).

    It exposes what the package's read-outs and env policy use: ``vocab_size``
    (``V_task``), ``hidden_size``, ``lm_head`` (a callable on hidden states ``[..., C]
    -> [..., V_task]`` float32, not a registered module: the head weight is in the
    state dict once, under ``model.``), :meth:`lm_head_parameters`, and, passed through
    to the inner model, ``supports_kv_cache``, :meth:`new_cache`, ``cache`` /
    ``cache_slots`` / ``position_ids`` and ``autocast_dtype`` (so rollouts use the
    inner model's KV cache when it has one). ``token_ids`` is a non-persistent
    buffer: the state dict is the inner model's, under ``model.``.

    Args:
        model: a causal LM with our interface (:class:`~ppo_objectives.llm.hf.HFCausalLMAdapter`,
            :class:`~ppo_objectives.llm.models.TinyCausalLM`) and an ``lm_head`` with a ``weight [V, C]``.
        token_ids: ``[V_task]`` int64, the model id of each task token (:func:`~ppo_objectives.train.pretrained.task_token_ids`).

    Example:
        >>> from ppo_objectives.llm.models import TinyCausalLM, TinyLMConfig
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <torch._C.Generator object at ...>
        >>> inner = TinyCausalLM(TinyLMConfig.preset("pico", vocab_size=10, block_size=8))
        >>> lm = TokenMappedLM(inner, torch.tensor([4, 2, 7]))   # task token i is model token [4, 2, 7][i]
        >>> x = torch.tensor([[0, 1, 2, 1]])
        >>> full = inner(torch.tensor([[4, 2, 7, 2]])).logits   # [1, 4, 10]
        >>> torch.allclose(lm(x).logits, full[..., [4, 2, 7]], atol=1e-6)
        True
        >>> sorted(lm.state_dict()) == sorted("model." + k for k in inner.state_dict())
        True
    """

    def __init__(self, model: nn.Module, token_ids: Tensor):
        super().__init__()
        if not isinstance(model, nn.Module) or not hasattr(model, "lm_head") or not hasattr(model, "vocab_size"):
            raise TypeError(
                f"TokenMappedLM: model must be a causal LM with our interface (vocab_size, hidden_size, lm_head; "
                f"e.g. HFCausalLMAdapter), got {type(model).__name__}"
            )
        token_ids = _validate.check_token_ids(token_ids, model.vocab_size, "TokenMappedLM")
        self.model = model
        self.register_buffer("token_ids", token_ids.clone(), persistent=False)

    @property
    def vocab_size(self) -> int:
        """``V_task``: the policy's actions."""
        return self.token_ids.numel()

    @property
    def hidden_size(self) -> int:
        return self.model.hidden_size

    @property
    def supports_kv_cache(self) -> bool:
        return bool(getattr(self.model, "supports_kv_cache", False))

    @property
    def autocast_dtype(self):
        return getattr(self.model, "autocast_dtype", None)

    @autocast_dtype.setter
    def autocast_dtype(self, dtype) -> None:
        self.model.autocast_dtype = dtype

    def new_cache(self, batch_size: int, max_len: int, **kwargs):
        """The inner model's KV cache (``model.new_cache``), for ``supports_kv_cache`` models."""
        if not self.supports_kv_cache:
            raise ValueError(
                f"TokenMappedLM: the inner {type(self.model).__name__} has no KV cache (supports_kv_cache is "
                f"False); run full forwards (NextTokenLogits does so for such models)"
            )
        return self.model.new_cache(batch_size, max_len, **kwargs)

    def lm_head_parameters(self) -> tuple[Tensor, Tensor | None]:
        """``(W[token_ids] [V_task, C], b[token_ids] [V_task] | None)``: the LM-head rows of the task's tokens
        (differentiable: gradients reach those rows of the inner head)."""
        head = self.model.lm_head
        if hasattr(self.model, "lm_head_parameters"):
            weight, bias = self.model.lm_head_parameters()
        else:
            weight, bias = head.weight, getattr(head, "bias", None)
        return weight[self.token_ids], None if bias is None else bias[self.token_ids]

    def task_logits(self, hidden: Tensor) -> Tensor:
        """Logits ``[..., V_task]`` float32 of hidden states ``[..., C]`` (the restricted LM head)."""
        weight, bias = self.lm_head_parameters()
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            return F.linear(hidden.float(), weight.float(), None if bias is None else bias.float())

    @property
    def lm_head(self):
        """The restricted LM head, :meth:`task_logits` (a callable, not a submodule)."""
        return self.task_logits

    @property
    def supports_shared_prefix(self) -> bool:
        """The wrapped model's (``forward(shared_prefix=k)`` passes through)."""
        return bool(getattr(self.model, "supports_shared_prefix", False))

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, *, position_ids: Tensor | None = None,
                cache=None, cache_slots=None, compute_logits: bool = True, shared_prefix: int = 0) -> LMOutput:
        self._check_ids(input_ids)
        kwargs = {} if cache is None else dict(cache=cache, cache_slots=cache_slots)
        if shared_prefix:
            kwargs["shared_prefix"] = shared_prefix
        out = self.model(self.token_ids[input_ids], attention_mask, position_ids=position_ids, compute_logits=False,
                         **kwargs)
        return LMOutput(self.task_logits(out.hidden) if compute_logits else None, out.hidden)

    def _check_ids(self, input_ids: object) -> None:
        input_ids = _validate.check_tensor("input_ids", input_ids)
        if input_ids.is_floating_point() or input_ids.dtype == torch.bool:
            raise TypeError(f"TokenMappedLM: input_ids must hold integer task token ids, got dtype {input_ids.dtype}")
        if _validate.checking_values() and input_ids.numel():  # one host read
            lo, hi = torch.stack([input_ids.min(), input_ids.max()]).tolist()
            if lo < 0 or hi >= self.vocab_size:
                raise ValueError(
                    f"TokenMappedLM: input_ids holds task token id {lo if lo < 0 else hi}, outside the task's "
                    f"vocabulary [0, {self.vocab_size}): input_ids are task ids (the env's), mapped to the model's "
                    f"here; do not map them before"
                )

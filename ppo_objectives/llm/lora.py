"""LoRA adapters on a Hugging Face causal LM (``peft``), and the frozen reference they give for free.

:func:`add_lora` puts rank-``r`` adapters on the attention and MLP projections of an
:class:`~ppo_objectives.llm.hf.HFCausalLMAdapter` and freezes every other weight: the actor trains
the adapters only (and a critic on its trunk, its value head). Because the base weights never move,
the pretrained model *is* the actor with its adapters switched off: :class:`AdaptersOff` is that
model, read through the actor's own modules, so a KL reference costs no second copy of the weights.
:func:`merged_hf_model` folds the adapters into the weights for export, a plain Hugging Face model
that needs no ``peft`` to load.

``peft`` is in the ``lora`` extra (``pip install -e ".[lora]"``).
"""

from __future__ import annotations

import copy
import warnings

import torch
from torch import nn

from ppo_objectives import _validate
from ppo_objectives.llm.hf import HFCausalLMAdapter

__all__ = ["LORA_TARGETS", "AdaptersOff", "add_lora", "has_lora", "merged_hf_model"]

#: The projections that get adapters: attention and MLP of Llama-style decoders (SmolLM2, Qwen2, Llama).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _peft():
    try:
        import peft
    except ImportError as e:
        raise ImportError(f'LoRA needs peft ({e}); install it with: pip install -e ".[lora]"') from None
    return peft


def add_lora(lm: HFCausalLMAdapter, rank: int, *, alpha: float | None = None,
             targets: tuple[str, ...] = LORA_TARGETS) -> HFCausalLMAdapter:
    """Put LoRA adapters of rank ``rank`` on ``lm``'s projections named in ``targets``, in place; returns ``lm``.

    The adapters start at zero (``lm`` computes what it computed before), their scale is
    ``alpha / rank`` (``alpha`` defaults to ``2 * rank``), they have no dropout, and every other
    parameter of ``lm`` stops requiring gradients.

    Raises:
        TypeError: ``lm`` is not an ``HFCausalLMAdapter`` (LoRA here is ``peft``'s, on Hugging Face models).
        ValueError: ``rank`` is not an int >= 1, or no module of ``lm`` is named in ``targets``.
        ImportError: ``peft`` is not installed.
    """
    if not isinstance(lm, HFCausalLMAdapter):
        raise TypeError(f"add_lora: lm must be an HFCausalLMAdapter (a Hugging Face causal LM), got "
                        f"{type(lm).__name__}")
    _validate.check_int("rank", rank, low=1, where="add_lora ")
    if has_lora(lm):
        raise ValueError("add_lora: lm has LoRA adapters already; add them once")
    names = {name.rsplit(".", 1)[-1] for name, _ in lm.hf_model.named_modules()}
    if not names & set(targets):
        raise ValueError(f"add_lora: no module of {type(lm.hf_model).__name__} is named one of targets={targets}; "
                         f"give the names of its projections")
    peft = _peft()
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank if alpha is None else alpha, lora_dropout=0.0,
                             target_modules=list(targets))
    with warnings.catch_warnings():  # peft asks transformers 5 for a property it has renamed; nothing for the user
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        lm.hf_model = peft.get_peft_model(lm.hf_model, config)
    return lm


def has_lora(lm: nn.Module) -> bool:
    """Whether ``lm`` (an ``HFCausalLMAdapter``) carries ``peft`` adapters (:func:`add_lora`)."""
    return hasattr(getattr(lm, "hf_model", None), "disable_adapter")


class AdaptersOff(nn.Module):
    """The base model under a LoRA actor: ``lm``'s forward with its adapters disabled, in eval mode.

    It holds no parameter of its own (``lm`` is not a submodule), so it adds no weights to a
    checkpoint and nothing to an optimizer, and it follows ``lm``: the same device and autocast.
    Every other attribute (``vocab_size``, ``lm_head``, ...) is ``lm``'s. Give it to
    :func:`~ppo_objectives.llm.readouts.frozen_reference` with ``copy_model=False``.

    Example:
        >>> from transformers import LlamaConfig
        >>> lm = add_lora(HFCausalLMAdapter.from_config(LlamaConfig(
        ...     vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        ...     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8)), rank=2)
        >>> ref = AdaptersOff(lm)
        >>> list(ref.parameters()), ref.vocab_size
        ([], 16)
        >>> sorted({n.split(".")[-3] for n, p in lm.named_parameters() if p.requires_grad})
        ['lora_A', 'lora_B']
    """

    def __init__(self, lm: HFCausalLMAdapter):
        super().__init__()
        if not has_lora(lm):
            raise ValueError("AdaptersOff: lm has no LoRA adapters (add_lora); a reference for a model without "
                             "them is a frozen copy (frozen_reference(lm, P))")
        self._lm = (lm,)  # a tuple: not registered, so lm's parameters are not this module's

    def forward(self, *args, **kwargs):
        lm = self._lm[0]
        training = lm.training
        lm.eval()
        try:
            with torch.no_grad(), lm.hf_model.disable_adapter():
                return lm(*args, **kwargs)
        finally:
            lm.train(training)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if "_lm" not in self.__dict__:  # not built yet (copy, unpickling): nothing to forward to
                raise
            return getattr(self.__dict__["_lm"][0], name)


def merged_hf_model(lm: HFCausalLMAdapter) -> nn.Module:
    """A plain Hugging Face model with ``lm``'s adapters merged into its weights (a copy; ``lm`` is unchanged);
    ``lm.hf_model`` itself when it has no adapters."""
    if not has_lora(lm):
        return lm.hf_model
    return copy.deepcopy(lm.hf_model).merge_and_unload()

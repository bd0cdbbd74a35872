"""What of a critic's own trunk trains: all of it, all but its attention, or its top decoder layers.

A critic with its own copy of the language model (``make_actor_critic(shared_trunk=False)``, the job's
``--no-shared-trunk``) starts from the actor's weights. Training all of it is the classic PPO critic;
SAO freezes the critic's attention and trains the rest, and a critic that trains only its top layers
keeps most of the pretrained trunk as a fixed feature extractor at a fraction of the backward's
cost. :func:`freeze_critic_trunk` sets ``requires_grad`` accordingly;
:meth:`~ppo_objectives.llm.readouts.ActorCritic.critic_parameters` then hands only the trained
parameters to the critic's optimizer.

``spec`` (the job's ``--critic-train``):

- ``"all"``: every parameter trains (nothing changes);
- ``"no-attention"``: the attention modules of every decoder layer are frozen (a submodule named
  ``attn`` / ``self_attn``, or whose class name ends in ``Attention``);
- ``"top:N"``: only the top ``N`` decoder layers and the normalisation layers outside the decoder
  layers (the final norm) train; the embeddings and the other layers are frozen.

The decoder layers are the model's largest ``nn.ModuleList`` (``TinyCausalLM.blocks``, a Hugging Face
model's ``model.layers``).

Example:
    >>> import torch
    >>> from ppo_objectives.llm.models import TinyCausalLM, TinyLMConfig
    >>> lm = TinyCausalLM(TinyLMConfig.preset("nano", vocab_size=16, block_size=8))  # two decoder layers
    >>> trained = freeze_critic_trunk(lm, "top:1")
    >>> sorted({n.split(".")[0] + "." + n.split(".")[1] for n, p in lm.named_parameters() if p.requires_grad})
    ['blocks.1', 'ln_f.bias', 'ln_f.weight']
"""

from __future__ import annotations

from torch import nn

__all__ = ["CRITIC_TRAIN_SPECS", "decoder_layers", "freeze_critic_trunk", "parse_critic_train"]

#: The forms ``spec`` takes (``N`` a whole number >= 1).
CRITIC_TRAIN_SPECS = ("all", "no-attention", "top:N")


def parse_critic_train(spec: object) -> tuple[str, int]:
    """``(kind, N)`` of a ``--critic-train`` spec: ``("all", 0)``, ``("no-attention", 0)`` or ``("top", N)``."""
    if spec in ("all", "no-attention"):
        return str(spec), 0
    if isinstance(spec, str) and spec.startswith("top:") and spec[4:].isdigit() and int(spec[4:]) >= 1:
        return "top", int(spec[4:])
    raise ValueError(f"--critic-train {spec!r} is not one of {', '.join(CRITIC_TRAIN_SPECS)} (N a whole number "
                     f">= 1: the top N decoder layers train), e.g. --critic-train top:4")


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's decoder layers: its ``nn.ModuleList`` holding the most parameters."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        raise ValueError(f"{type(model).__name__} has no nn.ModuleList of decoder layers, so --critic-train cannot "
                         f"pick its layers; use --critic-train all")
    return max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))


def _is_attention(name: str, module: nn.Module) -> bool:
    return name.rsplit(".", 1)[-1] in ("attn", "self_attn") or type(module).__name__.endswith("Attention")


def freeze_critic_trunk(model: nn.Module, spec: str) -> int:
    """Freeze what ``spec`` leaves untrained (see the module docstring); returns the count of parameters
    (elements) that still train."""
    kind, n = parse_critic_train(spec)
    layers = decoder_layers(model) if kind != "all" else None
    if kind == "top":
        if n > len(layers):
            raise ValueError(f"--critic-train top:{n}: the model has {len(layers)} decoder layers; give N <= "
                             f"{len(layers)} (top:{len(layers)} trains them all but not the embeddings)")
        in_layers = {id(p) for p in layers.parameters()}
        train = {id(p) for layer in layers[len(layers) - n:] for p in layer.parameters()}
        train |= {id(p) for m in model.modules() if "Norm" in type(m).__name__
                  for p in m.parameters(recurse=False) if id(p) not in in_layers}  # fmt: skip
        for p in model.parameters():
            p.requires_grad_(id(p) in train)
    elif kind == "no-attention":
        frozen = [m for layer in layers for name, m in layer.named_modules() if name and _is_attention(name, m)]
        if not frozen:
            raise ValueError(f"--critic-train no-attention: no attention module found in the decoder layers of "
                             f"{type(model).__name__} (a submodule named attn / self_attn or a class ending in "
                             f"Attention); use --critic-train top:N or all")
        for m in frozen:
            m.requires_grad_(False)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)

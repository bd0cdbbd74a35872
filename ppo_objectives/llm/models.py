"""The tiny causal LM: a KV cache, named presets, and the interface every policy model keeps.

``TinyCausalLM`` is a nanoGPT-style decoder (learned absolute positions,
pre-LayerNorm blocks, tied embeddings) in one file, sized by a
:class:`TinyLMConfig` with named tiny presets (:data:`PRESETS`).
The interface, ``forward(input_ids, attention_mask, ..., cache=, cache_slots=) ->
LMOutput(logits, hidden)`` plus ``hidden_size``, ``vocab_size``, ``lm_head``
and ``new_cache``, is what :class:`~ppo_objectives.llm.hf.HFCausalLMAdapter`
puts a Hugging Face causal LM behind. Both keep the same per-row
:class:`KVCache`, and both run in mixed precision when ``autocast_dtype`` is set
(float32 logits). What is built on these models lives one layer up:
:mod:`ppo_objectives.llm.policy` (the env policy, ``sample_with_kv_cache``) and
:mod:`ppo_objectives.llm.readouts` (the PPO read-outs).

Shape letters:

- ``B``: batch rows; ``T``: tokens fed to one forward call; ``S``: the
  KV-cache length (an env's token buffer).
- ``V``: vocabulary size; ``C``: embedding width; ``L``: layers;
  ``H``: heads; ``D = C / H``: head width; ``H_kv``: key/value heads of a
  Hugging Face model (``H_kv < H`` under grouped-query attention).

Example:
    >>> import torch
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <torch._C.Generator object at ...>
    >>> cfg = TinyLMConfig.preset("pico", vocab_size=16, block_size=12)
    >>> lm = TinyCausalLM(cfg)
    >>> ids = torch.tensor([[0, 0, 3, 4], [5, 6, 7, 8]])       # row 0 is left-padded
    >>> mask = ids != 0
    >>> lm(ids, mask).logits.shape
    torch.Size([2, 4, 16])
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import asdict, dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ppo_objectives import _validate

__all__ = ["PRESETS", "KVCache", "LMOutput", "TinyCausalLM", "TinyLMConfig", "position_ids_from_mask"]


# --------------------------------------------------------------------------- #
# Config and presets
# --------------------------------------------------------------------------- #

#: Named tiny sizes (layers, heads, width), in the spirit of minGPT's ``gpt-nano``.
PRESETS: dict[str, dict[str, int]] = {
    "pico": dict(n_layer=1, n_head=2, n_embd=16),  # ~5k params: tests
    "nano": dict(n_layer=2, n_head=4, n_embd=64),  # ~0.1M params: the main job
    "micro": dict(n_layer=4, n_head=4, n_embd=128),  # ~0.8M params: benchmarks
}


@dataclass(frozen=True)
class TinyLMConfig:
    """Size of a :class:`TinyCausalLM`.

    Attributes:
        vocab_size: ``V``.
        block_size: number of learned positions (longest sequence, ``>= S``).
        n_layer / n_head / n_embd: ``L`` / ``H`` / ``C`` (``C % H == 0``).
        dropout: dropout probability (0 keeps rollouts and log-probs equal).
        bias: biases in Linear and LayerNorm layers.
        tie_weights: share the token embedding with the LM head (nanoGPT).

    Example:
        >>> TinyLMConfig.preset("nano", vocab_size=16, block_size=16).n_embd
        64
    """

    vocab_size: int = 16
    block_size: int = 32
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0
    bias: bool = True
    tie_weights: bool = True

    def __post_init__(self):
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TinyLMConfig.{name}={value!r} must be a positive int")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"TinyLMConfig.n_embd={self.n_embd} is not divisible by n_head={self.n_head}: "
                f"each head needs n_embd / n_head channels; pick n_head among the divisors of n_embd"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"TinyLMConfig.dropout={self.dropout} must be in [0, 1)")

    @classmethod
    def preset(cls, name: str, **overrides) -> "TinyLMConfig":
        """The config of a named preset (:data:`PRESETS`), with fields overridden."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})

    def to_dict(self) -> dict:
        return asdict(self)


# --------------------------------------------------------------------------- #
# The model
# --------------------------------------------------------------------------- #


class LMOutput(NamedTuple):
    """What a causal-LM forward returns: ``logits`` ``[B, T, V]`` (float32, or
    ``None`` when not asked for) and the final ``hidden`` states ``[B, T, C]``."""

    logits: Tensor | None
    hidden: Tensor


@dataclass
class KVCache:
    """Keys and values of every layer, one slot per buffer column.

    Attributes:
        k, v: ``[L, B, H, S, D]``.
        valid: ``[B, S]`` bool, True where the slot holds a real (non-pad) token
            that later tokens may attend to.
    """

    k: Tensor
    v: Tensor
    valid: Tensor

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[3]


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Positions counted over real tokens only, so left padding does not shift them.

    ``pos[b, t] = (number of True in attention_mask[b, :t+1]) - 1``, clamped at 0.

    Args:
        attention_mask: ``[B, T]`` bool or {0, 1}, True = real token.

    Returns:
        ``[B, T]`` int64.

    Example:
        >>> position_ids_from_mask(torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]]))
        tensor([[0, 0, 0, 1],
                [0, 1, 2, 3]])
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


#: The dtypes ``autocast_dtype`` accepts (besides ``None``, full precision).
_AUTOCAST_DTYPES = (torch.bfloat16, torch.float16)


def check_autocast_dtype(dtype, who: str) -> None:
    if dtype is not None and dtype not in _AUTOCAST_DTYPES:
        raise ValueError(
            f"{who}.autocast_dtype={dtype!r} is not supported: use torch.bfloat16 or torch.float16 for a "
            f"mixed-precision forward, or None for the parameters' own precision"
        )


def autocast_context(dtype, device: torch.device):
    """``torch.autocast`` on ``device``'s type in ``dtype``, or a no-op context for ``None``."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


class _SelfAttention(nn.Module):
    def __init__(self, cfg: TinyLMConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = cfg.dropout

    def forward(self, x: Tensor, allowed: Tensor, kv: tuple[Tensor, Tensor] | None, slots) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=-1)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # [B, H, T, D]
        if kv is not None:  # write this call's keys/values into their slots, attend over all S slots
            k_all, v_all = kv  # [B, H, S, D]
            if isinstance(slots, int):
                k_all[:, :, slots : slots + T] = k
                v_all[:, :, slots : slots + T] = v
            else:  # [B, T] slot per token
                index = slots[:, None, :, None].expand(B, self.n_head, T, C // self.n_head)
                k_all.scatter_(2, index, k)
                v_all.scatter_(2, index, v)
            k, v = k_all, v_all
        drop = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=drop)  # [B, H, T, D]
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class _Block(nn.Module):
    def __init__(self, cfg: TinyLMConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = _SelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias),
            nn.GELU(),
            nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias),
            nn.Dropout(cfg.dropout),
        )

    def forward(self, x, allowed, kv, slots):
        x = x + self.attn(self.ln_1(x), allowed, kv, slots)
        return x + self.mlp(self.ln_2(x))


class TinyCausalLM(nn.Module):
    """nanoGPT-style decoder-only LM with left-padding-aware positions and a KV cache.

    ``forward(input_ids, attention_mask)`` is the ordinary full causal forward.
    With ``cache=`` (from :meth:`new_cache`) the tokens are written into the
    cache slots ``cache_slots`` (an int start column, or a ``[B, T]`` tensor of
    columns) and attend to every valid slot at or before their own, so feeding
    a sequence in pieces gives the full forward's logits.

    A query never attends to padding, except to itself: a pad query (left
    padding) then sees one finite value instead of an empty softmax, so no NaN
    appears anywhere; pad outputs are garbage nobody reads.

    **Mixed precision.** ``autocast_dtype`` (``torch.bfloat16`` /
    ``torch.float16``; a constructor keyword and a plain attribute that may be
    set later, e.g. on a ``copy.deepcopy``) runs the forward under
    ``torch.autocast(device_type=<parameter device type>, dtype=autocast_dtype)``:
    the parameters stay in their dtype, the logits are still returned in
    float32, the hidden states in the dtype autocast produced, and
    :meth:`new_cache` allocates in ``autocast_dtype``. ``None`` (the default)
    runs the plain forward, bit for bit.

    Example:
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <torch._C.Generator object at ...>
        >>> lm = TinyCausalLM(TinyLMConfig.preset("pico", vocab_size=10, block_size=8)).eval()
        >>> ids = torch.tensor([[1, 2, 3, 4, 5]])
        >>> full = lm(ids).logits                                   # [1, 5, 10]
        >>> cache = lm.new_cache(batch_size=1, max_len=8)
        >>> with torch.no_grad():
        ...     a = lm(ids[:, :3], cache=cache, cache_slots=0).logits   # prefill 3 columns
        ...     b = lm(ids[:, 3:], cache=cache, cache_slots=3,
        ...            position_ids=torch.tensor([[3, 4]])).logits     # then 2 more
        >>> torch.allclose(torch.cat([a, b], 1), full, atol=1e-5)
        True
    """

    supports_kv_cache = True

    def __init__(self, config: TinyLMConfig, *, autocast_dtype: torch.dtype | None = None):
        super().__init__()
        if not isinstance(config, TinyLMConfig):
            raise TypeError(f"config must be a TinyLMConfig, got {type(config).__name__}")
        check_autocast_dtype(autocast_dtype, "TinyCausalLM")
        self.config = config
        self.autocast_dtype = autocast_dtype
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(_Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_weights:
            self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2 scaled init of residual projections
            if name.endswith("attn.proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    @property
    def hidden_size(self) -> int:
        return self.config.n_embd

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def _check_inputs(self, input_ids, attention_mask) -> None:
        """Shape, dtype and device checks always; token-id and mask values (a host sync) unless
        :func:`~ppo_objectives.functional.value_checks` is off (the env policy turns them off)."""
        if not isinstance(input_ids, Tensor):
            raise TypeError(f"input_ids must be a tensor, got {type(input_ids).__name__}")
        if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
            raise TypeError(f"input_ids must be an integer tensor of token ids, got dtype {input_ids.dtype}; use .long()")
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}; add a batch dim with [None]")
        param_device = self.wte.weight.device
        if input_ids.device != param_device:
            raise ValueError(
                f"input_ids is on {input_ids.device} but the model is on {param_device}; move one of them "
                f"(input_ids.to({str(param_device)!r}))"
            )
        if attention_mask is not None:
            if attention_mask.shape != input_ids.shape:
                raise ValueError(
                    f"attention_mask has shape {tuple(attention_mask.shape)} but input_ids has shape "
                    f"{tuple(input_ids.shape)}: one flag per token is needed (no broadcasting)"
                )
            if attention_mask.device != input_ids.device:
                raise ValueError(f"attention_mask is on {attention_mask.device} but input_ids on {input_ids.device}")
            if attention_mask.dtype != torch.bool:
                _validate.check_mask(attention_mask, input_ids.shape, "input_ids")  # {0, 1} values
        if _validate.checking_values() and input_ids.numel():
            lo, hi = torch.stack([input_ids.min(), input_ids.max()]).tolist()
            if lo < 0 or hi >= self.config.vocab_size:
                bad = lo if lo < 0 else hi
                raise ValueError(
                    f"input_ids holds token id {bad}, outside [0, vocab_size={self.config.vocab_size}): the embedding "
                    f"cannot look it up; check the tokenizer / env vocabulary against the model config"
                )

    def _compute_dtype(self) -> torch.dtype:
        """The dtype the forward computes keys / values in: ``autocast_dtype``, else the parameters'."""
        check_autocast_dtype(self.autocast_dtype, "TinyCausalLM")
        return self.wte.weight.dtype if self.autocast_dtype is None else self.autocast_dtype

    def new_cache(self, batch_size: int, max_len: int, *, device=None, dtype=None) -> KVCache:
        """An empty cache for ``batch_size`` rows of up to ``max_len`` columns.

        ``dtype`` defaults to the dtype the forward computes keys / values in
        (``autocast_dtype`` when set, else the parameters' dtype); the forward
        refuses a cache of another dtype.
        """
        if max_len > self.config.block_size:
            raise ValueError(
                f"max_len={max_len} exceeds block_size={self.config.block_size}: the model has no "
                f"position embedding beyond it; build the model with block_size >= {max_len}"
            )
        p = self.wte.weight
        c = self.config
        shape = (c.n_layer, batch_size, c.n_head, max_len, c.n_embd // c.n_head)
        device = p.device if device is None else device
        dtype = self._compute_dtype() if dtype is None else dtype
        return KVCache(
            k=torch.zeros(shape, device=device, dtype=dtype),
            v=torch.zeros(shape, device=device, dtype=dtype),
            valid=torch.zeros(batch_size, max_len, dtype=torch.bool, device=device),
        )

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        *,
        position_ids: Tensor | None = None,
        cache: KVCache | None = None,
        cache_slots: int | Tensor | None = None,
        compute_logits: bool = True,
    ) -> LMOutput:
        """Logits ``[B, T, V]`` (float32) and hidden states ``[B, T, C]``.

        Args:
            input_ids: ``[B, T]`` int64 token ids.
            attention_mask: ``[B, T]`` bool / {0, 1}, True = real token; ``None`` = all real.
            position_ids: ``[B, T]``; default :func:`position_ids_from_mask` (no cache)
                or ``cache_slots + arange(T)`` (with a cache, no padding assumed).
            cache: a :class:`KVCache`, updated in place (inference only).
            cache_slots: the columns these tokens occupy in the cache: an int start or ``[B, T]``.
            compute_logits: skip the LM head (a prefill only needs the cache).

        Under ``autocast_dtype`` the same forward runs inside ``torch.autocast``
        (class docstring); the logits are float32 either way.
        """
        self._check_inputs(input_ids, attention_mask)
        if cache is not None and cache.k.dtype != self._compute_dtype():
            raise ValueError(
                f"cache holds {cache.k.dtype} keys/values but this forward computes them in "
                f"{self._compute_dtype()} (autocast_dtype={self.autocast_dtype}): they cannot be written into it; "
                f"build the cache with new_cache() and no dtype, after setting autocast_dtype"
            )
        if self.autocast_dtype is None:
            return self._forward(input_ids, attention_mask, position_ids, cache, cache_slots, compute_logits)
        with autocast_context(self.autocast_dtype, self.wte.weight.device):
            return self._forward(input_ids, attention_mask, position_ids, cache, cache_slots, compute_logits)

    def _forward(self, input_ids, attention_mask, position_ids, cache, cache_slots, compute_logits) -> LMOutput:
        B, T = input_ids.shape
        device = input_ids.device
        if attention_mask is None:
            attention_mask = torch.ones(B, T, dtype=torch.bool, device=device)
        attention_mask = attention_mask.bool()
        if cache is None:
            if T > self.config.block_size:
                raise ValueError(f"input_ids has T={T} > block_size={self.config.block_size}")
            if position_ids is None:
                position_ids = position_ids_from_mask(attention_mask)
            t = torch.arange(T, device=device)
            causal = t[None, :] <= t[:, None]  # [T, T] key <= query
            allowed = (causal[None] & attention_mask[:, None, :]) | torch.eye(T, dtype=torch.bool, device=device)
            kvs = [None] * len(self.blocks)
        else:
            if cache.batch_size != B:
                raise ValueError(f"cache holds {cache.batch_size} rows but input_ids has B={B}")
            if cache_slots is None:
                raise ValueError("cache_slots is required with a cache: the columns these tokens occupy")
            if isinstance(cache_slots, int):
                q_slots = (cache_slots + torch.arange(T, device=device)).expand(B, T)
                cache.valid[:, cache_slots : cache_slots + T] = attention_mask
            else:
                q_slots = cache_slots
                cache.valid.scatter_(1, q_slots, attention_mask)
            if position_ids is None:
                position_ids = q_slots
            k_idx = torch.arange(cache.max_len, device=device)
            allowed = ((k_idx <= q_slots[..., None]) & cache.valid[:, None, :]) | (k_idx == q_slots[..., None])
            kvs = [(cache.k[i], cache.v[i]) for i in range(len(self.blocks))]
        allowed = allowed[:, None]  # [B, 1, T, S] broadcast over heads
        x = self.drop(self.wte(input_ids) + self.wpe(position_ids))  # [B, T, C]
        for block, kv in zip(self.blocks, kvs):
            x = block(x, allowed, kv, cache_slots)
        x = self.ln_f(x)
        logits = self.lm_head(x).float() if compute_logits else None
        return LMOutput(logits, x)

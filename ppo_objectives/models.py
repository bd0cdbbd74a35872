"""A tiny causal LM with a KV cache, and the actor / critic TensorDict modules built on it.

``TinyCausalLM`` is a nanoGPT-style decoder (learned absolute positions,
pre-LayerNorm blocks, tied embeddings) in one file, sized by a
:class:`TinyLMConfig` with named tiny presets (:data:`PRESETS`). Around it:

- :class:`NextTokenLogits` + :func:`make_actor`: the **policy that drives
  the environment** (``TokenLMEnv``, one step = one token). A
  ``ProbabilisticTensorDictSequential`` that reads the token buffer, draws
  the next token from ``Categorical(logits)`` and writes ``action`` and
  ``sample_log_prob``.
- :class:`ResponseLogProbs` and :class:`ResponseValues` (wrapped by
  :func:`make_actor_critic`): the **training-time networks** on the LLM
  layout ``[B, R]``: one full forward over prompt + response gives the
  per-token log-probs (and entropies) of the response tokens and the
  critic's per-token values.
- :class:`HFCausalLMAdapter`: any Hugging Face causal LM built from a config
  (Llama / Qwen style) behind the same interface, so it can replace the tiny
  model (``pip install ppo_objectives[hf]``).

Shape letters:

- ``B``: batch (rows of the LLM layout); ``N``: number of parallel envs.
- ``T``: tokens fed to one forward call; ``S``: the env's token-buffer
  length (prompt width ``P`` + ``max_new_tokens``), the KV-cache length.
- ``P``: prompt width (prompts are left-padded to it); ``R``: response length.
- ``V``: vocabulary size; ``C``: embedding width; ``L``: layers;
  ``H``: heads; ``D = C / H``: head width.

**KV-cache design.** The cache lives *in the module* (:class:`NextTokenLogits`),
never in the TensorDict, so collector batches stay small. Cache slot ``c``
holds the keys/values of buffer column ``c``. On every call the module checks,
per row, that its cached prefix is the current one: same batch shape, same
parameter versions (an optimizer step or ``load_state_dict`` bumps them),
same tokens in the cached columns, and the cache ends right before the newest
token. Rows that fail (a fresh episode after a reset, new weights) are
re-filled with one prefill forward; then every row advances by one token:
O(S) work per token instead of O(S^2). Finding the stale rows is one host
sync per step (``.any()``); it is on the env path only, never in the loss.
The cache is used only under ``torch.no_grad()`` (rollouts); with gradients
enabled the module runs a plain full forward, so it stays differentiable.

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

import copy
import math
from dataclasses import asdict, dataclass, replace
from typing import NamedTuple

import torch
import torch.nn.functional as F
from tensordict.nn import (
    InteractionType,
    ProbabilisticTensorDictModule,
    ProbabilisticTensorDictSequential,
    TensorDictModule,
)
from torch import Tensor, nn

from ppo_objectives import _validate
from ppo_objectives.functional import response_log_probs, value_checks

__all__ = [
    "PRESETS",
    "ActorCritic",
    "HFCausalLMAdapter",
    "KVCache",
    "LMOutput",
    "NextTokenLogits",
    "ResponseLogProbs",
    "ResponseValues",
    "TinyCausalLM",
    "TinyLMConfig",
    "make_actor",
    "make_actor_critic",
    "position_ids_from_mask",
    "sample_with_kv_cache",
]

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

    def __init__(self, config: TinyLMConfig):
        super().__init__()
        if not isinstance(config, TinyLMConfig):
            raise TypeError(f"config must be a TinyLMConfig, got {type(config).__name__}")
        self.config = config
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

    def new_cache(self, batch_size: int, max_len: int, *, device=None, dtype=None) -> KVCache:
        """An empty cache for ``batch_size`` rows of up to ``max_len`` columns."""
        if max_len > self.config.block_size:
            raise ValueError(
                f"max_len={max_len} exceeds block_size={self.config.block_size}: the model has no "
                f"position embedding beyond it; build the model with block_size >= {max_len}"
            )
        p = self.wte.weight
        c = self.config
        shape = (c.n_layer, batch_size, c.n_head, max_len, c.n_embd // c.n_head)
        device = p.device if device is None else device
        dtype = p.dtype if dtype is None else dtype
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
        """
        self._check_inputs(input_ids, attention_mask)
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


# --------------------------------------------------------------------------- #
# A plain batched sampling loop (the reference the env + collector is timed against)
# --------------------------------------------------------------------------- #


@torch.no_grad()
def sample_with_kv_cache(
    model: nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    max_new_tokens: int,
    *,
    eos_id: int,
    pad_id: int = 0,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Sample ``max_new_tokens`` tokens per row with the model's own KV cache.

    The loop MiniMind-style trainers run: one prefill over the left-padded
    prompts, then one cached step per token; rows that emitted EOS keep
    stepping but their later tokens are padding (mask False).

    Args:
        model: a :class:`TinyCausalLM` (or anything with its cache interface).
        prompt_ids / prompt_mask: ``[B, P]`` left-padded prompts and their mask.
        max_new_tokens: ``R``.

    Returns:
        ``(response_ids [B, R], log_probs [B, R] float32, mask [B, R] bool)``;
        response tokens after EOS are ``pad_id`` with log-prob 0 and mask False.
    """
    B, P = prompt_ids.shape
    device = prompt_ids.device
    cache = model.new_cache(B, P + max_new_tokens, device=device)
    pos = position_ids_from_mask(prompt_mask)
    out = model(prompt_ids, prompt_mask, position_ids=pos, cache=cache, cache_slots=0)
    logits = out.logits[:, -1]  # [B, V]
    next_pos = pos[:, -1] + 1  # [B]
    alive = torch.ones(B, dtype=torch.bool, device=device)
    tokens, logps, masks = [], [], []
    for j in range(max_new_tokens):
        logp_all = torch.log_softmax(logits, dim=-1)
        tok = torch.multinomial(logp_all.exp(), 1, generator=generator).squeeze(-1)  # [B]
        tokens.append(torch.where(alive, tok, pad_id))
        logps.append(torch.where(alive, logp_all.gather(-1, tok[:, None]).squeeze(-1), 0.0))
        masks.append(alive)
        alive = alive & (tok != eos_id)
        if j + 1 < max_new_tokens:
            out = model(tok[:, None], None, position_ids=next_pos[:, None], cache=cache, cache_slots=P + j)
            logits = out.logits[:, -1]
            next_pos = next_pos + 1
    return torch.stack(tokens, 1), torch.stack(logps, 1), torch.stack(masks, 1)


# --------------------------------------------------------------------------- #
# The env-facing policy: next-token logits with a per-row KV cache
# --------------------------------------------------------------------------- #


def _param_version(params: list[Tensor]) -> int:
    return sum(p._version for p in params)


class NextTokenLogits(nn.Module):
    """Logits of the next token for each env row, from the token buffer.

    Reads the observation of ``TokenLMEnv``: the buffer ``tokens [N, S]``, its
    ``attention_mask [N, S]`` and ``position [N]`` (the column the next token
    goes to), and returns ``logits [N, V]`` (float32) predicted at column
    ``position - 1``. Under ``torch.no_grad()`` it keeps a per-row KV cache
    (module docstring); otherwise, or with extra leading dims, or for a model
    without ``supports_kv_cache``, it runs a full forward.

    Example:
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <torch._C.Generator object at ...>
        >>> lm = TinyCausalLM(TinyLMConfig.preset("pico", vocab_size=10, block_size=6)).eval()
        >>> head = NextTokenLogits(lm)
        >>> tokens = torch.tensor([[0, 4, 5, 0, 0, 0]])          # prompt [_, 4, 5], width P = 3
        >>> mask = torch.tensor([[False, True, True, False, False, False]])
        >>> with torch.no_grad():
        ...     cached = head(tokens, mask, torch.tensor([3]))
        >>> full = lm(tokens[:, :3], mask[:, :3]).logits[:, -1]
        >>> torch.allclose(cached, full, atol=1e-5)
        True
    """

    #: Take the one-window path when its token count is at most this factor times the
    #: prefill + step path's (two forwards cost more per token on small batches).
    window_factor: float = 2.0

    def __init__(self, model: nn.Module, *, use_kv_cache: bool = True):
        super().__init__()
        self.model = model
        self.use_kv_cache = bool(use_kv_cache) and getattr(model, "supports_kv_cache", False)
        self.reset_cache()

    def reset_cache(self) -> None:
        """Forget the cache (it is rebuilt on the next call)."""
        self._cache: KVCache | None = None
        self._cache_len: Tensor | None = None
        self._cache_tokens: Tensor | None = None
        self._cache_version = -1
        self._params: list[Tensor] | None = None

    def __getstate__(self):  # never pickle the cache into collector workers
        state = self.__dict__.copy()
        state.update(_cache=None, _cache_len=None, _cache_tokens=None, _cache_version=-1, _params=None)
        return state

    def forward(self, tokens: Tensor, attention_mask: Tensor, position: Tensor) -> Tensor:
        attention_mask = attention_mask.bool()
        position = position.reshape(tokens.shape[:-1])
        S = tokens.shape[-1]
        if _validate.checking_values() and position.numel():
            lo, hi = torch.stack([position.min(), position.max()]).tolist()
            if lo < 1 or hi > S:
                raise ValueError(
                    f"position holds {lo if lo < 1 else hi}, outside [1, {S}] for a token buffer of S={S} columns: "
                    f"position is the column the next token goes to, after at least one prompt token"
                )
        with value_checks(False):  # the env validated its tokens; no per-step host syncs for them
            if tokens.dim() != 2 or not self.use_kv_cache or torch.is_grad_enabled():
                return self._full(tokens, attention_mask, position)
            return self._cached(tokens, attention_mask, position)

    def _full(self, tokens, attention_mask, position):
        lead = tokens.shape[:-1]
        S = tokens.shape[-1]
        tokens, attention_mask, last = tokens.reshape(-1, S), attention_mask.reshape(-1, S), position.reshape(-1) - 1
        hidden = self.model(tokens, attention_mask, compute_logits=False).hidden  # [N, S, C]
        h = hidden.gather(1, last[:, None, None].expand(-1, 1, hidden.shape[-1])).squeeze(1)
        return self.model.lm_head(h).float().reshape(*lead, -1)

    def _cached(self, tokens, attention_mask, position):
        N, S = tokens.shape
        if self._params is None:
            self._params = list(self.model.parameters())
        version = _param_version(self._params)
        cache = self._cache
        if (
            cache is None
            or cache.batch_size != N
            or cache.max_len != S
            or cache.k.device != tokens.device
            or version != self._cache_version
        ):
            cache = self._cache = self.model.new_cache(N, S, device=tokens.device)
            self._cache_len = torch.full((N,), -1, dtype=torch.long, device=tokens.device)
            self._cache_tokens = None
            self._params = list(self.model.parameters())  # re-read on every rebuild
            self._cache_version = version = _param_version(self._params)
        last = position - 1  # [N] column of the newest token
        cols = torch.arange(S, device=tokens.device)
        stale = self._cache_len != last
        if self._cache_tokens is not None:
            stale |= ((tokens != self._cache_tokens) & (cols < self._cache_len[:, None])).any(-1)
        pos_ids = position_ids_from_mask(attention_mask)  # [N, S]
        # One host sync per step: are there stale rows, and can one windowed forward serve all rows?
        # The common case (rows just reset, all at the same prompt end L0, every other row at or
        # beyond it): feed every row its last L0 + 1 columns; fresh rows fill their cache from
        # column 0, the others rewrite L0 cached columns with identical values. One forward, no prefill.
        l0 = torch.where(stale, last, -1).max()
        one_window = (torch.where(stale, last, l0) == l0).all() & (last >= l0).all()
        n_stale, l0, one_window = torch.stack([stale.sum(), l0, one_window.long()]).tolist()
        # window: N (L0 + 1) tokens in one forward; prefill + step: n_stale L0 + N tokens in two
        if n_stale and one_window and N * (l0 + 1) <= self.window_factor * (n_stale * l0 + N):
            slots = last[:, None] - l0 + torch.arange(l0 + 1, device=tokens.device)  # [N, L0 + 1]
            out = self.model(
                tokens.gather(1, slots),
                attention_mask.gather(1, slots),
                position_ids=pos_ids.gather(1, slots),
                cache=cache,
                cache_slots=slots,
            )
            self._cache_len = position.clone()
            self._cache_tokens = tokens.clone()
            return out.logits[:, -1]
        if n_stale:  # otherwise: prefill the stale rows up to their newest token, then step every row
            rows = stale.nonzero().squeeze(-1)
            width = max(1, int(last[rows].max()))  # columns [0, width) hold every stale row's prefix
            sub = self.model.new_cache(rows.numel(), S, device=tokens.device)
            prefix = attention_mask[rows, :width] & (cols[:width] < last[rows, None])
            self.model(
                tokens[rows, :width], prefix, position_ids=pos_ids[rows, :width], cache=sub, cache_slots=0,
                compute_logits=False,
            )
            cache.k[:, rows] = sub.k
            cache.v[:, rows] = sub.v
            cache.valid[rows] = sub.valid
        x = tokens.gather(1, last[:, None])  # [N, 1]
        out = self.model(
            x,
            attention_mask.gather(1, last[:, None]),
            position_ids=pos_ids.gather(1, last[:, None]),
            cache=cache,
            cache_slots=last[:, None],
        )
        self._cache_len = position.clone()
        self._cache_tokens = tokens.clone()
        return out.logits[:, 0]


def make_actor(
    model: nn.Module,
    *,
    use_kv_cache: bool = True,
    tokens_key: str = "tokens",
    attention_mask_key: str = "attention_mask",
    position_key: str = "position",
    action_key: str = "action",
    log_prob_key: str = "sample_log_prob",
) -> ProbabilisticTensorDictSequential:
    """The env policy: ``Categorical(logits=NextTokenLogits(model)(obs))``.

    Writes ``logits`` ``[N, V]``, ``action`` ``[N]`` (a token id) and
    ``sample_log_prob`` ``[N]`` (float32). Under
    ``set_exploration_type(ExplorationType.DETERMINISTIC)`` it picks the
    argmax token (greedy decoding); the default (collectors) samples.

    Example:
        >>> from tensordict import TensorDict
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <torch._C.Generator object at ...>
        >>> lm = TinyCausalLM(TinyLMConfig.preset("pico", vocab_size=10, block_size=6))
        >>> actor = make_actor(lm)
        >>> td = TensorDict(tokens=torch.tensor([[1, 2, 0]]), attention_mask=torch.tensor([[True, True, False]]),
        ...                 position=torch.tensor([2]), batch_size=[1])
        >>> with torch.no_grad():
        ...     td = actor(td)
        >>> sorted(k for k in td.keys() if k not in ("tokens", "attention_mask", "position"))
        ['action', 'logits', 'sample_log_prob']
        >>> td["sample_log_prob"].shape
        torch.Size([1])
    """
    logits = TensorDictModule(
        NextTokenLogits(model, use_kv_cache=use_kv_cache),
        in_keys=[tokens_key, attention_mask_key, position_key],
        out_keys=["logits"],
    )
    dist = ProbabilisticTensorDictModule(
        in_keys=["logits"],
        out_keys=[action_key],
        distribution_class=torch.distributions.Categorical,
        distribution_kwargs={"validate_args": False},  # logits come from the model: skip per-step checks
        return_log_prob=True,
        log_prob_key=log_prob_key,
        default_interaction_type=InteractionType.RANDOM,
    )
    return ProbabilisticTensorDictSequential(logits, dist)


# --------------------------------------------------------------------------- #
# Training-time networks on the LLM layout [B, R]
# --------------------------------------------------------------------------- #


class ResponseLogProbs(nn.Module):
    """Per-token log-probs (and entropies) of the response tokens, one full forward.

    ``input_ids [B, P + R]`` holds a left-padded prompt of width ``P`` and the
    response; ``logp[b, j] = log_softmax(logits[b, P - 1 + j])[input_ids[b, P + j]]``
    (:func:`~ppo_objectives.functional.response_log_probs`). Outputs
    ``[B, R]`` float32; positions after the response's end are garbage to be
    masked by the caller. With ``entropy_grad=False`` the entropy is computed
    without gradient (a logged diagnostic, no entropy bonus): cheaper backward.
    """

    def __init__(self, model: nn.Module, prompt_len: int, *, return_entropy: bool = True, entropy_grad: bool = True):
        super().__init__()
        if isinstance(prompt_len, bool) or not isinstance(prompt_len, int) or prompt_len < 1:
            raise ValueError(f"prompt_len={prompt_len!r} must be an int >= 1 (the prompt width P)")
        self.model = model
        self.prompt_len = prompt_len
        self.return_entropy = return_entropy
        self.entropy_grad = entropy_grad

    def forward(self, input_ids: Tensor, attention_mask: Tensor):
        B, T = input_ids.shape
        R = T - self.prompt_len
        if R < 1:
            raise ValueError(
                f"input_ids has T={T} columns but prompt_len={self.prompt_len}: there is no response to score; "
                f"pass prompt + response ([B, P + R])"
            )
        logits = self.model(input_ids, attention_mask).logits
        prompt_lens = torch.full((B,), self.prompt_len, dtype=torch.long, device=input_ids.device)
        with value_checks(False):
            if not self.return_entropy or self.entropy_grad or not torch.is_grad_enabled():
                return response_log_probs(logits, input_ids, prompt_lens, R, return_entropy=self.return_entropy)
            logp = response_log_probs(logits, input_ids, prompt_lens, R)
            with torch.no_grad():  # entropy for logging only: keep it out of the backward pass
                _, entropy = response_log_probs(logits.detach(), input_ids, prompt_lens, R, return_entropy=True)
        return logp, entropy


class ResponseValues(nn.Module):
    """Critic: ``values[b, j] = head(hidden[b, P - 1 + j])``, the value of the state
    before response token ``j`` (MiniMind's critic convention), ``[B, R]`` float32."""

    def __init__(self, model: nn.Module, prompt_len: int):
        super().__init__()
        if isinstance(prompt_len, bool) or not isinstance(prompt_len, int) or prompt_len < 1:
            raise ValueError(f"prompt_len={prompt_len!r} must be an int >= 1 (the prompt width P)")
        self.model = model
        self.prompt_len = prompt_len
        self.value_head = nn.Linear(model.hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        T = input_ids.shape[1]
        if T - self.prompt_len < 1:
            raise ValueError(
                f"input_ids has T={T} columns but prompt_len={self.prompt_len}: there is no response to value; "
                f"pass prompt + response ([B, P + R])"
            )
        hidden = self.model(input_ids, attention_mask, compute_logits=False).hidden  # [B, T, C]
        h = hidden[:, self.prompt_len - 1 : T - 1]  # [B, R, C]
        return self.value_head(h).squeeze(-1).float()


@dataclass
class ActorCritic:
    """The networks of one PPO run (see :func:`make_actor_critic`).

    Attributes:
        policy: env policy (:func:`make_actor`), writes ``action`` / ``sample_log_prob``.
        actor: TensorDictModule ``(input_ids, attention_mask) -> (log_prob, entropy)`` ``[B, R]``.
        critic: TensorDictModule ``(input_ids, attention_mask) -> state_value`` ``[B, R]``.
        actor_model / critic_model: the underlying causal LMs (the same object when shared).
        critic_head: the value head (an ``nn.Linear``).
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
        return list(self.actor_model.parameters())

    def critic_parameters(self):
        """Critic-only parameters (just the head when the trunk is shared)."""
        own = list(self.critic_head.parameters())
        return own if self.shared_trunk else list(self.critic_model.parameters()) + own


def make_actor_critic(
    model: nn.Module | TinyLMConfig,
    prompt_len: int,
    *,
    shared_trunk: bool = False,
    critic_model: nn.Module | None = None,
    use_kv_cache: bool = True,
    entropy_grad: bool = True,
    log_prob_key: str = "log_prob",
    entropy_key: str = "entropy",
    value_key: str = "state_value",
) -> ActorCritic:
    """Actor and critic built from one causal LM.

    Args:
        model: a causal LM (:class:`TinyCausalLM`, :class:`HFCausalLMAdapter`) or a config.
        prompt_len: ``P``, the prompt width of the env (left-padded prompts).
        shared_trunk: the critic's value head sits on the actor's trunk (one set of
            weights) instead of on its own copy (MiniMind's separate critic, the default).
        critic_model: an explicit critic trunk (overrides ``shared_trunk``).
        entropy_grad: let gradients flow through the actor's entropy (needed for an
            entropy bonus; ``False`` makes it a cheaper logged diagnostic).

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
    policy = make_actor(model, use_kv_cache=use_kv_cache)
    actor = TensorDictModule(
        ResponseLogProbs(model, prompt_len, return_entropy=True, entropy_grad=entropy_grad),
        in_keys=["input_ids", "attention_mask"],
        out_keys=[log_prob_key, entropy_key],
    )
    values = ResponseValues(critic_model, prompt_len)
    critic = TensorDictModule(values, in_keys=["input_ids", "attention_mask"], out_keys=[value_key])
    return ActorCritic(policy, actor, critic, model, critic_model, values.value_head)


# --------------------------------------------------------------------------- #
# Hugging Face adapter (optional extra: pip install ppo_objectives[hf])
# --------------------------------------------------------------------------- #


class HFCausalLMAdapter(nn.Module):
    """A Hugging Face causal LM behind :class:`TinyCausalLM`'s interface.

    ``forward(input_ids, attention_mask, position_ids=None, compute_logits=True)
    -> LMOutput(logits float32, hidden)``, plus ``hidden_size``, ``vocab_size``
    and ``lm_head``, so :func:`make_actor` and :func:`make_actor_critic` accept
    it. Positions are computed from the attention mask (left padding aware).
    It has no per-row KV cache (``supports_kv_cache = False``): the env policy
    runs a full forward per token, O(S^2); the training path is unaffected.

    Build it from a config, no download: ``HFCausalLMAdapter.from_config(LlamaConfig(...))``.
    Llama / Qwen style models work; GPT-2 does not take ``position_ids`` the same
    way under transformers 5 and is not supported.
    """

    supports_kv_cache = False

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        self.hf_model = hf_model

    @classmethod
    def from_config(cls, config) -> "HFCausalLMAdapter":
        try:
            from transformers import AutoModelForCausalLM
        except ImportError as err:  # pragma: no cover - depends on the environment
            raise ImportError(
                "HFCausalLMAdapter needs transformers; install the extra: pip install 'ppo_objectives[hf]'"
            ) from err
        return cls(AutoModelForCausalLM.from_config(config))

    @property
    def hidden_size(self) -> int:
        return self.hf_model.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.hf_model.config.vocab_size

    @property
    def lm_head(self) -> nn.Module:
        return self.hf_model.get_output_embeddings()

    def forward(self, input_ids, attention_mask=None, *, position_ids=None, compute_logits=True, **unused) -> LMOutput:
        if unused.get("cache") is not None:
            raise ValueError("HFCausalLMAdapter has no per-row KV cache (supports_kv_cache is False)")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids, dtype=torch.bool)
        if position_ids is None:
            position_ids = position_ids_from_mask(attention_mask)
        body = self.hf_model.get_decoder()
        out = body(input_ids=input_ids, attention_mask=attention_mask.long(), position_ids=position_ids, use_cache=False)
        hidden = out.last_hidden_state
        logits = self.lm_head(hidden).float() if compute_logits else None
        return LMOutput(logits, hidden)

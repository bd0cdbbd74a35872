"""Any Hugging Face causal LM behind the tiny model's interface (``pip install -e ".[hf]"``).

:class:`HFCausalLMAdapter` puts a Hugging Face causal LM built from a config or
loaded from a local directory (Llama / Qwen style) behind the interface of
:class:`~ppo_objectives.llm.models.TinyCausalLM`: ``forward(input_ids,
attention_mask, ..., cache=, cache_slots=) -> LMOutput(logits, hidden)`` plus
``hidden_size``, ``vocab_size``, ``lm_head`` and ``new_cache``. It keeps the same
per-row :class:`~ppo_objectives.llm.models.KVCache` (Llama, Mistral, Qwen2 and
Qwen3, see ``supports_kv_cache``) and runs in mixed precision when
``autocast_dtype`` is set (float32 logits). :func:`hf_decoder` and
:func:`hf_forward` are the package's one way into a Hugging Face module: the
adapter and the full-sequence read-outs
(:class:`~ppo_objectives.llm.chat.CausalLMCritic`,
:class:`~ppo_objectives.llm.chat.CausalLMTokenLogProbs`) all call them.

Shape letters: ``B`` rows, ``T`` tokens per call, ``S`` the KV-cache length,
``V`` vocabulary, ``C`` width, ``H`` / ``H_kv`` query / key-value heads.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor, nn

from ppo_objectives import _validate
from ppo_objectives.llm.models import KVCache, LMOutput, autocast_context, check_autocast_dtype, position_ids_from_mask

__all__ = ["HFCausalLMAdapter", "hf_decoder", "hf_forward"]


# --------------------------------------------------------------------------- #
# Hugging Face models (optional extra, from the clone: pip install -e ".[hf]")
# --------------------------------------------------------------------------- #


def hf_decoder(model: nn.Module) -> nn.Module:
    """The decoder of a Hugging Face causal LM: its trunk without the LM head.

    ``model.get_decoder()`` when the model has it (Hugging Face's own lookup;
    a decoder returns itself), else ``model.base_model`` when that is another
    module, else ``model`` (already a decoder, or a stand-in for one).
    """
    get_decoder = getattr(model, "get_decoder", None)
    if callable(get_decoder):
        decoder = get_decoder()
        if isinstance(decoder, nn.Module):
            return decoder
    base = getattr(model, "base_model", None)
    return base if isinstance(base, nn.Module) and base is not model else model


def _activation_checkpointing(model: nn.Module) -> bool:
    """Whether Hugging Face's activation checkpointing is on (its property's name since transformers 5, then the
    older one)."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if isinstance(getattr(type(model), name, None), property):
            return bool(getattr(model, name))
    return False


def hf_forward(
    module: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor | None = None,
    *,
    output: str = "last_hidden_state",
    **kwargs,
) -> Tensor:
    """One forward call into a Hugging Face module, and the output field asked for.

    Calls ``module(input_ids=input_ids, attention_mask=attention_mask.long(), **kwargs)``
    (``attention_mask=None`` stays ``None``) and returns ``out.<output>``:
    ``"last_hidden_state"`` ``[B, T, H]`` of a decoder (:func:`hf_decoder`), or
    ``"logits"`` ``[B, T, V]`` of a causal LM (its own forward, so forward hooks
    and model-specific logit processing apply). Any module whose output has
    that attribute works (a stand-in in tests).

    Example:
        >>> class Decoder(nn.Module):                       # stands in for a causal LM's decoder
        ...     def forward(self, input_ids, attention_mask=None):
        ...         return type("Out", (), {"last_hidden_state": input_ids[..., None].float()})()
        >>> hf_forward(Decoder(), torch.tensor([[1, 2]]), torch.tensor([[True, True]])).shape
        torch.Size([1, 2, 1])
    """
    am = None if attention_mask is None else attention_mask.long()
    out = module(input_ids=input_ids, attention_mask=am, **kwargs)
    x = getattr(out, output, None)
    if x is None:
        fix = (
            "pass the decoder of a Hugging Face causal LM (model.base_model), or a module whose output has "
            ".last_hidden_state"
            if output == "last_hidden_state"
            else f"pass a Hugging Face causal LM (AutoModelForCausalLM), or a module whose output has .{output}"
        )
        raise TypeError(f"{type(module).__name__} returned no {output}; {fix}")
    return x


#: Hugging Face ``model_type`` values whose decoder is verified to take the per-row cache
#: (tests/llm/test_hf.py): RoPE positions from ``position_ids``, an explicit 4D mask passed through
#: ``create_causal_mask`` as is, and ``cache.update(keys, values, layer_idx)`` in every attention layer.
_KV_CACHE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


#: Attention implementations that read the explicit mask: SDPA takes a boolean one, eager an additive one.
_KV_CACHE_ATTENTION = ("sdpa", "eager")


def _kv_cache_refusal(config) -> str | None:
    """Why a Hugging Face model with this config cannot take the per-row cache, or ``None`` when it can."""
    model_type = getattr(config, "model_type", None)
    if model_type not in _KV_CACHE_MODEL_TYPES:
        return (
            f"model_type={model_type!r} is not among the verified ones {_KV_CACHE_MODEL_TYPES} (its attention may "
            f"not take per-row positions, an explicit 4D mask or a custom cache)"
        )
    attn = getattr(config, "_attn_implementation", None)
    if attn not in _KV_CACHE_ATTENTION:
        return (
            f"attention implementation {attn!r} does not read an explicit [B, 1, T, S] mask; load the model with "
            f"attn_implementation='sdpa' (or 'eager')"
        )
    layer_types = getattr(config, "layer_types", None) or ()
    if any(t != "full_attention" for t in layer_types):
        return f"layer_types={sorted(set(layer_types))} holds non-full attention layers (sliding windows)"
    if getattr(config, "sliding_window", None) is not None:
        return f"sliding_window={config.sliding_window}: the per-row mask attends to the whole prefix, not a window"
    return None


def _slot_mask(cache: KVCache, attention_mask: Tensor, cache_slots) -> tuple[Tensor, Tensor]:
    """Write this call's validity into ``cache.valid`` and return ``(query slots [B, T], allowed [B, 1, T, S])``:
    a query attends to every valid slot at or before its own, and always to its own slot."""
    B, T = attention_mask.shape
    device = attention_mask.device
    if isinstance(cache_slots, int):
        q_slots = (cache_slots + torch.arange(T, device=device)).expand(B, T)
        cache.valid[:, cache_slots : cache_slots + T] = attention_mask
    else:
        q_slots = cache_slots
        cache.valid.scatter_(1, q_slots, attention_mask)
    k_idx = torch.arange(cache.max_len, device=device)
    allowed = ((k_idx <= q_slots[..., None]) & cache.valid[:, None, :]) | (k_idx == q_slots[..., None])
    return q_slots, allowed[:, None]


@functools.cache
def _slot_layer_class():
    """The per-layer piece of :func:`_hf_slot_cache` (built once, on first use: transformers is optional)."""
    from transformers.cache_utils import CacheLayerMixin

    class _SlotLayer(CacheLayerMixin):
        is_sliding = False

        def __init__(self, keys: Tensor, values: Tensor, slots):
            super().__init__()
            self.keys, self.values, self.slots, self.is_initialized = keys, values, slots, True

        def lazy_initialization(self, key_states, value_states) -> None:  # preallocated
            pass

        def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
            k, v = key_states.to(self.keys.dtype), value_states.to(self.values.dtype)  # autocast may promote
            if isinstance(self.slots, int):
                T = k.shape[2]
                self.keys[:, :, self.slots : self.slots + T] = k
                self.values[:, :, self.slots : self.slots + T] = v
            else:  # [B, T] slot per token
                index = self.slots[:, None, :, None].expand(k.shape)
                self.keys.scatter_(2, index, k)
                self.values.scatter_(2, index, v)
            return self.keys, self.values

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self.keys.shape[2], 0

        def get_seq_length(self) -> int:
            return self.keys.shape[2]

        def get_max_length(self) -> int:
            return self.keys.shape[2]

    return _SlotLayer


def _hf_slot_cache(cache: KVCache, cache_slots):
    """A ``transformers.Cache`` over ``cache``'s per-layer buffers ``[B, H_kv, S, D]`` (views of
    ``cache.k`` / ``cache.v``): each attention layer's ``update`` writes this call's keys / values into
    the columns ``cache_slots`` (int start or ``[B, T]``) and attends over the whole buffer."""
    from transformers.cache_utils import Cache

    layer = _slot_layer_class()
    return Cache(layers=[layer(cache.k[i], cache.v[i], cache_slots) for i in range(cache.k.shape[0])])


class HFCausalLMAdapter(nn.Module):
    """A Hugging Face causal LM behind :class:`TinyCausalLM`'s interface, per-row KV cache included.

    ``forward(input_ids, attention_mask, position_ids=None, cache=None,
    cache_slots=None, compute_logits=True) -> LMOutput(logits float32, hidden)``,
    plus ``hidden_size``, ``vocab_size``, ``lm_head`` and :meth:`new_cache`, so
    :func:`~ppo_objectives.llm.policy.make_actor` and
    :func:`~ppo_objectives.llm.readouts.make_actor_critic` accept it. Positions are
    computed from the attention mask (left padding aware). Without a cache the
    decoder runs through :func:`hf_decoder` / :func:`hf_forward` (as in the
    full-sequence read-outs), then the LM head on its hidden states.

    **KV cache.** :meth:`new_cache` returns the same :class:`KVCache` as
    :class:`TinyCausalLM` (``k`` / ``v`` ``[L, B, H_kv, S, D]``, ``H_kv`` the
    key/value heads, fewer than the query heads under grouped-query attention).
    With ``cache=`` the call's keys / values are written into the columns
    ``cache_slots`` (int start or ``[B, T]``) by a ``transformers.Cache`` whose
    per-layer ``update`` scatters into the preallocated buffer and returns all
    ``S`` columns; an explicit ``[B, 1, T, S]`` mask (key slot <= query slot and
    key valid, or the query's own slot) and explicit ``position_ids`` go to the
    decoder, so feeding a sequence in pieces gives the full forward's logits.
    :attr:`supports_kv_cache` is True for the verified ``model_type`` values
    (Llama, Mistral, Qwen2, Qwen3) with SDPA or eager attention and full
    attention in every layer (no sliding window); otherwise the env policy runs a full forward per token, O(S^2), and
    :meth:`new_cache` names the reason.

    **Mixed precision.** ``autocast_dtype`` works as on :class:`TinyCausalLM`:
    the decoder and the LM head run under ``torch.autocast``, logits float32.

    Build it without a download: ``HFCausalLMAdapter.from_config(LlamaConfig(...))``
    or ``HFCausalLMAdapter.from_pretrained(local_dir)``. GPT-2 does not take
    ``position_ids`` the same way under transformers 5 and is not supported.

    Example:
        >>> from transformers import LlamaConfig
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <torch._C.Generator object at ...>
        >>> lm = HFCausalLMAdapter.from_config(LlamaConfig(
        ...     vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        ...     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8)).eval()
        >>> lm.supports_kv_cache
        True
        >>> ids = torch.tensor([[1, 2, 3, 4, 5]])
        >>> cache = lm.new_cache(batch_size=1, max_len=8)
        >>> cache.k.shape                                           # [L, B, H_kv, S, D]
        torch.Size([1, 1, 2, 8, 4])
        >>> with torch.no_grad():
        ...     full = lm(ids).logits
        ...     a = lm(ids[:, :3], cache=cache, cache_slots=0).logits
        ...     b = lm(ids[:, 3:], cache=cache, cache_slots=3).logits
        >>> torch.allclose(torch.cat([a, b], 1), full, atol=1e-5)
        True
    """

    def __init__(self, hf_model: nn.Module, *, autocast_dtype: torch.dtype | None = None):
        super().__init__()
        check_autocast_dtype(autocast_dtype, "HFCausalLMAdapter")
        self.hf_model = hf_model
        self.autocast_dtype = autocast_dtype

    @staticmethod
    def _auto_model_class():
        try:
            from transformers import AutoModelForCausalLM
        except ImportError as err:  # pragma: no cover - depends on the environment
            raise ImportError(
                "HFCausalLMAdapter needs transformers; install the extra from the clone: pip install -e '.[hf]'"
            ) from err
        return AutoModelForCausalLM

    @classmethod
    def from_config(cls, config, *, autocast_dtype: torch.dtype | None = None) -> "HFCausalLMAdapter":
        """A freshly initialised model: ``AutoModelForCausalLM.from_config(config)``."""
        return cls(cls._auto_model_class().from_config(config), autocast_dtype=autocast_dtype)

    @classmethod
    def from_pretrained(cls, path, *, autocast_dtype: torch.dtype | None = None, **kwargs) -> "HFCausalLMAdapter":
        """A saved model from a local directory: ``AutoModelForCausalLM.from_pretrained(path,
        local_files_only=True, **kwargs)`` (no network; ``kwargs`` such as ``dtype=`` pass through)."""
        kwargs.setdefault("local_files_only", True)
        return cls(cls._auto_model_class().from_pretrained(path, **kwargs), autocast_dtype=autocast_dtype)

    @property
    def hidden_size(self) -> int:
        return self.hf_model.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.hf_model.config.vocab_size

    @property
    def lm_head(self) -> nn.Module:
        return self.hf_model.get_output_embeddings()

    @property
    def supports_kv_cache(self) -> bool:
        """Whether :meth:`new_cache` and ``forward(cache=...)`` work for this model (class docstring)."""
        return _kv_cache_refusal(self.hf_model.config) is None

    def new_cache(self, batch_size: int, max_len: int, *, device=None, dtype=None) -> KVCache:
        """An empty cache for ``batch_size`` rows of up to ``max_len`` columns: ``k`` / ``v``
        ``[L, B, H_kv, S, D]`` in ``dtype`` (default: ``autocast_dtype`` when set, else the parameters'),
        ``valid`` ``[B, S]`` all False."""
        cfg = self.hf_model.config
        refusal = _kv_cache_refusal(cfg)
        if refusal is not None:
            raise ValueError(
                f"HFCausalLMAdapter has no per-row KV cache for this model: {refusal}; the env policy "
                f"falls back to a full forward per token (make_actor(model, use_kv_cache=False))"
            )
        _validate.check_int("batch_size", batch_size, low=1, what=" (cache rows)")
        _validate.check_int("max_len", max_len, low=1, what=" (cache columns)")
        limit = getattr(cfg, "max_position_embeddings", None)
        if limit is not None and max_len > limit:
            raise ValueError(
                f"max_len={max_len} exceeds max_position_embeddings={limit}: the model was not built for "
                f"positions beyond it; shorten the env buffer (prompt width + max_new_tokens) or build the model "
                f"with max_position_embeddings >= {max_len}"
            )
        p = self.lm_head.weight
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        shape = (cfg.num_hidden_layers, batch_size, kv_heads, max_len, head_dim)
        device = p.device if device is None else device
        dtype = self._compute_dtype() if dtype is None else dtype
        return KVCache(
            k=torch.zeros(shape, device=device, dtype=dtype),
            v=torch.zeros(shape, device=device, dtype=dtype),
            valid=torch.zeros(batch_size, max_len, dtype=torch.bool, device=device),
        )

    @property
    def supports_shared_prefix(self) -> bool:
        """Whether ``forward(shared_prefix=k)`` runs the first ``k`` columns once for every row: a model with the
        KV cache (:attr:`supports_kv_cache`), without Hugging Face's activation checkpointing (which drops a cache
        in training mode)."""
        return self.supports_kv_cache and not _activation_checkpointing(self.hf_model)

    def _compute_dtype(self) -> torch.dtype:
        check_autocast_dtype(self.autocast_dtype, "HFCausalLMAdapter")
        return self.lm_head.weight.dtype if self.autocast_dtype is None else self.autocast_dtype

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        *,
        position_ids: Tensor | None = None,
        cache: KVCache | None = None,
        cache_slots: int | Tensor | None = None,
        compute_logits: bool = True,
        shared_prefix: int = 0,
    ) -> LMOutput:
        """Logits ``[B, T, V]`` (float32) and hidden states ``[B, T, C]``; arguments as
        :meth:`TinyCausalLM.forward` (``input_ids`` / ``attention_mask`` / ``position_ids`` ``[B, T]``,
        ``cache_slots`` an int start column or ``[B, T]``).

        ``shared_prefix=k``: the first ``k`` columns hold the same tokens in every row, all attended (a
        prompt's system message and worked example): the decoder runs them once, on one row, and every row's
        other columns attend to those keys and values, with gradients flowing back through the one copy.
        The numbers are the full forward's up to float rounding; the work of ``k * (B - 1)`` tokens is saved.
        Needs :attr:`supports_shared_prefix`, no ``cache``."""
        check_autocast_dtype(self.autocast_dtype, "HFCausalLMAdapter")
        if _validate.checking_values() and input_ids.numel():  # the embedding's IndexError names nothing
            lo, hi = torch.stack([input_ids.min(), input_ids.max()]).tolist()
            if lo < 0 or hi >= self.vocab_size:
                raise ValueError(
                    f"HFCausalLMAdapter: input_ids holds token id {lo if lo < 0 else hi}, outside [0, "
                    f"vocab_size={self.vocab_size}): the embedding cannot look it up; check the tokenizer / env "
                    f"vocabulary (TokenLMEnv vocab_size) against the model config"
                )
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids, dtype=torch.bool)
        if cache is not None:
            if shared_prefix:
                raise ValueError("HFCausalLMAdapter: shared_prefix runs the prefix once for a forward without a "
                                 "cache; with cache= pass shared_prefix=0 (the cache already holds the prefix)")
            return self._cached_forward(input_ids, attention_mask.bool(), position_ids, cache, cache_slots,
                                        compute_logits)
        if position_ids is None:
            position_ids = position_ids_from_mask(attention_mask)
        if shared_prefix:
            self._check_shared_prefix(input_ids, attention_mask, shared_prefix)
            return self._shared_prefix_forward(input_ids, attention_mask, position_ids, shared_prefix, compute_logits)
        with autocast_context(self.autocast_dtype, self.lm_head.weight.device):
            hidden = hf_forward(
                hf_decoder(self.hf_model), input_ids, attention_mask, position_ids=position_ids, use_cache=False
            )
            logits = self.lm_head(hidden).float() if compute_logits else None
        return LMOutput(logits, hidden)

    def _check_shared_prefix(self, input_ids: Tensor, attention_mask: Tensor, k: int) -> None:
        T = input_ids.shape[1]
        _validate.check_int("shared_prefix", k, low=0, what=" (columns every row shares)")
        if k >= T:
            raise ValueError(f"HFCausalLMAdapter: shared_prefix={k} leaves no column of the T={T} to run per row; "
                             f"pass at most {T - 1}")
        if not self.supports_shared_prefix:
            why = _kv_cache_refusal(self.hf_model.config) or "activation checkpointing is on"
            raise ValueError(f"HFCausalLMAdapter: shared_prefix={k} needs the KV cache, and this model has none "
                             f"({why}); pass shared_prefix=0")
        if _validate.checking_values():  # one host read
            head = input_ids[:, :k]
            if not bool((head == head[:1]).all() & attention_mask[:, :k].bool().all()):
                raise ValueError(f"HFCausalLMAdapter: shared_prefix={k}, but the first {k} columns are not the same "
                                 f"attended tokens in every row; find the prefix with "
                                 f"llm.readouts.shared_prefix(input_ids, attention_mask, prompt_len)")

    def _shared_prefix_forward(self, input_ids, attention_mask, position_ids, k: int, compute_logits: bool):
        B = input_ids.shape[0]
        decoder, mask = hf_decoder(self.hf_model), attention_mask.long()
        with autocast_context(self.autocast_dtype, self.lm_head.weight.device):
            head = decoder(input_ids=input_ids[:1, :k], attention_mask=mask[:1, :k], position_ids=position_ids[:1, :k],
                           use_cache=True)
            cache = head.cache if "cache" in head.keys() else head.past_key_values  # transformers >= 5.x: ``cache``
            for layer in cache.layers:  # every row attends to the one copy (views; the gradients sum into it)
                layer.keys, layer.values = layer.keys.expand(B, -1, -1, -1), layer.values.expand(B, -1, -1, -1)
            tail = decoder(input_ids=input_ids[:, k:], attention_mask=mask, position_ids=position_ids[:, k:],
                           cache=cache, use_cache=True)
            hidden = torch.cat([head.last_hidden_state.expand(B, -1, -1), tail.last_hidden_state], dim=1)
            logits = self.lm_head(hidden).float() if compute_logits else None
        return LMOutput(logits, hidden)

    def _check_cache(self, input_ids: Tensor, cache, cache_slots) -> None:
        if not isinstance(cache, KVCache):
            raise ValueError(
                f"cache={type(cache).__name__} is no per-row KV cache of HFCausalLMAdapter: pass the KVCache "
                f"that new_cache(batch_size, max_len) returns"
            )
        refusal = _kv_cache_refusal(self.hf_model.config)
        if refusal is not None:
            raise ValueError(f"HFCausalLMAdapter has no per-row KV cache for this model: {refusal}")
        B, T = input_ids.shape
        if cache.batch_size != B:
            raise ValueError(f"cache holds {cache.batch_size} rows but input_ids has B={B}: build the cache with "
                             f"new_cache(batch_size={B}, ...)")
        if cache_slots is None:
            raise ValueError("cache_slots is required with a cache: the columns these tokens occupy")
        if not isinstance(cache_slots, int) and tuple(cache_slots.shape) != (B, T):
            raise ValueError(f"cache_slots has shape {tuple(cache_slots.shape)} but input_ids has shape {(B, T)}: "
                             f"one cache column per token is needed (no broadcasting)")
        if cache.k.dtype != self._compute_dtype():
            raise ValueError(
                f"cache holds {cache.k.dtype} keys/values but this forward computes them in "
                f"{self._compute_dtype()} (autocast_dtype={self.autocast_dtype}): they cannot be written into it; "
                f"build the cache with new_cache() and no dtype, after setting autocast_dtype"
            )

    def _cached_forward(self, input_ids, attention_mask, position_ids, cache, cache_slots, compute_logits):
        self._check_cache(input_ids, cache, cache_slots)
        q_slots, allowed = _slot_mask(cache, attention_mask, cache_slots)  # [B, T], [B, 1, T, S]
        if position_ids is None:
            position_ids = q_slots
        if self.hf_model.config._attn_implementation == "eager":  # eager adds the mask to the scores
            allowed = torch.zeros(allowed.shape, device=allowed.device).masked_fill_(
                ~allowed, torch.finfo(torch.float32).min
            )
        with autocast_context(self.autocast_dtype, self.lm_head.weight.device):
            out = hf_decoder(self.hf_model)(
                input_ids=input_ids, attention_mask=allowed, position_ids=position_ids,
                cache=_hf_slot_cache(cache, cache_slots), use_cache=True,
            )
            hidden = out.last_hidden_state
            logits = self.lm_head(hidden).float() if compute_logits else None
        return LMOutput(logits, hidden)

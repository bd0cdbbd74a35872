"""The env policy: next-token logits of a causal LM with a per-row KV cache, as a TorchRL actor.

:func:`make_actor` is the **policy that drives the environment**
(:class:`~ppo_objectives.llm.env.TokenLMEnv`, one step = one token): a
``ProbabilisticTensorDictSequential`` that reads the token buffer, draws the
next token from ``Categorical(logits)`` (:class:`NextTokenLogits`) and writes
``action`` and ``sample_log_prob``. :func:`sample_with_kv_cache` is the plain
batched sampling loop the env + collector path is timed against. The models
are in :mod:`ppo_objectives.llm.models`; the training-time read-outs in
:mod:`ppo_objectives.llm.readouts`.

Shape letters: ``N``: env rows; ``S``: the env's token-buffer length (prompt
width ``P`` + ``max_new_tokens``), the KV-cache length; ``B``: rows of a
sampled batch; ``R``: response length; ``V``: vocabulary size.

**KV-cache design.** The cache lives *in the module* (:class:`NextTokenLogits`),
never in the TensorDict, so collector batches stay small. Cache slot ``c``
holds the keys/values of buffer column ``c``. On every call the module checks,
per row, that its cached prefix is the current one: same batch shape, same
parameter versions (an optimizer step or ``load_state_dict`` bumps them),
same tokens and attention mask in the cached columns, and the cache ends at or
before the newest token. Rows that fail (a fresh episode after a reset, new
weights) are re-filled with one prefill forward. A row whose cache ends before
its newest token (a multi-turn env appended its own turn) is **behind**: the
missing columns alone are fed, in one windowed forward over the rows behind,
never the whole conversation. A row being filled copies the keys and values of
the leading context columns that repeat the last filled row's context (a shared
system prompt or worked example: the same tokens at the same positions give the
same keys and values) and computes only the rest; when every row resets at once,
one is filled alone first and copied into the others. Then every row advances by one token:
O(S) work per token instead of O(S^2). Finding the stale rows is one host
sync per step (``.any()``); it is on the env path only, never in the loss.
The cache is used only under ``torch.no_grad()`` (rollouts); with gradients
enabled the module runs a plain full forward, so it stays differentiable.
The same code drives :class:`~ppo_objectives.llm.models.TinyCausalLM` and
:class:`~ppo_objectives.llm.hf.HFCausalLMAdapter` (whose ``new_cache`` /
``cache_slots`` interface is the tiny model's); a model whose
``supports_kv_cache`` is False gets the full forward per token. Under a model's
``autocast_dtype`` the cache is kept in that dtype and rebuilt when it changes.

**Sampling temperature.** :func:`make_actor`, :class:`NextTokenLogits` and
:func:`sample_with_kv_cache` take ``temperature=T`` (default 1.0): tokens are drawn
from ``softmax(logits / T)`` and the stored log-probs (``sample_log_prob``) are
those of that distribution, the one actually sampled. The training-time
read-outs (:func:`~ppo_objectives.llm.readouts.make_actor_critic`,
:class:`~ppo_objectives.llm.readouts.ResponseLogProbs`,
:class:`~ppo_objectives.llm.chat.CausalLMTokenLogProbs`) take the same
``temperature`` so that PPO's ratio compares one distribution with itself
(TRL issue #4159). At ``T = 1`` nothing is divided: the numbers are bit for bit
those without a temperature. ``T`` must be a finite number > 0; greedy decoding is
not a temperature (``greedy=True``, or ``ExplorationType.DETERMINISTIC``). There is
no top-k / top-p: a truncated sampler needs the same truncation in every loss-side
read-out (and a sampled token can fall outside the updated policy's truncated set,
a log-prob of ``-inf``), so it is not offered.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from tensordict.nn import (
    InteractionType,
    ProbabilisticTensorDictModule,
    ProbabilisticTensorDictSequential,
    TensorDictModule,
)
from torch import Tensor, nn

from ppo_objectives import _validate
from ppo_objectives.functional import value_checks
from ppo_objectives.llm.models import KVCache, position_ids_from_mask

__all__ = ["NextTokenLogits", "make_actor", "sample_with_kv_cache"]


def check_temperature(temperature: object, where: str = "") -> float:
    """``temperature`` as a float, or an error naming it and the fix (``where`` prefixes the message).

    Example:
        >>> check_temperature(1)
        1.0
        >>> check_temperature(0, "make_actor: ")
        Traceback (most recent call last):
        ...
        ValueError: make_actor: temperature=0 must be a finite number > 0: the logits are divided by it (1.0 ...
    """
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"{where}temperature must be a float > 0 (the sampling temperature), got "
                        f"{type(temperature).__name__}")
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(
            f"{where}temperature={temperature!r} must be a finite number > 0: the logits are divided by it (1.0 "
            f"samples the model's own distribution, below 1 sharpens it, above 1 flattens it). For greedy decoding "
            f"do not use temperature 0: pass greedy=True (sample_with_kv_cache, evaluate) or sample under "
            f"set_exploration_type(ExplorationType.DETERMINISTIC) (make_actor)"
        )
    return float(temperature)


def _tempered(logits: Tensor, temperature: float) -> Tensor:
    """``logits / temperature``: the logits of the distribution sampled at ``temperature`` (``logits`` itself at 1,
    so that no division changes a bit)."""
    return logits if temperature == 1.0 else logits / temperature


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
    greedy: bool = False,
    temperature: float = 1.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """Sample ``max_new_tokens`` tokens per row with the model's own KV cache.

    The loop MiniMind-style trainers run: one prefill over the left-padded
    prompts, then one cached step per token; rows that emitted EOS keep
    stepping but their later tokens are padding (mask False). Only the last
    position's logits are computed at each step (the LM head is applied to one
    hidden state per row), so a large vocabulary costs ``[B, V]`` per step.

    Args:
        model: a :class:`~ppo_objectives.llm.models.TinyCausalLM` (or anything with its cache interface).
        prompt_ids / prompt_mask: ``[B, P]`` left-padded prompts and their mask.
        max_new_tokens: ``R``.
        greedy: take the most likely token instead of sampling (greedy decoding).
        temperature: sample from ``softmax(logits / temperature)``; the returned log-probs are
            those of this distribution (the one sampled). Greedy tokens do not depend on it.

    Returns:
        ``(response_ids [B, R], log_probs [B, R] float32, mask [B, R] bool)``;
        response tokens after EOS are ``pad_id`` with log-prob 0 and mask False.
    """
    temperature = check_temperature(temperature, "sample_with_kv_cache: ")
    B, P = prompt_ids.shape
    device = prompt_ids.device
    cache = model.new_cache(B, P + max_new_tokens, device=device)
    pos = position_ids_from_mask(prompt_mask)
    out = model(prompt_ids, prompt_mask, position_ids=pos, cache=cache, cache_slots=0, compute_logits=False)
    logits = _head_logits(model, out.hidden[:, -1])  # [B, V]
    next_pos = pos[:, -1] + 1  # [B]
    alive = torch.ones(B, dtype=torch.bool, device=device)
    tokens, logps, masks = [], [], []
    for j in range(max_new_tokens):
        logp_all = torch.log_softmax(_tempered(logits, temperature), dim=-1)
        if greedy:
            tok = logp_all.argmax(-1)
        else:
            tok = torch.multinomial(logp_all.exp(), 1, generator=generator).squeeze(-1)  # [B]
        tokens.append(torch.where(alive, tok, pad_id))
        logps.append(torch.where(alive, logp_all.gather(-1, tok[:, None]).squeeze(-1), 0.0))
        masks.append(alive)
        alive = alive & (tok != eos_id)
        if j + 1 < max_new_tokens:
            out = model(tok[:, None], None, position_ids=next_pos[:, None], cache=cache, cache_slots=P + j,
                        compute_logits=False)
            logits = _head_logits(model, out.hidden[:, -1])
            next_pos = next_pos + 1
    return torch.stack(tokens, 1), torch.stack(logps, 1), torch.stack(masks, 1)


# --------------------------------------------------------------------------- #
# The env-facing policy: next-token logits with a per-row KV cache
# --------------------------------------------------------------------------- #


def _param_version(params: list[Tensor]) -> int:
    return sum(p._version for p in params)


def _write_rows(cache: KVCache, rows: Tensor, sub: KVCache) -> None:
    """Write ``sub`` (a cache of ``len(rows)`` rows, filled by a forward of those rows alone) into ``cache``'s
    rows ``rows``."""
    cache.k[:, rows] = sub.k
    cache.v[:, rows] = sub.v
    cache.valid[rows] = sub.valid


@dataclass
class _Prefix:
    """The context of one filled row, kept so that a row filled later whose context starts with the same tokens
    copies these keys and values instead of computing them (a system prompt, a one-shot exchange)."""

    tokens: Tensor  # [n] the row's context tokens at positions 0 .. n-1
    k: Tensor  # [n, L, H, D]
    v: Tensor


def _head_logits(model: nn.Module, hidden: Tensor) -> Tensor:
    """``model.lm_head(hidden)`` in float32, under the model's ``autocast_dtype`` when it has one set
    (hidden states made under autocast need not match the head's parameter dtype)."""
    dtype = getattr(model, "autocast_dtype", None)
    if dtype is None:
        return model.lm_head(hidden).float()
    with torch.autocast(device_type=hidden.device.type, dtype=dtype):
        return model.lm_head(hidden).float()


class NextTokenLogits(nn.Module):
    """Logits of the next token for each env row, from the token buffer.

    Reads the observation of ``TokenLMEnv``: the buffer ``tokens [N, S]``, its
    ``attention_mask [N, S]`` and ``position [N]`` (the column the next token
    goes to), and returns ``logits [N, V]`` (float32) predicted at column
    ``position - 1``. Under ``torch.no_grad()`` it keeps a per-row KV cache
    (module docstring); otherwise, or with extra leading dims, or for a model
    without ``supports_kv_cache``, it runs a full forward. The positions and the
    token ids (against the model's ``vocab_size``) are checked in one host read,
    skipped under :func:`~ppo_objectives.functional.value_checks` ``(False)``.
    With ``temperature=T`` the returned logits are the model's divided by ``T`` (in
    float32; not at all at ``T = 1``): the logits of the distribution to sample.

    Example:
        >>> from ppo_objectives.llm.models import TinyCausalLM, TinyLMConfig
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
    #: Copy the keys and values of context columns that repeat the last filled row's context (a shared system
    #: prompt or one-shot exchange) instead of computing them; False computes every column.
    copy_prefix: bool = True

    def __init__(self, model: nn.Module, *, use_kv_cache: bool = True, value_head: nn.Module | None = None,
                 temperature: float = 1.0):
        super().__init__()
        self.model = model
        self.value_head = value_head
        self.temperature = check_temperature(temperature, "NextTokenLogits: ")
        self.use_kv_cache = bool(use_kv_cache) and getattr(model, "supports_kv_cache", False)
        self.reset_cache()

    def _outputs(self, hidden: Tensor):
        """``logits [N, V]`` of the newest tokens' hidden states ``[N, C]``; with a value head also their
        values ``[N]`` (float32): the value of the state each next token is sampled in."""
        logits = _tempered(_head_logits(self.model, hidden), self.temperature)
        if self.value_head is None:
            return logits
        return logits, self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1).float()

    def reset_cache(self) -> None:
        """Forget the cache (it is rebuilt on the next call)."""
        self._cache: KVCache | None = None
        self._cache_len: Tensor | None = None
        self._cache_tokens: Tensor | None = None
        self._cache_mask: Tensor | None = None
        self._cache_version = -1
        self._cache_autocast: torch.dtype | None = None
        self._params: list[Tensor] | None = None
        self._prefix: _Prefix | None = None

    def __getstate__(self):  # never pickle the cache into collector workers
        state = self.__dict__.copy()
        state.update(
            _cache=None, _cache_len=None, _cache_tokens=None, _cache_mask=None, _cache_version=-1,
            _cache_autocast=None, _params=None, _prefix=None,
        )
        return state

    def forward(self, tokens: Tensor, attention_mask: Tensor, position: Tensor) -> Tensor:
        attention_mask = attention_mask.bool()
        position = position.reshape(tokens.shape[:-1])
        S = tokens.shape[-1]
        if _validate.checking_values() and position.numel():  # one host read for positions and token ids
            lo, hi, t_lo, t_hi = torch.stack([position.min(), position.max(), tokens.min(), tokens.max()]).tolist()
            if lo < 1 or hi > S:
                raise ValueError(
                    f"position holds {lo if lo < 1 else hi}, outside [1, {S}] for a token buffer of S={S} columns: "
                    f"position is the column the next token goes to, after at least one prompt token"
                )
            V = getattr(self.model, "vocab_size", None)
            if t_lo < 0 or (V is not None and t_hi >= V):
                raise ValueError(
                    f"NextTokenLogits: tokens holds token id {t_lo if t_lo < 0 else t_hi}, outside the model's "
                    f"vocabulary [0, vocab_size={V}): the env's vocabulary (TokenLMEnv vocab_size) must fit in the "
                    f"model's; build the model with vocab_size >= env.vocab_size "
                    f"(e.g. TinyLMConfig.preset(..., vocab_size=env.vocab_size))"
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
        if self.value_head is None:
            return _tempered(_head_logits(self.model, h), self.temperature).reshape(*lead, -1)
        logits, value = self._outputs(h)
        return logits.reshape(*lead, -1), value.reshape(lead)

    def _current_cache(self, tokens: Tensor) -> KVCache:
        """The module's cache for this buffer, rebuilt empty when the batch shape, the buffer length,
        the device or the parameter versions changed."""
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
            or self._cache_autocast != getattr(self.model, "autocast_dtype", None)
        ):
            cache = self._cache = self.model.new_cache(N, S, device=tokens.device)
            self._cache_len = torch.full((N,), -1, dtype=torch.long, device=tokens.device)
            self._cache_tokens = self._cache_mask = None
            self._params = list(self.model.parameters())  # re-read on every rebuild
            self._cache_version = _param_version(self._params)
            self._cache_autocast = getattr(self.model, "autocast_dtype", None)
            self._prefix = None  # made by the old weights
        return cache

    def _copyable(self, tokens: Tensor, attention_mask: Tensor, first: Tensor, last: Tensor, stale: Tensor) -> Tensor:
        """``[N]``: how many leading context columns of each stale row (0 for the others) repeat the stored prefix,
        so that :meth:`_prefill` copies them. With no stored prefix, the reference is the first stale row's context
        (filled alone first, it becomes the prefix), whose own count is 0. The context of a row is its attended
        columns from ``first`` (position 0) before its newest token ``last``."""
        if not self.copy_prefix:
            return torch.zeros_like(first)
        N, S = tokens.shape
        ahead = torch.arange(S, device=tokens.device)
        cols = first[:, None] + ahead  # [N, S]: the column of position j, while the context is contiguous
        inside = cols < last[:, None]
        cols = cols.clamp(max=S - 1)
        tok, ok = tokens.gather(1, cols), inside & attention_mask.gather(1, cols)
        if self._prefix is not None:
            n = self._prefix.tokens.numel()  # < S: it came from a buffer of this length
            ref_tok = torch.zeros(S, dtype=tokens.dtype, device=tokens.device)
            ref_tok[:n] = self._prefix.tokens
            ref_ok = ahead < n
        else:
            r0 = stale.int().argmax()
            ref_tok, ref_ok = tok[r0], ok[r0]
        copied = (ok & ref_ok & (tok == ref_tok)).int().cumprod(-1).sum(-1)
        if self._prefix is None:
            stale = stale & (torch.arange(N, device=tokens.device) != r0)
        return torch.where(stale, copied, 0)

    def _prefill(self, cache: KVCache, tokens, attention_mask, pos_ids, stale: Tensor, last: Tensor, first: Tensor,
                 copied: Tensor, any_copied: bool) -> None:
        """Re-fill the cache rows ``stale`` with their context (every column before the newest token): the leading
        columns that repeat the stored prefix (``copied``, from :meth:`_copyable`) are copied from it, the rest run
        in one forward. With no stored prefix and rows to copy, the first stale row is filled alone first and its
        context becomes the prefix; a fill where no row copied anything stores its last row's context instead."""
        rows = stale.nonzero().squeeze(-1)
        if self._prefix is None and any_copied:
            self._fill(cache, tokens, attention_mask, pos_ids, rows[:1], last, first, copied)
            self._keep_prefix(cache, tokens, attention_mask, rows[0], first, last)
            rows = rows[1:]
        self._fill(cache, tokens, attention_mask, pos_ids, rows, last, first, copied)
        if not any_copied and self.copy_prefix:
            self._keep_prefix(cache, tokens, attention_mask, rows[-1], first, last)

    def _fill(self, cache: KVCache, tokens, attention_mask, pos_ids, rows: Tensor, last: Tensor, first: Tensor,
              copied: Tensor) -> None:
        """Fill the cache rows ``rows``: copy their ``copied`` leading context columns from the stored prefix, then
        feed the rest in one forward windowed like :meth:`_catch_up` (the window ends before each row's newest
        token; a row with less to feed recomputes some copied columns, identical values, or starts at column 0
        with the columns past its context masked)."""
        n, S = rows.numel(), tokens.shape[1]
        end, start = last[rows], first[rows]
        sub = self.model.new_cache(n, S, device=tokens.device)
        if self._prefix is not None:
            r, j = (torch.arange(self._prefix.tokens.numel(), device=tokens.device) < copied[rows, None]).nonzero(
                as_tuple=True)  # fmt: skip
            c = start[r] + j
            sub.k[:, r, :, c] = self._prefix.k[j]  # [K, L, H, D]
            sub.v[:, r, :, c] = self._prefix.v[j]
            sub.valid[r, c] = True
            start = start + copied[rows]
        width = max(1, int((end - start).max()))
        slots = (end - width).clamp(min=0)[:, None] + torch.arange(width, device=tokens.device)  # [n, width]
        self.model(
            tokens[rows].gather(1, slots), attention_mask[rows].gather(1, slots) & (slots < end[:, None]),
            position_ids=pos_ids[rows].gather(1, slots), cache=sub, cache_slots=slots, compute_logits=False,
        )  # fmt: skip
        _write_rows(cache, rows, sub)

    def _keep_prefix(self, cache: KVCache, tokens: Tensor, attention_mask: Tensor, row: Tensor, first: Tensor,
                     last: Tensor) -> None:
        """Store row ``row``'s context (its contiguous attended columns from position 0, before its newest token),
        whose keys and values ``cache`` now holds, as the prefix that later rows copy."""
        f, e = torch.stack([first[row], last[row]]).tolist()
        n = int(attention_mask[row, f:e].int().cumprod(0).sum())
        cols = slice(f, f + n)
        self._prefix = None if n == 0 else _Prefix(
            tokens=tokens[row, cols].clone(),
            k=cache.k[:, row, :, cols].permute(2, 0, 1, 3).clone(),
            v=cache.v[:, row, :, cols].permute(2, 0, 1, 3).clone(),
        )  # fmt: skip

    def _catch_up(self, cache: KVCache, tokens, attention_mask, pos_ids, behind: Tensor, last: Tensor) -> None:
        """Feed the rows ``behind`` the columns between their cache's end and their newest token (an environment
        turn), in one windowed forward over those rows: the window ends before each row's newest token, so a row
        with a shorter gap rewrites some cached columns with identical values."""
        rows = behind.nonzero().squeeze(-1)
        width = int((last[rows] - self._cache_len[rows]).max())
        slots = last[rows, None] - width + torch.arange(width, device=tokens.device)  # [n, width], all >= 0
        sub = KVCache(k=cache.k[:, rows], v=cache.v[:, rows], valid=cache.valid[rows])
        self.model(
            tokens[rows].gather(1, slots), attention_mask[rows].gather(1, slots),
            position_ids=pos_ids[rows].gather(1, slots), cache=sub, cache_slots=slots, compute_logits=False,
        )  # fmt: skip
        _write_rows(cache, rows, sub)

    def _cached(self, tokens, attention_mask, position):
        N, S = tokens.shape
        cache = self._current_cache(tokens)
        last = position - 1  # [N] column of the newest token
        cols = torch.arange(S, device=tokens.device)
        # A row is behind when its cache holds a prefix of its tokens that ends before the newest token: a
        # multi-turn env appended its own turn after the row's last token. Its gap is fed, never the whole row.
        stale = self._cache_len > position  # (== position: a finished row stepped again re-feeds its newest token)
        if self._cache_tokens is not None:
            changed = (tokens != self._cache_tokens) | (attention_mask != self._cache_mask)
            stale |= (changed & (cols < self._cache_len[:, None])).any(-1)
        gap = last - self._cache_len  # columns missing before the newest token (an empty cache: all of them)
        stale |= gap > last.min()  # wider than the narrowest row's window, or an empty cache: refill
        behind = ~stale & (gap > 0)
        pos_ids = position_ids_from_mask(attention_mask)  # [N, S]
        first = attention_mask.int().argmax(-1)  # [N] the column of position 0
        copied = self._copyable(tokens, attention_mask, first, last, stale)
        fill = torch.where(stale, last - first - copied, 0).sum()  # the prefill's token count, copies aside
        # One host sync per step: are there stale or behind rows, and can one windowed forward serve all rows?
        # The common case (rows just reset, all at the same prompt end L0, every other row at or
        # beyond it): feed every row its last L0 + 1 columns; fresh rows fill their cache from
        # column 0, the others rewrite L0 cached columns with identical values. One forward, no prefill.
        l0 = torch.where(stale, last, -1).max()
        one_window = (torch.where(stale, last, l0) == l0).all() & (last >= l0).all()
        n_stale, l0, one_window, n_behind, fill, any_copied = torch.stack(
            [stale.sum(), l0, one_window.long(), behind.sum(), fill, copied.max()]
        ).tolist()
        if n_behind:
            self._catch_up(cache, tokens, attention_mask, pos_ids, behind, last)
        # window: N (L0 + 1) tokens in one forward; prefill + step: the stale rows' uncopied context + N, in two
        if n_stale and one_window and N * (l0 + 1) <= self.window_factor * (fill + N):
            slots = last[:, None] - l0 + torch.arange(l0 + 1, device=tokens.device)  # [N, L0 + 1]
            out = self.model(
                tokens.gather(1, slots),
                attention_mask.gather(1, slots),
                position_ids=pos_ids.gather(1, slots),
                cache=cache,
                cache_slots=slots,
                compute_logits=False,
            )
            if self._prefix is None and self.copy_prefix:
                self._keep_prefix(cache, tokens, attention_mask, stale.int().argmax(), first, last)
            self._cache_len = position.clone()
            self._cache_tokens, self._cache_mask = tokens.clone(), attention_mask.clone()
            return self._outputs(out.hidden[:, -1])  # the head on the newest token only
        if n_stale:  # otherwise: prefill the stale rows up to their newest token, then step every row
            self._prefill(cache, tokens, attention_mask, pos_ids, stale, last, first, copied, any_copied > 0)
        x = tokens.gather(1, last[:, None])  # [N, 1]
        out = self.model(
            x,
            attention_mask.gather(1, last[:, None]),
            position_ids=pos_ids.gather(1, last[:, None]),
            cache=cache,
            cache_slots=last[:, None],
            compute_logits=False,
        )
        self._cache_len = position.clone()
        self._cache_tokens, self._cache_mask = tokens.clone(), attention_mask.clone()
        return self._outputs(out.hidden[:, 0])


def make_actor(
    model: nn.Module,
    *,
    use_kv_cache: bool = True,
    tokens_key: str = "tokens",
    attention_mask_key: str = "attention_mask",
    position_key: str = "position",
    action_key: str = "action",
    log_prob_key: str = "sample_log_prob",
    value_head: nn.Module | None = None,
    value_key: str = "state_value",
    temperature: float = 1.0,
) -> ProbabilisticTensorDictSequential:
    """The env policy: ``Categorical(logits=NextTokenLogits(model)(obs) / temperature)``.

    Writes ``logits`` ``[N, V]`` (the model's logits divided by ``temperature``: those of the
    distribution sampled), ``action`` ``[N]`` (a token id) and
    ``sample_log_prob`` ``[N]`` (float32, the log-prob of ``action`` under that distribution;
    read it out for the loss at the same ``temperature``, e.g.
    ``make_actor_critic(..., temperature=)``); with a ``value_head`` (a critic on the same
    trunk) also ``value_key`` ``[N]``, the value of the state the token was sampled in,
    from the same forward. Under
    ``set_exploration_type(ExplorationType.DETERMINISTIC)`` it picks the
    argmax token (greedy decoding); the default (collectors) samples.

    Example:
        >>> from tensordict import TensorDict
        >>> from ppo_objectives.llm.models import TinyCausalLM, TinyLMConfig
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
    temperature = check_temperature(temperature, "make_actor: ")
    logits = TensorDictModule(
        NextTokenLogits(model, use_kv_cache=use_kv_cache, value_head=value_head, temperature=temperature),
        in_keys=[tokens_key, attention_mask_key, position_key],
        out_keys=["logits"] if value_head is None else ["logits", value_key],
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

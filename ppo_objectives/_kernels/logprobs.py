"""Memory-lean log-probabilities (and entropies) of chosen tokens at chosen positions.

Shape letters: ``B`` batch, ``T`` sequence length, ``V`` vocabulary, ``R`` scored positions per
row, ``N = B * R`` scored rows, ``c`` rows per chunk.

For each scored row ``(b, j)`` with ``p = positions[b, j]`` and ``y = targets[b, j]``::

    lse     = logsumexp(logits[b, p, :])                      (float32, float64 for float64 logits)
    logp    = logits[b, p, y] - lse                           = log_softmax(logits[b, p])[y]
    entropy = -sum_v softmax_v * log_softmax_v                = lse - sum_v softmax_v * logits[b, p, v]

The naive ``logits.float().log_softmax(-1).gather(...)`` materialises a ``[B, T, V]`` float32
tensor (twice the size of bf16 logits) and autograd keeps it for the backward. Here a custom
``torch.autograd.Function`` walks the ``N`` scored rows in chunks of ``c``: it copies one chunk
of rows, upcasts it, and keeps only ``lse`` (and the entropy) per row. The backward recomputes
each chunk's softmax from the saved logits and ``lse``::

    d logp / d x_v    = onehot(y)_v - softmax_v
    d entropy / d x_v = -softmax_v * (log_softmax_v + entropy)

and adds the chunk's rows into a zero gradient with ``index_add_`` (repeated positions add up).
Extra memory at any moment is at most three ``[c, V]`` buffers (allocated once, reused by
every chunk, arithmetic in place); the default ``c`` keeps them to about 1/8 of the logits' size (at least ~1 MiB per chunk, so tiny inputs are not split into
single rows). Gradients are first-order only: the backward is marked ``once_differentiable``,
so a double backward raises instead of silently being wrong.

**Sampling temperature.** Both entry points take ``temperature=T``: each upcast chunk ``x`` is
divided by ``T`` in place (``softmax(x / T)``, the distribution a policy sampling at temperature
``T`` draws from) before the reduction, and the backward divides ``d loss / d (x / T)`` by ``T``.
At ``T = 1`` the division is skipped, so the numbers are those without it, bit for bit.

**From hidden states** (:func:`gathered_log_probs_from_hidden`, behind
``functional.response_log_probs_from_hidden``). Starting from logits, the model's head has already
formed ``[B, T, V]`` (5 GB in bf16 at ``B=8, T=2048, V=151936``). The second Function starts one step
earlier, from the hidden states ``h [B, T, C]`` and the head ``W [V, C]`` (``b [V]``): each chunk of
``c`` scored rows is gathered (``h_c = h[rows]``, ``[c, C]``), projected ``x = h_c @ W^T + b`` in the
hidden states' dtype (a bf16 matmul for bf16 inputs), upcast to float32 and reduced as above; only
``lse`` (and the entropy) per row is kept. The backward recomputes ``x``, forms ``g = d loss / d x``
``[c, V]`` with the formulas above, and accumulates in float32::

    grad_h[rows] += g @ W        (index_add_: repeated rows add up)
    grad_W       += g^T @ h_c
    grad_b       += g.sum(0)

cast to each input's dtype at the end. Extra memory at any moment: two ``[c, V]`` float32 buffers
(plus one in the hidden dtype for half precision; ``c`` from :func:`default_hidden_chunk_size`), the
gradients themselves and, for a half-precision head, one ``[V, C]`` product in its dtype per
backward. Unscored (masked) rows are dropped before the projection, so no matmul is spent on them.
Autocast is off inside both passes: the projection dtype is the hidden states' dtype, whatever
the caller's autocast state, so the backward recomputes exactly the forward's logits.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

_BUDGET_FRACTION = 0.125  # chunk working set / logits bytes
_WORK_BUFFERS = 3  # [c, V] float32 buffers alive at once (upcast copy, softmax, a temporary)
_MIN_CHUNK_BYTES = 1 << 20


def default_chunk_size(logits: Tensor, n_rows: int) -> int:
    """Rows per chunk so that the chunk working set stays near 1/8 of ``logits``' size.

    >>> default_chunk_size(torch.empty(8, 1024, 32000), 8 * 1023)
    341
    """
    b, t, v = logits.shape
    work_bytes_per_row = _WORK_BUFFERS * 4 * max(v, 1)
    budget_rows = int(_BUDGET_FRACTION * b * t * logits.element_size() * v // work_bytes_per_row)
    floor_rows = _MIN_CHUNK_BYTES // work_bytes_per_row
    return max(1, min(max(n_rows, 1), max(budget_rows, floor_rows)))


def _compute_dtype(logits: Tensor) -> torch.dtype:
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


class _ChunkBuffers:
    """``[c, V]`` work buffers allocated once and reused by every chunk.

    Reuse matters on CPU, where each fresh multi-megabyte allocation is new pages the kernel
    has to fault in and zero; on CUDA it saves allocator traffic.
    """

    def __init__(self, logits: Tensor, chunk: int, cd: torch.dtype, want_second: bool):
        b, t, v = logits.shape
        self.t = t
        self.flat = logits.reshape(b * t, v) if logits.is_contiguous() else None
        self.logits = logits
        self.x = logits.new_empty((chunk, v), dtype=cd)
        self.second = logits.new_empty((chunk, v), dtype=cd) if want_second else None
        # rows are copied in the logits' dtype first when it differs from the compute dtype
        self.raw = logits.new_empty((chunk, v)) if logits.dtype != cd else None

    def load(self, rows: Tensor) -> Tensor:
        """The selected rows, upcast, in ``self.x[:len(rows)]`` (no full-size copy)."""
        k = rows.numel()
        x = self.x[:k]
        target = self.raw[:k] if self.raw is not None else x
        if self.flat is not None:
            torch.index_select(self.flat, 0, rows, out=target)
        else:  # non-contiguous logits: advanced indexing copies only these rows
            target.copy_(self.logits[rows // self.t, rows % self.t])
        if self.raw is not None:
            x.copy_(target)
        return x


class _GatheredLogProbs(torch.autograd.Function):
    """Chunked ``log_softmax(...).gather`` (+ entropy) with a recomputing backward."""

    @staticmethod
    def forward(ctx, logits, rows, targets, chunk, want_entropy, temperature=1.0):
        # logits [B, T, V]; rows [N] flat row index b * T + p; targets [N]; the softmax is of logits / temperature
        b, t, v = logits.shape
        cd = _compute_dtype(logits)
        n = rows.numel()
        chunk = max(1, min(chunk, n))
        logp = torch.empty(n, dtype=cd, device=logits.device)
        lse = torch.empty(n, dtype=cd, device=logits.device)
        entropy = torch.empty(n, dtype=cd, device=logits.device) if want_entropy else None
        bufs = _ChunkBuffers(logits, chunk, cd, want_second=want_entropy) if n else None
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            x = bufs.load(rows[s:e])  # [c, V] float32
            if temperature != 1.0:
                x.div_(temperature)
            picked = x.gather(-1, targets[s:e, None]).squeeze(-1)
            top = x.amax(dim=-1, keepdim=True)
            shifted = x.sub_(top)  # x - max, in place
            if want_entropy:
                ex = torch.exp(shifted, out=bufs.second[: e - s])
                total = ex.sum(-1)
                # H = lse - sum_v q_v x_v = log(total) - sum_v ex_v (x_v - max) / total
                weighted = ex.mul_(shifted).sum(-1)
                entropy[s:e] = torch.log(total) - weighted / total
            else:
                total = shifted.exp_().sum(-1)
            lse_c = top.squeeze(-1) + torch.log(total)
            lse[s:e] = lse_c
            logp[s:e] = picked - lse_c
        ctx.chunk = chunk
        ctx.temperature = temperature
        ctx.shape = (b, t, v)
        ctx.want_entropy = want_entropy
        ctx.save_for_backward(logits, rows, targets, lse, entropy if want_entropy else lse)
        if want_entropy:
            return logp, entropy
        empty = lse.new_zeros(0)
        ctx.mark_non_differentiable(empty)
        return logp, empty

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logp, grad_entropy):
        logits, rows, targets, lse, entropy = ctx.saved_tensors
        b, t, v = ctx.shape
        cd = lse.dtype
        use_h = ctx.want_entropy and grad_entropy is not None
        if grad_logp is None:
            grad_logp = torch.zeros_like(lse)
        grad = torch.zeros((b * t, v), dtype=logits.dtype, device=logits.device)
        n = rows.numel()
        chunk = ctx.chunk
        bufs = _ChunkBuffers(logits, chunk, cd, want_second=use_h) if n else None
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            gl = grad_logp[s:e, None].to(cd)
            x = bufs.load(rows[s:e])
            if ctx.temperature != 1.0:
                x.div_(ctx.temperature)
            logq = x.sub_(lse[s:e, None])  # log softmax, in place
            if use_h:
                # d/dx = -q * (g_logp + g_H * (log q + H)) (+ g_logp at the target)
                q = torch.exp(logq, out=bufs.second[: e - s])
                gh = grad_entropy[s:e, None].to(cd)
                scale = logq.add_(entropy[s:e, None]).mul_(gh).add_(gl)
                g = q.mul_(scale).neg_()
            else:
                g = logq.exp_().mul_(gl).neg_()  # -q * g_logp (+ g_logp at the target)
            g.scatter_add_(-1, targets[s:e, None], gl)
            if ctx.temperature != 1.0:
                g.div_(ctx.temperature)  # d/d logits = d/d (logits / T) / T
            if bufs.raw is not None:
                g = bufs.raw[: e - s].copy_(g)  # back to the logits' dtype, no new buffer
            grad.index_add_(0, rows[s:e], g)
        return grad.view(b, t, v), None, None, None, None, None


def gathered_log_probs(
    logits: Tensor,
    positions: Tensor,
    targets: Tensor,
    *,
    return_entropy: bool,
    chunk_size: int | None,
    temperature: float = 1.0,
) -> tuple[Tensor, Tensor | None]:
    """``log_softmax(logits[b, positions[b, j]])[targets[b, j]]`` and optionally its entropy.

    Args:
        logits: ``[B, T, V]`` float logits, any float dtype (math in float32, float64 for
            float64 logits).
        positions: ``[B, R]`` int64 positions into ``T``.
        targets: ``[B, R]`` int64 token ids into ``V``.
        return_entropy: also compute the ``[B, R]`` entropies in the same pass.
        chunk_size: scored rows per chunk; ``None`` uses :func:`default_chunk_size`.
        temperature: the distribution is ``softmax(logits / temperature)`` (each upcast chunk is
            divided by it; ``1.0`` skips the division).

    Returns:
        ``(logp [B, R], entropy [B, R] or None)``, float32 (float64 for float64 logits).
        Differentiable once with respect to ``logits``.

    >>> logits = torch.tensor([[[0.0, 0.0], [2.0, 0.0]]])
    >>> logp, ent = gathered_log_probs(logits, torch.tensor([[0, 1]]), torch.tensor([[1, 0]]),
    ...                                return_entropy=True, chunk_size=1)
    >>> logp  # log(1/2), log(e^2 / (e^2 + 1))
    tensor([[-0.6931, -0.1269]])
    >>> ent   # log 2 for the uniform row; -(0.881 ln 0.881 + 0.119 ln 0.119)
    tensor([[0.6931, 0.3653]])
    """
    b, t, v = logits.shape
    r = positions.shape[-1]
    rows = (positions + torch.arange(b, device=positions.device).unsqueeze(1) * t).reshape(-1)
    tgt = targets.reshape(-1)
    chunk = chunk_size if chunk_size is not None else default_chunk_size(logits, rows.numel())
    logp, entropy = _GatheredLogProbs.apply(logits, rows, tgt, chunk, return_entropy, temperature)
    logp = logp.view(b, r)
    return logp, (entropy.view(b, r) if return_entropy else None)


# --------------------------------------------------------------------------- #
# From hidden states: the LM head's projection inside the chunk loop
# --------------------------------------------------------------------------- #

#: Most bytes the ``[c, V]`` chunk buffers of :class:`_HiddenLogProbs` take (the default chunk size).
HIDDEN_CHUNK_BYTES = 256 << 20
_HIDDEN_FRACTION = 0.125  # chunk buffers / logits of the scored rows in the hidden dtype (as _BUDGET_FRACTION)
_MIN_HIDDEN_CHUNK_BYTES = 64 << 20  # every chunk reads the head and updates its [V, C] gradient: keep chunks large


def default_hidden_chunk_size(vocab_size: int, n_rows: int, dtype: torch.dtype) -> int:
    """Rows per chunk: the ``[c, V]`` buffers of one chunk take at most :data:`HIDDEN_CHUNK_BYTES`
    and at most 1/8 of the logits they stand in for (``n_rows x V`` in ``dtype``), at least 64 MiB.

    A chunk holds two ``[c, V]`` buffers in the compute dtype (float32; float64 for float64
    hidden states) and, for half-precision hidden states, one more in their dtype (the matmul's
    output and the backward's ``d logits`` operand). At least 1 row, at most ``n_rows``. Every
    chunk reads the whole head ``[V, C]`` and, in the backward, reads and writes its whole
    gradient, so chunks are kept large while memory allows.

    >>> default_hidden_chunk_size(151936, 8 * 2047, torch.bfloat16)   # 10 bytes a logit, 256 MiB
    176
    >>> default_hidden_chunk_size(151936, 2 * 1023, torch.float32)    # 1/8 of the [2046, V] logits
    127
    >>> default_hidden_chunk_size(100, 5, torch.float32)              # everything in one chunk
    5
    """
    cd = _compute_dtype_of(dtype)
    size = torch.empty((), dtype=dtype).element_size()
    per_logit = 2 * torch.empty((), dtype=cd).element_size() + (size if dtype != cd else 0)
    per_row = per_logit * max(vocab_size, 1)
    rows = max(int(_HIDDEN_FRACTION * n_rows * size * max(vocab_size, 1)), _MIN_HIDDEN_CHUNK_BYTES) // per_row
    rows = min(rows, HIDDEN_CHUNK_BYTES // per_row)
    return max(1, min(max(n_rows, 1), rows))


def _compute_dtype_of(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class _HeadChunks:
    """One pass over the scored rows: the flat hidden states, the head in the projection dtype
    (the hidden states' dtype; cast once per pass, not saved) and ``[c, V]`` buffers reused by
    every chunk."""

    def __init__(self, hidden: Tensor, weight: Tensor, bias: Tensor | None, chunk: int, want_second: bool,
                 temperature: float = 1.0):
        pd = hidden.dtype
        self.temperature = temperature
        self.cd = _compute_dtype_of(pd)
        self.flat = hidden.reshape(-1, hidden.shape[-1])  # [B * T, C]
        self.w = weight.to(pd)  # [V, C]
        self.b = None if bias is None else bias.to(pd)  # [V]
        v = weight.shape[0]
        self.x = hidden.new_empty((chunk, v), dtype=self.cd)
        self.second = hidden.new_empty((chunk, v), dtype=self.cd) if want_second else None
        self.raw = hidden.new_empty((chunk, v)) if pd != self.cd else None  # the matmul's own dtype

    def logits(self, rows: Tensor) -> tuple[Tensor, Tensor]:
        """``(x [k, V] compute dtype, h [k, C])``: ``x = (h @ W^T (+ b)) / temperature`` for ``h = hidden[rows]``
        (the division in the compute dtype, skipped at temperature 1)."""
        k = rows.numel()
        h = self.flat.index_select(0, rows)
        x = self.x[:k]
        target = x if self.raw is None else self.raw[:k]
        if self.b is None:
            torch.mm(h, self.w.t(), out=target)
        else:
            torch.addmm(self.b, h, self.w.t(), out=target)
        if self.raw is not None:
            x.copy_(target)
        if self.temperature != 1.0:
            x.div_(self.temperature)
        return x, h

    def operand(self, g: Tensor) -> Tensor:
        """``g`` in the projection dtype (a reused buffer for half precision)."""
        return g if self.raw is None else self.raw[: g.shape[0]].copy_(g)


def _lse_pass(bufs: _HeadChunks, rows: Tensor, targets: Tensor, chunk: int, want_entropy: bool):
    """``(logp, lse, entropy | None)`` ``[N]`` of every scored row, chunk by chunk."""
    n = rows.numel()
    logp = torch.empty(n, dtype=bufs.cd, device=rows.device)
    lse = torch.empty_like(logp)
    entropy = torch.empty_like(logp) if want_entropy else None
    for s in range(0, n, chunk):
        e = min(s + chunk, n)
        x, _ = bufs.logits(rows[s:e])  # [c, V]
        picked = x.gather(-1, targets[s:e, None]).squeeze(-1)
        top = x.amax(dim=-1, keepdim=True)
        shifted = x.sub_(top)
        if want_entropy:
            ex = torch.exp(shifted, out=bufs.second[: e - s])
            total = ex.sum(-1)
            entropy[s:e] = torch.log(total) - ex.mul_(shifted).sum(-1) / total
        else:
            total = shifted.exp_().sum(-1)
        lse[s:e] = top.squeeze(-1) + torch.log(total)
        logp[s:e] = picked - lse[s:e]
    return logp, lse, entropy


class _HiddenLogProbs(torch.autograd.Function):
    """Chunked ``log_softmax(hidden[rows] @ W^T + b).gather`` (+ entropy) with a recomputing backward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, rows, targets, chunk, want_entropy, temperature=1.0):
        # hidden [B, T, C]; weight [V, C]; bias [V] | None; rows [N] flat b * T + p; targets [N]
        n = rows.numel()
        chunk = max(1, min(chunk, n))
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            bufs = _HeadChunks(hidden, weight, bias, chunk if n else 0, want_second=want_entropy,
                               temperature=temperature)
            logp, lse, entropy = _lse_pass(bufs, rows, targets, chunk, want_entropy)
        del bufs
        ctx.chunk, ctx.want_entropy, ctx.temperature = chunk, want_entropy, temperature
        ctx.set_materialize_grads(False)  # an unused output (a detached entropy) costs no backward work
        ctx.save_for_backward(hidden, weight, bias, rows, targets, lse, entropy)
        if want_entropy:
            return logp, entropy
        empty = lse.new_zeros(0)
        ctx.mark_non_differentiable(empty)
        return logp, empty

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, rows, targets, lse, entropy = ctx.saved_tensors
        if not ctx.want_entropy:
            grad_entropy = None
        if grad_logp is None and grad_entropy is None:
            return (None,) * 8
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            grads = _head_backward(
                hidden, weight, bias, rows, targets, lse, entropy, grad_logp, grad_entropy, ctx.chunk,
                (need_h, need_w, need_b and bias is not None), ctx.temperature,
            )  # fmt: skip
        return (*grads, None, None, None, None, None)


def _head_backward(hidden, weight, bias, rows, targets, lse, entropy, grad_logp, grad_entropy, chunk, needs,
                   temperature=1.0):
    """``(grad_hidden, grad_weight, grad_bias)`` (``None`` where not needed), accumulated in the
    compute dtype over the chunks and returned in each input's dtype."""
    need_h, need_w, need_b = needs
    n = rows.numel()
    use_h = grad_entropy is not None
    bufs = _HeadChunks(hidden, weight, bias, chunk if n else 0, want_second=use_h, temperature=temperature)
    cd = bufs.cd
    if grad_logp is None:
        grad_logp = torch.zeros_like(lse)
    acc_h = torch.zeros(bufs.flat.shape, dtype=cd, device=hidden.device) if need_h else None  # [B * T, C]
    acc_w = torch.zeros(weight.shape, dtype=cd, device=weight.device) if need_w else None  # [V, C]
    acc_b = torch.zeros(weight.shape[0], dtype=cd, device=weight.device) if need_b else None  # [V]
    half_w = need_w and bufs.raw is not None
    w_part = torch.empty(weight.shape, dtype=hidden.dtype, device=weight.device) if half_w and n else None
    for s in range(0, n, chunk):
        e = min(s + chunk, n)
        x, h = bufs.logits(rows[s:e])
        gl = grad_logp[s:e, None].to(cd)
        logq = x.sub_(lse[s:e, None])  # log softmax, in place
        if use_h:  # d/dx = -q * (g_logp + g_H * (log q + H)) (+ g_logp at the target)
            q = torch.exp(logq, out=bufs.second[: e - s])
            scale = logq.add_(entropy[s:e, None]).mul_(grad_entropy[s:e, None].to(cd)).add_(gl)
            g = q.mul_(scale).neg_()
        else:
            g = logq.exp_().mul_(gl).neg_()
        g.scatter_add_(-1, targets[s:e, None], gl)  # [c, V] d loss / d (logits / T)
        if temperature != 1.0:
            g.div_(temperature)  # d loss / d logits
        if acc_b is not None:
            acc_b.add_(g.sum(0))
        gp = bufs.operand(g)  # in the projection dtype
        if acc_h is not None:
            acc_h.index_add_(0, rows[s:e], (gp @ bufs.w).to(cd))  # repeated rows add up
        if half_w:
            acc_w.add_(torch.mm(gp.t(), h, out=w_part))
        elif acc_w is not None:
            acc_w.addmm_(gp.t(), h)
    grad_h = None if acc_h is None else acc_h.view(hidden.shape).to(hidden.dtype)
    grad_w = None if acc_w is None else acc_w.to(weight.dtype)
    grad_b = None if acc_b is None else acc_b.to(bias.dtype)
    return grad_h, grad_w, grad_b


def gathered_log_probs_from_hidden(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    positions: Tensor,
    targets: Tensor,
    mask: Tensor | None,
    *,
    return_entropy: bool,
    chunk_size: int | None,
    temperature: float = 1.0,
) -> tuple[Tensor, Tensor | None]:
    """``log_softmax(hidden[b, positions[b, j]] @ weight^T + bias)[targets[b, j]]`` (+ entropy), never
    forming the ``[B, T, V]`` logits; exactly 0 (zero gradient) where ``mask`` is False.

    Args:
        hidden: ``[B, T, C]`` float hidden states; the projection runs in their dtype.
        weight: ``[V, C]`` float head weight (cast to ``hidden``'s dtype for the projection).
        bias: ``[V]`` float head bias or ``None``.
        positions: ``[B, R]`` int64 positions into ``T``.
        targets: ``[B, R]`` int64 token ids into ``V`` (read only where ``mask`` is True).
        mask: ``[B, R]`` bool or ``None``; rows where it is False are not projected. Selecting the
            scored rows reads the mask (one host synchronisation); ``None`` scores every row
            without one.
        return_entropy: also compute the ``[B, R]`` entropies in the same pass.
        chunk_size: scored rows per chunk; ``None`` uses :func:`default_hidden_chunk_size`.
        temperature: the distribution is ``softmax((hidden @ weight^T + bias) / temperature)`` (each
            projected chunk is divided by it in the compute dtype; ``1.0`` skips the division).

    Returns:
        ``(logp [B, R], entropy [B, R] or None)``, float32 (float64 for float64 hidden states).
        Differentiable once with respect to ``hidden``, ``weight`` and ``bias``.

    >>> hidden = torch.tensor([[[0.0, 0.0], [1.0, 0.0]]])   # [1, 2, 2]
    >>> weight = torch.tensor([[2.0, 0.0], [0.0, 0.0]])      # logits [0, 0] and [2, 0]
    >>> logp, ent = gathered_log_probs_from_hidden(
    ...     hidden, weight, None, torch.tensor([[0, 1]]), torch.tensor([[1, 0]]), None,
    ...     return_entropy=True, chunk_size=1)
    >>> logp  # log(1/2), log(e^2 / (e^2 + 1))
    tensor([[-0.6931, -0.1269]])
    >>> ent
    tensor([[0.6931, 0.3653]])
    """
    b, t, _ = hidden.shape
    r = positions.shape[-1]
    rows = (positions + torch.arange(b, device=positions.device).unsqueeze(1) * t).reshape(-1)
    tgt = targets.reshape(-1)
    keep = None
    if mask is not None:
        keep = mask.reshape(-1).nonzero().squeeze(1)  # the scored rows: masked ones are never projected
        rows, tgt = rows[keep], tgt[keep]
    if chunk_size is None:
        chunk_size = default_hidden_chunk_size(weight.shape[0], rows.numel(), hidden.dtype)
    logp, entropy = _HiddenLogProbs.apply(hidden, weight, bias, rows, tgt, chunk_size, return_entropy, temperature)
    if keep is not None:
        logp = logp.new_zeros(b * r).index_copy(0, keep, logp)
        if return_entropy:
            entropy = entropy.new_zeros(b * r).index_copy(0, keep, entropy)
    return logp.view(b, r), (entropy.view(b, r) if return_entropy else None)

"""Chunked log-probs / entropies of chosen tokens against the testing kit's float64 per-position reference."""

from __future__ import annotations

import pytest
import torch

from ppo_objectives._kernels.logprobs import default_chunk_size, gathered_log_probs
from ppo_objectives.functional import response_log_probs
from ppo_objectives.testing import reference_log_probs, reference_response_log_probs


def reference_at(logits, positions, targets):
    """The kit's float64 reference on the rows ``logits[b, positions[b, j]]``: ``(log-probs, entropies)``."""
    rows = logits[torch.arange(logits.shape[0], device=logits.device)[:, None], positions]  # [B, R, V]
    return reference_log_probs(rows, targets, return_entropy=True)


def make(b=2, t=9, v=11, r=5, dtype=torch.float32, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(b, t, v, generator=gen, dtype=torch.float64)).to(dtype)
    positions = torch.stack([torch.randperm(t, generator=gen)[:r] for _ in range(b)])
    targets = torch.randint(0, v, (b, r), generator=gen)
    return logits.to(device), positions.to(device), targets.to(device)


TOL = {torch.float64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 2e-6, torch.float16: 2e-6}


@pytest.mark.parametrize("chunk_size", [1, 3, None, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_log_probs_and_entropy_match_naive_for_every_chunk_size(dtype, chunk_size, device):
    logits, pos, tgt = make(dtype=dtype, device=device)
    logp, ent = gathered_log_probs(logits, pos, tgt, return_entropy=True, chunk_size=chunk_size)
    # the reference sees the same (rounded) half-precision logits, upcast
    ref_logp, ref_ent = reference_at(logits.cpu(), pos.cpu(), tgt.cpu())
    expected_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    assert logp.dtype == ent.dtype == expected_dtype and logp.shape == pos.shape
    torch.testing.assert_close(logp.cpu().double(), ref_logp, rtol=TOL[dtype], atol=TOL[dtype] * 10)
    torch.testing.assert_close(ent.cpu().double(), ref_ent, rtol=TOL[dtype], atol=TOL[dtype] * 10)


def test_entropy_is_skipped_when_not_asked():
    logits, pos, tgt = make()
    logp, ent = gathered_log_probs(logits, pos, tgt, return_entropy=False, chunk_size=2)
    assert ent is None
    torch.testing.assert_close(logp.double(), reference_at(logits, pos, tgt)[0], rtol=2e-6, atol=2e-5)


def test_uniform_logits_golden_case():
    # V = 4 equal logits: log p = log(1/4) = -1.3863, entropy = log 4 = 1.3863
    logits = torch.zeros(1, 3, 4)
    logp, ent = gathered_log_probs(
        logits, torch.tensor([[0, 2]]), torch.tensor([[3, 1]]), return_entropy=True, chunk_size=1
    )
    torch.testing.assert_close(logp, torch.full((1, 2), -1.3862944))
    torch.testing.assert_close(ent, torch.full((1, 2), 1.3862944))


@pytest.mark.parametrize("return_entropy", [False, True])
@pytest.mark.parametrize("chunk_size", [1, 4, None])
def test_backward_passes_gradcheck_in_float64(return_entropy, chunk_size):
    logits, pos, tgt = make(b=2, t=6, v=5, r=4, dtype=torch.float64, seed=1)
    logits.requires_grad_()

    def f(x):
        logp, ent = gathered_log_probs(x, pos, tgt, return_entropy=return_entropy, chunk_size=chunk_size)
        return (logp, ent) if return_entropy else logp

    assert torch.autograd.gradcheck(f, (logits,))


def test_backward_through_entropy_alone_and_repeated_positions_gradcheck():
    # position 2 is scored twice in row 0: its gradient rows add up (index_add_)
    logits, _, tgt = make(b=2, t=5, v=6, r=3, dtype=torch.float64, seed=2)
    pos = torch.tensor([[2, 2, 0], [4, 1, 3]])
    logits.requires_grad_()

    def f(x):
        return gathered_log_probs(x, pos, tgt, return_entropy=True, chunk_size=2)[1]

    assert torch.autograd.gradcheck(f, (logits,))


def test_gradient_matches_naive_autograd_for_bf16_logits():
    logits, pos, tgt = make(b=2, t=8, v=13, r=6, dtype=torch.bfloat16, seed=3)
    w = torch.randn(2, 6, dtype=torch.float64)
    a = logits.clone().requires_grad_()
    logp, ent = gathered_log_probs(a, pos, tgt, return_entropy=True, chunk_size=3)
    ((logp * w).sum() + (ent * w).sum()).backward()
    b = logits.double().requires_grad_()
    ref_logp, ref_ent = reference_at(b, pos, tgt)
    ((ref_logp * w).sum() + (ref_ent * w).sum()).backward()
    assert a.grad.dtype == torch.bfloat16
    torch.testing.assert_close(a.grad.double(), b.grad, rtol=1e-2, atol=1e-2)  # bf16 gradient rounding


def test_non_contiguous_logits_give_the_same_values_and_gradients():
    logits, pos, tgt = make(b=3, t=7, v=9, r=4, dtype=torch.float64, seed=4)
    strided = logits.transpose(0, 1).contiguous().transpose(0, 1).requires_grad_()
    assert not strided.is_contiguous()
    assert torch.autograd.gradcheck(
        lambda x: gathered_log_probs(x, pos, tgt, return_entropy=True, chunk_size=5), (strided,)
    )
    out = gathered_log_probs(strided, pos, tgt, return_entropy=False, chunk_size=5)[0]
    torch.testing.assert_close(out, reference_at(logits, pos, tgt)[0])


def test_double_backward_raises_instead_of_being_wrong():
    logits, pos, tgt = make(dtype=torch.float64)
    logits.requires_grad_()
    weights = torch.ones(pos.shape, dtype=torch.float64, requires_grad=True)
    logp, _ = gathered_log_probs(logits, pos, tgt, return_entropy=False, chunk_size=2)
    (g,) = torch.autograd.grad((logp * weights).sum(), logits, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        g.sum().backward()


def test_response_log_probs_uses_the_chunked_path_equal_to_naive():
    # prompt_lens [3, 1], R = 4: positions p = P - 1 + j score input_ids[p + 1]
    logits, _, _ = make(b=2, t=8, v=10, r=1, seed=5)
    ids = torch.randint(0, 10, (2, 8), generator=torch.Generator().manual_seed(5))
    prompt = torch.tensor([3, 1])
    logp, ent = response_log_probs(logits, ids, prompt, 4, return_entropy=True, chunk_size=3)
    ref_logp, ref_ent = reference_response_log_probs(logits, ids, prompt, 4, return_entropy=True)
    torch.testing.assert_close(logp.double(), ref_logp, rtol=2e-6, atol=2e-5)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=2e-6, atol=2e-5)


def test_default_chunk_size_keeps_the_working_set_near_an_eighth_of_the_logits():
    logits = torch.empty(8, 1024, 32000)
    c = default_chunk_size(logits, 8 * 1023)
    working_set = 3 * c * 32000 * 4  # three float32 [c, V] buffers
    assert 0.1 <= working_set / (logits.numel() * 4) <= 0.13
    # tiny inputs are not split below ~1 MiB chunks, and never beyond the rows there are
    assert default_chunk_size(torch.empty(1, 4, 10), 3) == 3
    assert default_chunk_size(torch.empty(1, 1, 1), 0) == 1


def _cpu_peak_bytes(fn):
    """Peak of the running sum of every allocation / free the profiler saw while ``fn`` ran."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    sizes = []

    def walk(node):
        if node.tag == _EventType.Allocation:
            sizes.append((node.start_time_ns, node.extra_fields.alloc_size))
        for child in node.children:
            walk(child)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    running = peak = 0
    for _, size in sorted(sizes):
        running += size
        peak = max(peak, running)
    return peak


@pytest.mark.filterwarnings("ignore::UserWarning")  # the profiler may warn about its own set-up
def test_forward_and_backward_peak_memory_stays_under_a_quarter_of_the_logits():
    # [4, 512, 4000] float32 logits = 32 MB; the naive float32 log-softmax alone would be 32 MB
    logits, _, _ = make(b=4, t=512, v=4000, r=1, seed=6)
    pos = torch.arange(511).expand(4, 511)
    tgt = torch.randint(0, 4000, (4, 511))
    logits.requires_grad_()
    size = logits.numel() * logits.element_size()

    def step():
        logp, ent = gathered_log_probs(logits, pos, tgt, return_entropy=True, chunk_size=None)
        (logp.sum() + ent.sum()).backward()

    peak = _cpu_peak_bytes(step)
    extra = peak - size  # the gradient of the logits is an output, as large as the logits
    assert extra <= 0.25 * size, f"peak extra {extra / size:.3f}x of the logits"

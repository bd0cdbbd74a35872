"""Log-probs and entropies from hidden states (the LM head inside the chunk loop) against the testing
kit's float64 per-position reference on ``hidden @ W.T + b``, and the read-outs' hidden path against
their logits path.

bf16 tolerance (``test_bf16_inputs_match_the_float32_path_within_the_logit_rounding``): the bf16
path rounds each logit to bf16 (8 significant bits, a relative rounding of at most ``2**-9``)
before the float32 log-softmax, as the model's own bf16 head does, so a log-prob (a logit minus
the log-sum-exp) can move by up to about ``2 * 2**-9 * max|logit|``. Measured on that test's inputs
over seeds 0-4 (``max|logit|`` 17 to 22): log-probs within 0.051 of the float32 path, entropies
within 0.023, every gradient within 0.0085 of the largest entry of the float32 gradient. Bounds:
``0.01 + 0.005 * max|logit|`` (about 0.1 there) for values, 0.03 (relative to the largest entry)
for gradients.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from ppo_objectives._kernels.logprobs import default_hidden_chunk_size, gathered_log_probs_from_hidden
from ppo_objectives.functional import response_log_probs_from_hidden, value_checks
from ppo_objectives.llm.chat import CausalLMTokenLogProbs
from ppo_objectives.llm.hf import HFCausalLMAdapter
from ppo_objectives.llm.models import LMOutput, TinyCausalLM, TinyLMConfig
from ppo_objectives.llm.readouts import (
    FROM_HIDDEN_MIN_VOCAB,
    ResponseLogProbs,
    lm_head_parameters,
    make_actor_critic,
    read_log_probs,
)
from ppo_objectives.testing import reference_log_probs, reference_response_log_probs

# ----------------------------------------------------------------------------- references


def reference_from_hidden(hidden, weight, bias, input_ids, prompt_lens, R, mask=None):
    """The float64 logits ``hidden @ W.T + b`` read by the kit's reference (``reference_response_log_probs``)."""
    logits = hidden.double() @ weight.double().T
    if bias is not None:
        logits = logits + bias.double()
    logp, entropy = reference_response_log_probs(logits, input_ids, prompt_lens, R, return_entropy=True)
    if mask is not None:
        logp, entropy = torch.where(mask, logp, 0.0), torch.where(mask, entropy, 0.0)
    return logp, entropy


def make(b=2, t=9, c=5, v=11, r=4, dtype=torch.float32, bias=True, seed=0, device="cpu"):
    """``(hidden, weight, bias | None, input_ids, prompt_lens)`` on ``device``, drawn on the CPU (the same on any device)."""
    gen = torch.Generator().manual_seed(seed)
    to = dict(device=device, dtype=dtype)
    hidden = torch.randn(b, t, c, generator=gen, dtype=torch.float64).to(**to)
    weight = torch.randn(v, c, generator=gen, dtype=torch.float64).to(**to)
    b_ = torch.randn(v, generator=gen, dtype=torch.float64).to(**to) if bias else None
    ids = torch.randint(0, v, (b, t), generator=gen).to(device)
    prompt_lens = torch.randint(1, t - r + 1, (b,), generator=gen).to(device)
    return hidden, weight, b_, ids, prompt_lens


def grads_of(fn, tensors, entropy_weight=0.3, seed=1):
    """Values and gradients of ``sum(cot_lp * logp) + sum(cot_h * entropy)`` for random cotangents."""
    leaves = [x.detach().clone().requires_grad_() if x is not None else None for x in tensors]
    logp, ent = fn(*leaves)
    gen = torch.Generator().manual_seed(seed)
    cot = torch.randn(logp.shape, generator=gen, dtype=torch.float64).to(logp.device)
    loss = (cot.to(logp.dtype) * logp).sum()
    if ent is not None:
        loss = loss + entropy_weight * (cot.flip(-1).to(ent.dtype) * ent).sum()
    loss.backward()
    return (logp.detach(), None if ent is None else ent.detach()), [None if x is None else x.grad for x in leaves]


def ours(ids, prompt_lens, R, mask=None, entropy=True, chunk_size=None):
    def fn(hidden, weight, bias):
        out = response_log_probs_from_hidden(
            hidden, weight, ids, prompt_lens, R, lm_head_bias=bias, mask=mask, return_entropy=entropy,
            chunk_size=chunk_size,
        )  # fmt: skip
        return out if entropy else (out, None)

    return fn


def reference(ids, prompt_lens, R, mask=None, entropy=True):
    def fn(hidden, weight, bias):
        logp, ent = reference_from_hidden(hidden, weight, bias, ids, prompt_lens, R, mask)
        return logp, (ent if entropy else None)

    return fn


def assert_close_all(got, want, tol):
    for a, b in zip(got, want):
        if a is None or b is None:
            assert a is None and b is None
            continue
        torch.testing.assert_close(a.double(), b.double(), rtol=tol, atol=tol)


# ----------------------------------------------------------------------------- the function


SHAPES = [(1, 4, 3, 7, 3), (3, 9, 5, 33, 5), (2, 6, 8, 130, 4)]  # B, T, C, V, R


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("entropy", [False, True])
@pytest.mark.parametrize("chunk_size", [1, 3, None, 10**6])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}T{}C{}V{}R{}".format(*s))
def test_values_and_gradients_match_the_naive_float64_path(shape, chunk_size, entropy, bias, device):
    b, t, c, v, r = shape
    hidden, weight, b_, ids, pl = make(b, t, c, v, r, bias=bias, seed=sum(shape), device=device)
    (got, g_got) = grads_of(ours(ids, pl, r, entropy=entropy, chunk_size=chunk_size), (hidden, weight, b_))
    (want, g_want) = grads_of(reference(ids, pl, r, entropy=entropy), (hidden, weight, b_))
    assert got[0].dtype == torch.float32 and got[0].shape == (b, r)
    assert_close_all(got, want, 1e-5)
    assert_close_all(g_got, g_want, 1e-5)


def test_float64_inputs_give_float64_results_at_float64_precision():
    hidden, weight, b_, ids, pl = make(3, 9, 5, 33, 5, dtype=torch.float64)
    got, g_got = grads_of(ours(ids, pl, 5, chunk_size=2), (hidden, weight, b_))
    want, g_want = grads_of(reference(ids, pl, 5), (hidden, weight, b_))
    assert got[0].dtype == got[1].dtype == torch.float64
    assert all(g.dtype == torch.float64 for g in g_got)
    assert_close_all(got, want, 1e-12)
    assert_close_all(g_got, g_want, 1e-12)


def test_masked_positions_are_zero_with_zero_gradient_and_garbage_there_changes_nothing():
    b, t, c, v, r = 3, 10, 4, 17, 6
    hidden, weight, b_, ids, pl = make(b, t, c, v, r)
    mask = torch.rand(b, r, generator=torch.Generator().manual_seed(3)) > 0.4
    mask[0] = False  # one row with nothing to score
    got, g_got = grads_of(ours(ids, pl, r, mask=mask, chunk_size=2), (hidden, weight, b_))
    want, g_want = grads_of(reference(ids, pl, r, mask=mask), (hidden, weight, b_))
    assert_close_all(got, want, 1e-5)
    assert_close_all(g_got, g_want, 1e-5)
    assert (got[0][~mask] == 0).all() and (got[1][~mask] == 0).all()
    # the hidden rows read by masked tokens get exactly zero gradient
    pos = pl[:, None] - 1 + torch.arange(r)
    bi = torch.arange(b)[:, None].expand(b, r)
    assert (g_got[0][bi[~mask], pos[~mask]] == 0).all()
    # garbage (NaN hidden states, out-of-vocabulary ids) at masked positions changes nothing
    dirty_h, dirty_ids = hidden.clone(), ids.clone()
    dirty_h[bi[~mask], pos[~mask]] = float("nan")
    dirty_ids[bi[~mask], pos[~mask] + 1] = v + 100
    dirty, g_dirty = grads_of(ours(dirty_ids, pl, r, mask=mask, chunk_size=2), (dirty_h, weight, b_))
    assert all(torch.equal(x, y) for x, y in zip(dirty, got))
    assert torch.equal(g_dirty[1], g_got[1]) and torch.equal(g_dirty[2], g_got[2])
    assert torch.equal(g_dirty[0], g_got[0])


def test_an_empty_mask_gives_zeros_and_zero_gradients():
    hidden, weight, b_, ids, pl = make()
    mask = torch.zeros(2, 4, dtype=torch.bool)
    (lp, ent), grads = grads_of(ours(ids, pl, 4, mask=mask), (hidden, weight, b_))
    assert (lp == 0).all() and (ent == 0).all()
    assert all((g == 0).all() for g in grads)


def test_masked_rows_are_not_projected():
    # the forward's matmul FLOPs are 2 * (scored rows) * C * V: masked tokens cost no projection
    b, t, c, v, r = 2, 12, 8, 64, 8
    hidden, weight, _, ids, _ = make(b, t, c, v, r, bias=False)
    pl = torch.tensor([1, 3])
    mask = torch.zeros(b, r, dtype=torch.bool)
    mask[0, :5] = True
    mask[1, :2] = True
    counter = FlopCounterMode(display=False)
    with counter:
        response_log_probs_from_hidden(hidden, weight, ids, pl, r, mask=mask, chunk_size=3)
    assert counter.get_total_flops() == 2 * 7 * c * v


def test_repeated_rows_add_their_gradients():
    # the same position scored several times (with different targets): gradients add up
    hidden, weight, b_, _, _ = make(2, 5, 4, 9, 1)
    positions = torch.tensor([[1, 1, 3, 1], [0, 4, 4, 2]])
    targets = torch.tensor([[2, 2, 7, 0], [8, 1, 3, 3]])

    def fn(h, w, b):
        return gathered_log_probs_from_hidden(h, w, b, positions, targets, None, return_entropy=True, chunk_size=3)

    def ref(h, w, b):
        rows = (h.double() @ w.double().T + b.double())[torch.arange(2)[:, None], positions]
        return reference_log_probs(rows, targets, return_entropy=True)

    got, g_got = grads_of(fn, (hidden, weight, b_))
    want, g_want = grads_of(ref, (hidden, weight, b_))
    assert_close_all(got, want, 1e-5)
    assert_close_all(g_got, g_want, 1e-5)


def test_tied_weights_get_the_naive_gradient():
    # hidden states computed from the head weight itself (an embedding tied to the head)
    gen = torch.Generator().manual_seed(5)
    w0 = torch.randn(13, 4, generator=gen)
    ids = torch.randint(0, 13, (2, 7), generator=gen)
    pl = torch.tensor([2, 3])

    def run(score):
        w = w0.clone().requires_grad_()
        hidden = torch.tanh(w[ids] * 1.5)  # [B, T, C] from the embedding
        logp, ent = score(hidden, w)
        (logp.sum() + 0.5 * ent.sum()).backward()
        return logp.detach(), w.grad

    got = run(lambda h, w: response_log_probs_from_hidden(h, w, ids, pl, 4, return_entropy=True, chunk_size=3))
    want = run(lambda h, w: reference_from_hidden(h, w, None, ids, pl, 4))
    torch.testing.assert_close(got[0].double(), want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1].double(), want[1].double(), rtol=1e-5, atol=1e-5)


def test_bf16_inputs_match_the_float32_path_within_the_logit_rounding(device):
    b, t, c, v, r = 3, 12, 16, 300, 8
    hidden, weight, b_, ids, pl = make(b, t, c, v, r, dtype=torch.float64, device=device)
    hidden, weight, b_ = hidden.bfloat16(), weight.bfloat16(), b_.bfloat16()
    got, g_got = grads_of(ours(ids, pl, r, chunk_size=5), (hidden, weight, b_))
    # the float32 path on the same (bf16-representable) inputs
    want, g_want = grads_of(ours(ids, pl, r, chunk_size=5), (hidden.float(), weight.float(), b_.float()))
    assert got[0].dtype == got[1].dtype == torch.float32
    assert [g.dtype for g in g_got] == [torch.bfloat16] * 3
    max_logit = float((hidden.float() @ weight.float().T + b_.float()).abs().max())
    bound = 0.01 + 0.005 * max_logit  # module docstring: twice the bf16 rounding of the largest logit
    for a, w in zip(got, want):
        assert float((a - w).abs().max()) <= bound
    for a, w in zip(g_got, g_want):
        assert float((a.float() - w).abs().max()) <= 0.03 * float(w.abs().max())


def test_half_precision_hidden_states_with_a_float32_head_return_float32_head_gradients():
    # hidden states that come back from an autocast forward in bf16, head parameters in float32
    hidden, weight, b_, ids, pl = make(2, 9, 8, 40, 4)
    hidden = hidden.bfloat16()
    got, g_got = grads_of(ours(ids, pl, 4, chunk_size=3), (hidden, weight, b_))
    want, g_want = grads_of(ours(ids, pl, 4, chunk_size=3), (hidden, weight.bfloat16(), b_.bfloat16()))
    assert [g.dtype for g in g_got] == [torch.bfloat16, torch.float32, torch.float32]
    assert_close_all(got, want, 1e-6)  # the projection runs in bf16 either way
    torch.testing.assert_close(g_got[1].bfloat16(), g_want[1], rtol=0.02, atol=0.02)


def test_only_the_entropy_gradient_is_used_when_the_log_probs_are_unused():
    hidden, weight, b_, ids, pl = make(2, 9, 5, 20, 4)

    def entropy_only(score):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        score(h, w)[1].sum().backward()
        return h.grad, w.grad

    got = entropy_only(lambda h, w: response_log_probs_from_hidden(h, w, ids, pl, 4, return_entropy=True))
    want = entropy_only(lambda h, w: reference_from_hidden(h, w, None, ids, pl, 4))
    assert_close_all(got, want, 1e-5)


def test_gradcheck_in_float64_and_double_backward_raises():
    hidden, weight, b_, ids, pl = make(2, 6, 3, 7, 3, dtype=torch.float64)
    inputs = tuple(x.requires_grad_() for x in (hidden, weight, b_))
    mask = torch.tensor([[True, False, True], [True, True, True]])

    def f(h, w, b):
        return response_log_probs_from_hidden(h, w, ids, pl, 3, lm_head_bias=b, mask=mask, return_entropy=True,
                                              chunk_size=2)  # fmt: skip

    assert torch.autograd.gradcheck(f, inputs)
    weights = torch.ones(2, 3, dtype=torch.float64, requires_grad=True)
    (g,) = torch.autograd.grad((f(*inputs)[0] * weights).sum(), weight, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        g.sum().backward()


def test_default_chunk_size_follows_the_memory_budget():
    # large batches: 256 MiB of [c, V] buffers (8 bytes a logit in float32, 10 in bf16)
    assert default_hidden_chunk_size(151936, 10**6, torch.float32) == (256 << 20) // (8 * 151936)
    assert default_hidden_chunk_size(151936, 10**6, torch.bfloat16) == (256 << 20) // (10 * 151936)
    # smaller ones: 1/8 of the [N, V] float32 logits (4 bytes each) over 8 bytes a row-logit, at least 64 MiB
    assert default_hidden_chunk_size(151936, 1600, torch.float32) == 1600 * 4 // (8 * 8)
    assert default_hidden_chunk_size(151936, 300, torch.float32) == (64 << 20) // (8 * 151936)
    assert default_hidden_chunk_size(10**9, 50, torch.float32) == 1  # at least one row
    assert default_hidden_chunk_size(10, 50, torch.float32) == 50  # at most every row
    assert default_hidden_chunk_size(10, 0, torch.float32) == 1


# ----------------------------------------------------------------------------- input checks


def _args(**over):
    hidden, weight, b_, ids, pl = make(2, 9, 5, 11, 4)
    args = dict(hidden=hidden, lm_head_weight=weight, input_ids=ids, prompt_lens=pl, response_len=4)
    args.update(over)
    return args


BAD = {
    "hidden-int": (dict(hidden=torch.zeros(2, 9, 5, dtype=torch.long)), TypeError, r"hidden must be a floating"),
    "hidden-2d": (dict(hidden=torch.zeros(9, 5)), ValueError, r"hidden must be \[B, T, C\].*hidden\[None\]"),
    "weight-int": (dict(lm_head_weight=torch.zeros(11, 5, dtype=torch.long)), TypeError, r"lm_head_weight must be a"),
    "weight-1d": (dict(lm_head_weight=torch.zeros(11)), ValueError, r"lm_head_weight must be \[V, C\]"),
    "weight-transposed": (
        dict(lm_head_weight=torch.zeros(5, 11)), ValueError, r"width C=5.*not its transpose"
    ),
    "bias-shape": (dict(lm_head_bias=torch.zeros(12)), ValueError, r"lm_head_bias has shape \(12,\).*V=11"),
    "bias-int": (dict(lm_head_bias=torch.zeros(11, dtype=torch.long)), TypeError, r"lm_head_bias must be a float"),
    "ids-float": (dict(input_ids=torch.zeros(2, 9)), TypeError, r"\binput_ids\b"),
    "ids-shape": (dict(input_ids=torch.zeros(2, 8, dtype=torch.long)), ValueError, r"input_ids has shape \(2, 8\)"),
    "prompt-lens-shape": (dict(prompt_lens=torch.ones(3, dtype=torch.long)), ValueError, r"\bprompt_lens\b"),
    "prompt-lens-list": (dict(prompt_lens=[1, 1]), TypeError, r"prompt_lens must be a torch.Tensor"),
    "device": (dict(lm_head_weight=torch.zeros(11, 5, device="meta")), ValueError, r"\blm_head_weight on meta"),
    "mask-shape": (dict(mask=torch.ones(2, 5, dtype=torch.bool)), ValueError, r"mask has shape \(2, 5\).*\(2, 4\)"),
    "mask-values": (dict(mask=torch.full((2, 4), 2.0)), ValueError, r"\bmask\b"),
    "mask-list": (dict(mask=[[True] * 4] * 2), TypeError, r"mask must be a torch.Tensor"),
    "chunk-0": (dict(chunk_size=0), ValueError, r"chunk_size=0"),
    "too-long": (dict(response_len=9), ValueError, r"hidden/input_ids have T=9\b"),
    "vocab": (
        dict(input_ids=torch.full((2, 9), 11)), ValueError, r"outside the vocabulary \[0, V=11\) of lm_head_weight"
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_inputs_are_refused_with_the_fix(case):
    over, err, match = BAD[case]
    with pytest.raises(err, match=match):
        response_log_probs_from_hidden(**_args(**over))


def test_value_checks_off_skips_the_vocabulary_check_only():
    ids = torch.full((2, 9), 3)
    with value_checks(False):
        assert response_log_probs_from_hidden(**_args(input_ids=ids)).shape == (2, 4)
    with pytest.raises(ValueError, match=r"chunk_size=0"), value_checks(False):
        response_log_probs_from_hidden(**_args(chunk_size=0))


# ----------------------------------------------------------------------------- the head protocol


def test_lm_head_parameters_follows_the_protocol():
    lm = TinyCausalLM(TinyLMConfig.preset("pico", vocab_size=13, block_size=8))
    weight, bias = lm_head_parameters(lm)
    assert weight is lm.lm_head.weight is lm.wte.weight and bias is None

    class Restricted(nn.Module):  # a wrapper that transforms its head says so
        def __init__(self):
            super().__init__()
            self.lm_head = nn.Linear(4, 6)

        def lm_head_parameters(self):
            return self.lm_head.weight[:3], self.lm_head.bias[:3]

    w, b = lm_head_parameters(Restricted())
    assert w.shape == (3, 4) and b.shape == (3,)

    class Scaled(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    odd = nn.Module()
    odd.lm_head = Scaled(4, 6)
    assert lm_head_parameters(odd) is None  # a subclass may compute something else
    assert lm_head_parameters(nn.Module()) is None  # no head at all
    hooked = nn.Module()
    hooked.lm_head = nn.Linear(4, 6)
    hooked.lm_head.register_forward_pre_hook(lambda m, i: i)
    assert lm_head_parameters(hooked) is None


# ----------------------------------------------------------------------------- ResponseLogProbs


def _tiny(vocab, seed=0):
    torch.manual_seed(seed)
    return TinyCausalLM(TinyLMConfig.preset("pico", vocab_size=vocab, block_size=12))


def _tiny_llama(vocab=FROM_HIDDEN_MIN_VOCAB):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    torch.manual_seed(0)
    return HFCausalLMAdapter.from_config(cfg).eval()


def _response_batch(vocab, B=3, P=4, R=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, P + R), generator=gen)
    am = torch.ones(B, P + R, dtype=torch.bool)
    am[0, :2] = False  # left-padded prompt
    am[1, P + 3 :] = False  # the response ended after 3 tokens
    return ids, am


def _values_and_grads(readout, model, ids, am, mask):
    model.zero_grad(set_to_none=True)
    lp, ent = readout(ids, am)
    gen = torch.Generator().manual_seed(7)
    cot = torch.randn(lp.shape, generator=gen)
    (torch.where(mask, cot * lp + 0.2 * ent, 0.0)).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return torch.where(mask, lp, 0.0).detach(), torch.where(mask, ent, 0.0).detach(), grads


@pytest.mark.parametrize("kind", ["tiny", "llama"])
def test_response_log_probs_hidden_path_equals_the_logits_path(kind):
    vocab = FROM_HIDDEN_MIN_VOCAB
    model = _tiny(vocab) if kind == "tiny" else _tiny_llama(vocab)
    P = 4
    ids, am = _response_batch(vocab, P=P)
    mask = am[:, P:]
    auto, logits = ResponseLogProbs(model, P), ResponseLogProbs(model, P, from_hidden=False)
    assert auto.from_hidden and not logits.from_hidden  # V >= FROM_HIDDEN_MIN_VOCAB: "auto" picks hidden states
    lp_h, ent_h, g_h = _values_and_grads(auto, model, ids, am, mask)
    lp_l, ent_l, g_l = _values_and_grads(logits, model, ids, am, mask)
    torch.testing.assert_close(lp_h, lp_l, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent_h, ent_l, rtol=1e-5, atol=1e-5)
    assert g_h.keys() == g_l.keys() == {n for n, p in model.named_parameters() if p.requires_grad}
    for name in g_l:
        torch.testing.assert_close(g_h[name], g_l[name], rtol=1e-5, atol=1e-5, msg=name)
    raw, _ = auto(ids, am)
    assert (raw[~mask] == 0).all()  # nothing projected after a response's end


def test_auto_keeps_a_small_vocabulary_on_the_logits_path():
    lm = _tiny(13)
    assert ResponseLogProbs(lm, 3).from_hidden is False
    ac = make_actor_critic(lm, 3)
    assert ac.actor.module.from_hidden is False
    assert make_actor_critic(lm, 3, from_hidden=True).actor.module.from_hidden is True
    ids, am = _response_batch(13, P=3)
    # the logits path is read_log_probs on the model's own logits, bit for bit
    lp, ent = ResponseLogProbs(lm, 3)(ids, am)
    lp_ref, ent_ref = read_log_probs(lm(ids, am).logits, ids, torch.full((3,), 3), ids.shape[1] - 3,
                                     return_entropy=True)  # fmt: skip
    assert torch.equal(lp, lp_ref) and torch.equal(ent, ent_ref)


def test_hidden_path_keeps_the_entropy_out_of_the_graph_when_asked():
    lm = _tiny(FROM_HIDDEN_MIN_VOCAB)
    ids, am = _response_batch(FROM_HIDDEN_MIN_VOCAB)
    lp, ent = ResponseLogProbs(lm, 4, entropy_grad=False)(ids, am)
    assert lp.requires_grad and not ent.requires_grad
    lp2, ent2 = ResponseLogProbs(lm, 4)(ids, am)
    assert torch.equal(lp, lp2) and torch.equal(ent, ent2.detach())
    lm.zero_grad()
    lp.sum().backward()
    g = lm.lm_head.weight.grad.clone()
    lm.zero_grad()
    ResponseLogProbs(lm, 4, return_entropy=False)(ids, am).sum().backward()
    torch.testing.assert_close(g, lm.lm_head.weight.grad, rtol=1e-6, atol=1e-7)


class _HalfHiddenLM(nn.Module):
    """Stands in for a model under autocast: bf16 hidden states, float32 head, an autocast_dtype."""

    autocast_dtype = torch.bfloat16

    def __init__(self, vocab):
        super().__init__()
        self.emb = nn.Embedding(vocab, 8)
        self.lm_head = nn.Linear(8, vocab)

    def forward(self, input_ids, attention_mask=None, compute_logits=True):
        hidden = torch.tanh(self.emb(input_ids))  # float32, as an autocast trunk's norm may return
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = self.lm_head(hidden).float() if compute_logits else None
        return LMOutput(logits, hidden)


def test_hidden_path_projects_in_the_models_autocast_dtype():
    vocab = FROM_HIDDEN_MIN_VOCAB
    lm = _HalfHiddenLM(vocab)
    ids, am = _response_batch(vocab)
    mask = am[:, 4:]
    lp_h, ent_h, g_h = _values_and_grads(ResponseLogProbs(lm, 4), lm, ids, am, mask)
    lp_l, ent_l, g_l = _values_and_grads(ResponseLogProbs(lm, 4, from_hidden=False), lm, ids, am, mask)
    # the same bf16 logits on both paths: only the float32 reductions differ
    torch.testing.assert_close(lp_h, lp_l, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent_h, ent_l, rtol=1e-5, atol=1e-5)
    for name in g_l:
        assert g_h[name].dtype == torch.float32
        torch.testing.assert_close(g_h[name], g_l[name], rtol=0.02, atol=0.02 * float(g_l[name].abs().max()))


def test_response_log_probs_refuses_a_hidden_path_without_a_head():
    lm = _tiny(13)
    with pytest.raises(ValueError, match=r"from_hidden='yes' must be True .*False .*'auto'"):
        ResponseLogProbs(lm, 3, from_hidden="yes")
    with pytest.raises(ValueError, match=r"from_hidden=1 must be True"):
        ResponseLogProbs(lm, 3, from_hidden=1)
    handle = lm.lm_head.register_forward_hook(lambda m, i, o: o)
    with pytest.raises(ValueError, match=r"from_hidden=True but the model exposes no LM head.*lm_head_parameters"):
        ResponseLogProbs(lm, 3, from_hidden=True)
    assert ResponseLogProbs(lm, 3).from_hidden is False  # "auto" falls back to the logits
    handle.remove()
    readout = ResponseLogProbs(lm, 3, from_hidden=True)
    lm.lm_head.register_forward_hook(lambda m, i, o: o)
    ids, am = _response_batch(13, P=3)
    with pytest.raises(ValueError, match=r"no longer exposes its LM head.*from_hidden=False"):
        readout(ids, am)


def test_auto_reads_the_logits_when_the_head_is_no_longer_exposed():
    lm = _tiny(FROM_HIDDEN_MIN_VOCAB)
    auto = ResponseLogProbs(lm, 4)
    assert auto.from_hidden
    lm.lm_head.register_forward_hook(lambda m, i, o: o)
    ids, am = _response_batch(FROM_HIDDEN_MIN_VOCAB)
    lp, ent = auto(ids, am)
    lp_ref, ent_ref = ResponseLogProbs(lm, 4, from_hidden=False)(ids, am)
    assert torch.equal(lp, lp_ref) and torch.equal(ent, ent_ref)


# ----------------------------------------------------------------------------- CausalLMTokenLogProbs


def _tiny_qwen(vocab=FROM_HIDDEN_MIN_VOCAB, **extra):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen2Config(
        vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32, **extra,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def test_causal_lm_token_log_probs_hidden_path_equals_the_logits_path():
    model = _tiny_qwen()
    B, T = 3, 10
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, FROM_HIDDEN_MIN_VOCAB, (B, T), generator=gen)
    am = torch.ones(B, T, dtype=torch.bool)
    am[2, 7:] = False
    mask = torch.rand(B, T, generator=gen) > 0.3  # holes: user / tool tokens
    mask[2, 7:] = False
    auto, logits = CausalLMTokenLogProbs(model), CausalLMTokenLogProbs(model, from_hidden=False)
    assert auto.from_hidden and not logits.from_hidden

    def run(readout):
        model.zero_grad(set_to_none=True)
        lp, ent = readout.log_probs(tokens, am, mask)
        (lp.sum() + 0.1 * ent.sum()).backward()
        return lp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    lp_h, ent_h, g_h = run(auto)
    lp_l, ent_l, g_l = run(logits)
    torch.testing.assert_close(lp_h, lp_l, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent_h, ent_l, rtol=1e-5, atol=1e-5)
    assert (lp_h[~mask] == 0).all() and (ent_h[~mask] == 0).all()
    for name in g_l:
        torch.testing.assert_close(g_h[name], g_l[name], rtol=1e-5, atol=1e-5, msg=name)


def test_causal_lm_token_log_probs_falls_back_to_the_logits_when_the_head_is_not_plain():
    assert CausalLMTokenLogProbs(_tiny_qwen(vocab=64)).from_hidden is False  # small V
    capped = _tiny_qwen()
    capped.config.final_logit_softcapping = 30.0
    assert CausalLMTokenLogProbs(capped).from_hidden is False
    with pytest.raises(ValueError, match=r"CausalLMTokenLogProbs: from_hidden=True but.*soft-capping"):
        CausalLMTokenLogProbs(capped, from_hidden=True)
    scaled = _tiny_qwen()
    scaled.config.logit_scale = 0.5
    assert CausalLMTokenLogProbs(scaled).from_hidden is False
    scaled.config.logit_scale = 1.0  # no scaling at all
    assert CausalLMTokenLogProbs(scaled).from_hidden is True
    hooked = _tiny_qwen()
    hooked.register_forward_hook(lambda m, i, o: o)
    assert CausalLMTokenLogProbs(hooked).from_hidden is False
    with pytest.raises(ValueError, match=r"from_hidden='never' must be True"):
        CausalLMTokenLogProbs(_tiny_qwen(), from_hidden="never")


def test_causal_lm_token_log_probs_hidden_path_on_one_token_rows():
    model = _tiny_qwen()
    lp, ent = CausalLMTokenLogProbs(model).log_probs(torch.tensor([[5], [7]]))
    assert lp.shape == ent.shape == (2, 1) and (lp == 0).all()

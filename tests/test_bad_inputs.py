"""The bad-input matrix: every public function and module fed inputs it must refuse or survive.

One table of cases. Each case either expects a clear ``ValueError`` / ``TypeError`` /
``KeyError`` whose message names the offending argument or key (and the fix, where
there is one), or computes a result that is checked against an independent
computation (the testing kit's loop references, plain Python over the valid
tokens, hand arithmetic) -- never only for finiteness. A case that fails here is a
silent wrong number or an unhelpful error in the library, not in this file.

Each message is pinned in full once, in the test file of the code that raises it
(the shared validators' and the functional core's in ``tests/test_functional.py``,
a module's in its own test file). A refusal with the same call as one there is not
repeated here; a case that reaches a shared validator through another caller
asserts only that caller's part of the message (the argument or key it names).

Categories (``Case.kind``):

- ``shape``: wrong or broadcastable shapes, missing token axes;
- ``dtype``: integer / complex / non-tensor inputs, half precision;
- ``mask-values``: masks with values other than 0 and 1;
- ``mask-empty``: all-zero masks (and masks with one valid token);
- ``masked-garbage``: NaN / inf at masked positions;
- ``device``: tensors on two devices ('meta' stands in for the second one);
- ``hyper``: out-of-range hyper-parameters and options;
- ``missing-key``: TensorDict entries that are absent;
- ``no-eos``: responses that never emit EOS (truncated);
- ``long-prompt``: prompts / sequences longer than the context;
- ``empty-batch``: zero rows or zero-length responses;
- ``token-ids``: token ids outside the vocabulary, actions outside the action space;
- ``non-finite``: NaN / inf at valid positions (where they would reach a result);
- ``layout``: a batch of the wrong layout (a raw collector batch, masked data for TorchRL's GAE);
- ``composition``: a plausible way of wiring the modules together that would compute the wrong
  thing without a word (swapped arguments, an estimator with the wrong loss, a step out of order).

A case may also expect a warning (``warns``): a likely mistake that TorchRL's conventions
keep legal is warned about, and the warning is raised as an error for the case.
"""

from __future__ import annotations

import math
import tempfile
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch
from tensordict import TensorDict, lazy_stack
from tensordict.nn import TensorDictModule
from torch import nn

from ppo_objectives import functional as F
from ppo_objectives.llm.chat import CausalLMCritic, CausalLMTokenLogProbs, LLMToTokenBatch, bootstrap_from_next_turn
from ppo_objectives.llm.env import TokenLMEnv
from ppo_objectives.llm.layouts import ToLLMBatch, trajectories_to_llm_batch
from ppo_objectives.llm.models import TinyCausalLM, TinyLMConfig
from ppo_objectives.llm.policy import NextTokenLogits, sample_with_kv_cache
from ppo_objectives.llm.readouts import ResponseLogProbs, ResponseValues, frozen_reference, make_actor_critic
from ppo_objectives.loss import TokenPPOLoss
from ppo_objectives.testing import (
    reference_gae_response,
    reference_kl,
    reference_log_probs,
    reference_ppo_policy_loss,
    reference_response_log_probs,
)
from ppo_objectives.testing.references import whiten
from ppo_objectives.train.digit import DigitTask
from ppo_objectives.transforms import AdaptiveKLController, FixedKLController, KLPenaltyTransform
from ppo_objectives.value.gae import MaskedGAE

NAN, INF = float("nan"), float("inf")
KINDS = (
    "shape",
    "dtype",
    "mask-values",
    "mask-empty",
    "masked-garbage",
    "device",
    "hyper",
    "missing-key",
    "no-eos",
    "long-prompt",
    "empty-batch",
    "token-ids",
    "non-finite",
    "layout",
    "composition",
)


# --------------------------------------------------------------------------- #
# The case record
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class Case:
    """One bad input: ``call()`` must raise ``raises`` matching ``match``, or pass ``check(result)``."""

    id: str
    kind: str
    call: Callable[[], Any]
    raises: type[BaseException] | tuple[type[BaseException], ...] | None = None
    match: str | None = None
    check: Callable[[Any], None] | None = None


CASES: list[Case] = []


def refuse(id: str, kind: str, call: Callable[[], Any], raises, match: str) -> None:
    CASES.append(Case(id, kind, call, raises=raises, match=match))


def accept(id: str, kind: str, call: Callable[[], Any], check: Callable[[Any], None]) -> None:
    CASES.append(Case(id, kind, call, check=check))


def warns(id: str, kind: str, call: Callable[[], Any], category: type[Warning], match: str) -> None:
    """``call()`` must warn ``category`` with a message matching ``match`` (raised as an error here)."""

    def as_error():
        with warnings.catch_warnings():
            warnings.simplefilter("error", category)
            return call()

    refuse(id, kind, as_error, category, match)


def expecting_warning(call: Callable[[], Any], match: str) -> Callable[[], Any]:
    """``call`` for an ``accept`` case whose input is also warned about (``match``)."""

    def run():
        with pytest.warns(UserWarning, match=match):
            return call()

    return run


def unchecked(call: Callable[[], Any]) -> Callable[[], Any]:
    """``call`` under ``functional.value_checks(False)``: the checks that read tensor data are off."""

    def run():
        with F.value_checks(False):
            return call()

    return run


def close(actual, expected, atol=1e-5, rtol=1e-5):
    expected = torch.as_tensor(expected, dtype=actual.dtype if isinstance(actual, torch.Tensor) else None)
    actual = torch.as_tensor(actual)
    assert torch.isfinite(actual).all(), f"non-finite result {actual}"
    torch.testing.assert_close(actual, expected.to(actual.dtype), atol=atol, rtol=rtol)


def exactly_zero(x):
    assert torch.equal(x, torch.zeros_like(x)), f"expected exact zeros, got {x}"


# --------------------------------------------------------------------------- #
# Shared small inputs and independent (naive) references
# --------------------------------------------------------------------------- #

# Row 0: two valid tokens then padding; row 1: a hole in the middle (a tool token, say).
MASK = torch.tensor([[True, True, False, False], [True, False, True, True]])
# Garbage (NaN, +-inf) only where MASK is False.
X = torch.tensor([[1.0, 2.0, NAN, INF], [4.0, -INF, 6.0, 8.0]])
X_CLEAN = torch.where(MASK, X, 0.0)
VALID = [1.0, 2.0, 4.0, 6.0, 8.0]  # X[MASK], written out by hand

NEW = torch.tensor([[-1.0, -0.5, NAN, 3.0], [-2.0, INF, -0.1, -1.2]])
OLD = torch.tensor([[-1.2, -0.5, -INF, NAN], [-1.5, 0.0, -0.3, -1.0]])
ADV = torch.tensor([[1.0, -2.0, NAN, INF], [0.5, NAN, -1.0, 2.0]])
RET = torch.tensor([[1.0, 0.0, NAN, 5.0], [2.0, INF, -1.0, 0.5]])
VAL = torch.tensor([[0.5, 0.1, INF, NAN], [1.0, NAN, -0.5, 0.9]])
REW = torch.tensor([[0.0, 1.0, NAN, -INF], [0.5, NAN, 0.0, 1.0]])


def valid(x, m=MASK):
    return x[m].tolist()


def naive_mean(xs):
    return sum(xs) / max(len(xs), 1)


def naive_var(xs):
    mu = naive_mean(xs)
    return sum((x - mu) ** 2 for x in xs) / max(len(xs), 1)


def mean_k3(logp, ref, m):
    """The k3 KL estimate averaged over the valid tokens (the kit's per-token reference)."""
    return reference_kl(logp, ref, "k3", mask=m).sum() / max(int(m.sum()), 1)


def naive_value_loss(v, v_old, ret, m, c):
    per = []
    for x, xo, g in zip(valid(v, m), valid(v_old, m), valid(ret, m)):
        clipped = min(max(x, xo - c), xo + c)
        per.append(0.5 * max((x - g) ** 2, (clipped - g) ** 2))
    return naive_mean(per)


def meta_like(x):
    return torch.empty(x.shape, dtype=x.dtype, device="meta")


# =========================================================================== #
# functional.py
# =========================================================================== #

# ---- masked statistics ------------------------------------------------------
refuse("masked_mean-mask-shape-mismatch", "shape", lambda: F.masked_mean(X, MASK[:, :3]),
       ValueError, r"mask has shape \(2, 3\) but x has shape \(2, 4\).*no broadcasting")
refuse("masked_mean-broadcastable-mask-refused", "shape", lambda: F.masked_mean(X, MASK[1]),
       ValueError, r"mask has shape \(4,\) but x has shape \(2, 4\)")
refuse("masked_sum-int-values", "dtype", lambda: F.masked_sum(torch.ones(2, 4, dtype=torch.long), MASK),
       TypeError, r"x must be a floating-point tensor.*x\.float\(\)")
refuse("masked_mean-mask-0.5", "mask-values", lambda: F.masked_mean(X, torch.full((2, 4), 0.5)),
       ValueError, r"\bmask\b")
refuse("masked_var-mask-2", "mask-values", lambda: F.masked_var(X_CLEAN, MASK.long() * 2),
       ValueError, r"\bmask\b")
accept("masked_mean-float-01-mask-equals-bool-mask", "mask-values",
       lambda: F.masked_mean(X, MASK.float()), lambda out: close(out, naive_mean(VALID)))
refuse("value_checks-off-keeps-shape-checks", "mask-values",
       lambda: _with_value_checks_off(lambda: F.masked_mean(X, torch.full((2, 3), 0.5))),
       ValueError, r"mask has shape \(2, 3\)")
accept("masked_mean-empty-mask-is-zero", "mask-empty",
       lambda: F.masked_mean(X, torch.zeros(2, 4, dtype=torch.bool)), exactly_zero)
accept("masked_mean-dim-empty-row-is-zero", "mask-empty",
       lambda: F.masked_mean(X, torch.tensor([[False] * 4, [True, False, True, True]]), dim=-1),
       lambda out: close(out, [0.0, (4 + 6 + 8) / 3]))
accept("masked_var-one-valid-token-unbiased-is-zero", "mask-empty",
       lambda: F.masked_var(X, torch.tensor([[True, False, False, False], [False] * 4]), unbiased=True),
       exactly_zero)
accept("masked_whiten-empty-mask-is-zero", "mask-empty",
       lambda: F.masked_whiten(X, torch.zeros(2, 4, dtype=torch.bool)), exactly_zero)
accept("masked_sum-nan-inf-at-masked", "masked-garbage", lambda: F.masked_sum(X, MASK),
       lambda out: close(out, sum(VALID)))
accept("masked_mean-nan-inf-at-masked", "masked-garbage", lambda: F.masked_mean(X, MASK),
       lambda out: close(out, naive_mean(VALID)))
accept("masked_var-nan-inf-at-masked", "masked-garbage", lambda: F.masked_var(X, MASK),
       lambda out: close(out, naive_var(VALID)))
accept("masked_whiten-nan-inf-at-masked", "masked-garbage", lambda: F.masked_whiten(X, MASK),
       lambda out: close(out, whiten(X_CLEAN, MASK)))
accept("masked_whiten-bf16-computed-in-float32", "dtype",
       lambda: F.masked_whiten(X.bfloat16(), MASK),
       lambda out: (close(out.float(), whiten(X_CLEAN.bfloat16().double(), MASK), atol=2e-2, rtol=1e-2),
                    _assert_dtype(out, torch.bfloat16)))
refuse("masked_mean-values-on-other-device", "device", lambda: F.masked_mean(meta_like(X), MASK),
       ValueError, r"\bx on meta")
refuse("masked_mean-mask-on-other-device", "device", lambda: F.masked_mean(X, meta_like(MASK)),
       ValueError, r"\bmask on meta")
refuse("masked_whiten-eps-0", "hyper", lambda: F.masked_whiten(X, MASK, eps=0.0),
       ValueError, r"eps=0\.0 must be a finite number > 0")
accept("masked_mean-empty-batch-is-zero", "empty-batch",
       lambda: F.masked_mean(torch.empty(0, 4), torch.empty(0, 4, dtype=torch.bool)), exactly_zero)
accept("masked_whiten-zero-length-response", "empty-batch",
       lambda: F.masked_whiten(torch.empty(3, 0), torch.empty(3, 0, dtype=torch.bool)),
       lambda out: _assert_shape(out, (3, 0)))


def _with_value_checks_off(fn):
    with F.value_checks(False):
        return fn()


def _assert_dtype(x, dtype):
    assert x.dtype == dtype, f"dtype {x.dtype}, expected {dtype}"


def _assert_shape(x, shape):
    assert tuple(x.shape) == tuple(shape), f"shape {tuple(x.shape)}, expected {tuple(shape)}"


# ---- explained variance -----------------------------------------------------
accept("explained_variance-nan-inf-at-masked", "masked-garbage", lambda: F.explained_variance(VAL, RET, MASK),
       lambda out: close(out, 1 - naive_var([g - v for g, v in zip(valid(RET), valid(VAL))]) / naive_var(valid(RET))))
accept("explained_variance-empty-mask-is-zero", "mask-empty",
       lambda: F.explained_variance(VAL, RET, torch.zeros(2, 4, dtype=torch.bool)), exactly_zero)
accept("explained_variance-constant-returns-is-zero", "mask-empty",
       lambda: F.explained_variance(VAL, torch.ones(2, 4), MASK), exactly_zero)

# ---- response positions and log-probs ---------------------------------------

LOGITS = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(0))
IDS = torch.tensor([[3, 1, 4, 1, 5, 0], [2, 7, 1, 6, 2, 7]])  # ids < V = 8
PLENS = torch.tensor([2, 3])


refuse("response_log_probs-ids-shape", "shape", lambda: F.response_log_probs(LOGITS, IDS[:, :5], PLENS, 2),
       ValueError, r"input_ids has shape \(2, 5\) but logits has shape \(2, 6, 8\)")
refuse("response_log_probs-int-logits", "dtype", lambda: F.response_log_probs(LOGITS.long(), IDS, PLENS, 2),
       TypeError, r"logits must be a floating-point tensor")
refuse("response_log_probs-token-id-outside-vocab", "token-ids",
       lambda: F.response_log_probs(LOGITS, _with_id(IDS, (0, 2), 9), PLENS, 2),
       ValueError, r"input_ids.*(vocab|V=8)")
accept("response_log_probs-bf16-logits-float32-result", "dtype",
       lambda: F.response_log_probs(LOGITS.bfloat16(), IDS, PLENS, 3),
       lambda out: (_assert_dtype(out, torch.float32), close(out, reference_response_log_probs(LOGITS.bfloat16(), IDS, PLENS, 3), atol=1e-5)))
accept("response_log_probs-nan-logits-at-unread-positions", "masked-garbage",
       lambda: F.response_log_probs(_nan_in_unread(LOGITS), IDS, PLENS, 3),
       lambda out: close(out, reference_response_log_probs(LOGITS, IDS, PLENS, 3)))
refuse("response_log_probs-prompt-lens-on-other-device", "device",
       lambda: F.response_log_probs(LOGITS, IDS, meta_like(PLENS), 2),
       ValueError, r"\bprompt_lens on meta")
accept("response_log_probs-empty-batch", "empty-batch",
       lambda: F.response_log_probs(torch.empty(0, 6, 8), torch.empty(0, 6, dtype=torch.long),
                                    torch.empty(0, dtype=torch.long), 3, return_entropy=True),
       lambda out: (_assert_shape(out[0], (0, 3)), _assert_shape(out[1], (0, 3))))


def _with_id(ids, where, value):
    out = ids.clone()
    out[where] = value
    return out


def _nan_in_unread(logits):
    """NaN in the logits no response token is predicted from (the prompt's first positions, the last one)."""
    out = logits.clone()
    out[0, 0] = NAN  # row 0 reads positions 1..3
    out[:, 5] = NAN  # the last position predicts nothing
    out[1, :2] = NAN  # row 1 reads positions 2..4
    return out


# ---- masked GAE -------------------------------------------------------------
refuse("masked_gae-values-shape", "shape", lambda: F.masked_gae(REW, VAL[:, :3], MASK, 1.0, 0.95),
       ValueError, r"values has shape \(2, 3\) but token_rewards has shape \(2, 4\)")
refuse("masked_gae-bootstrap-value-shape", "shape",
       lambda: F.masked_gae(REW, VAL, MASK, 1.0, 0.95, bootstrap_value=torch.zeros(2, 1)),
       ValueError, r"bootstrap_value has shape \(2, 1\) but must be \[\*B\] = \(2,\)")
refuse("masked_gae-values-not-a-tensor", "dtype", lambda: F.masked_gae(REW, VAL.tolist(), MASK, 1.0, 0.95),
       TypeError, r"values must be a torch\.Tensor")
refuse("masked_gae-int-bootstrap-value", "dtype",
       lambda: F.masked_gae(REW, VAL, MASK, 1.0, 0.95, bootstrap_value=torch.zeros(2, dtype=torch.long)),
       TypeError, r"bootstrap_value must be a floating-point tensor")
refuse("masked_gae-mask-minus-1", "mask-values", lambda: F.masked_gae(REW, VAL, -MASK.float(), 1.0, 0.95),
       ValueError, r"\bmask\b")
accept("masked_gae-empty-mask-whitened-is-zero", "mask-empty",
       lambda: F.masked_gae(REW, VAL, torch.zeros(2, 4, dtype=torch.bool), 1.0, 0.95, average_gae=True),
       lambda out: (exactly_zero(out[0]), exactly_zero(out[1])))
for _backend in ("torch", "loop"):
    accept(f"masked_gae-nan-inf-at-masked-{_backend}", "masked-garbage",
           lambda b=_backend: F.masked_gae(REW, VAL, MASK, 0.9, 0.8, average_gae=False, backend=b),
           lambda out: (close(out[0], reference_gae_response(REW, VAL, MASK, 0.9, 0.8)[0]),
                        close(out[1], reference_gae_response(REW, VAL, MASK, 0.9, 0.8)[1])))
accept("masked_gae-nan-inf-at-masked-whitened", "masked-garbage",
       lambda: F.masked_gae(REW, VAL, MASK, 1.0, 0.95, average_gae=True),
       lambda out: close(out[0], reference_gae_response(REW, VAL, MASK, 1.0, 0.95, average_gae=True)[0]))
accept("masked_gae-bf16-inputs", "dtype",
       lambda: F.masked_gae(REW.bfloat16(), VAL.bfloat16(), MASK, 1.0, 0.95, average_gae=False),
       lambda out: (_assert_dtype(out[0], torch.bfloat16),
                    close(out[0].float(), reference_gae_response(REW.bfloat16(), VAL.bfloat16(), MASK, 1.0, 0.95)[0], atol=2e-2, rtol=1e-2)))
refuse("masked_gae-values-on-other-device", "device", lambda: F.masked_gae(REW, meta_like(VAL), MASK, 1.0, 0.95),
       ValueError, r"\bvalues on meta")
refuse("masked_gae-gamma-1.5", "hyper", lambda: F.masked_gae(REW, VAL, MASK, 1.5, 0.95),
       ValueError, r"gamma=1\.5 is outside \[0, 1\]")
refuse("masked_gae-lam-negative", "hyper", lambda: F.masked_gae(REW, VAL, MASK, 1.0, -0.1),
       ValueError, r"lmbda=-0\.1 is outside \[0, 1\]")
refuse("masked_gae-gamma-nan", "hyper", lambda: F.masked_gae(REW, VAL, MASK, NAN, 0.95),
       ValueError, r"gamma=nan is outside \[0, 1\]")
refuse("masked_gae-gamma-tensor-2", "hyper", lambda: F.masked_gae(REW, VAL, MASK, torch.tensor(2.0), 0.95),
       ValueError, r"gamma=2\.0 is outside \[0, 1\]")
accept("masked_gae-truncated-row-no-eos-bootstrapped", "no-eos",
       lambda: F.masked_gae(REW, VAL, MASK, 1.0, 0.95, average_gae=False, bootstrap_value=torch.tensor([0.0, 2.5])),
       lambda out: close(out[0], reference_gae_response(REW, VAL, MASK, 1.0, 0.95, bootstrap_value=torch.tensor([0.0, 2.5]))[0]))
accept("masked_gae-empty-batch", "empty-batch",
       lambda: F.masked_gae(torch.empty(0, 4), torch.empty(0, 4), torch.empty(0, 4, dtype=torch.bool), 1.0, 0.95),
       lambda out: (_assert_shape(out[0], (0, 4)), _assert_shape(out[1], (0, 4))))
accept("masked_gae-zero-length-responses", "empty-batch",
       lambda: F.masked_gae(torch.empty(3, 0), torch.empty(3, 0), torch.empty(3, 0, dtype=torch.bool), 1.0, 0.95),
       lambda out: (_assert_shape(out[0], (3, 0)), _assert_shape(out[1], (3, 0))))

# ---- loss aggregation -------------------------------------------------------
_L = torch.tensor([[1.0, 3.0, NAN, INF], [6.0, NAN, 2.0, 4.0]])
_AGG_EXPECTED = {  # hand arithmetic over the valid tokens (1, 3 | 6, 2, 4)
    "token-mean": (1 + 3 + 6 + 2 + 4) / 5,
    "seq-mean-token-mean": ((1 + 3) / 2 + (6 + 2 + 4) / 3) / 2,
    "seq-mean-token-sum": ((1 + 3) + (6 + 2 + 4)) / 2,
    "seq-mean-token-sum-norm": (1 + 3 + 6 + 2 + 4) / (2 * 4),
}
for _mode, _expected in _AGG_EXPECTED.items():
    accept(f"aggregate_loss-{_mode}-nan-inf-at-masked", "masked-garbage",
           lambda mode=_mode: F.aggregate_loss(_L, MASK, mode), lambda out, e=_expected: close(out, e))
accept("aggregate_loss-seq-mean-token-mean-empty-mask", "mask-empty",
       lambda: F.aggregate_loss(_L, torch.zeros(2, 4, dtype=torch.bool), "seq-mean-token-mean"), exactly_zero)
refuse("aggregate_loss-scalar", "shape", lambda: F.aggregate_loss(torch.tensor(1.0), torch.tensor(True)),
       ValueError, r"per_token must have a token axis")
refuse("aggregate_loss-normalizer-0", "hyper", lambda: F.aggregate_loss(_L, MASK, normalizer=0.0),
       ValueError, r"normalizer=0\.0")
refuse("aggregate_loss-normalizer-tensor-0", "hyper", lambda: F.aggregate_loss(_L, MASK, normalizer=torch.tensor(0.0)),
       ValueError, r"normalizer=0\.0")
refuse("aggregate_loss-normalizer-on-other-device", "device",
       lambda: F.aggregate_loss(_L, MASK, normalizer=torch.empty((), device="meta")),
       ValueError, r"\bnormalizer on meta")
for _mode in F.AGGREGATIONS:
    accept(f"aggregate_loss-{_mode}-empty-batch", "empty-batch",
           lambda mode=_mode: F.aggregate_loss(torch.empty(0, 4), torch.empty(0, 4, dtype=torch.bool), mode), exactly_zero)
refuse("loss_normalizer-scalar-mask", "shape", lambda: F.loss_normalizer(torch.tensor(True)),
       ValueError, r"mask must have a token axis")
accept("loss_normalizer-empty-batch-is-one", "empty-batch",
       lambda: F.loss_normalizer(torch.empty(0, 4, dtype=torch.bool)), lambda out: close(out, 1.0))

# ---- the clipped policy loss ------------------------------------------------
refuse("ppo_policy_loss-per-sequence-advantage", "shape", lambda: F.ppo_policy_loss(NEW, OLD, ADV[:, 0], MASK, 0.2),
       ValueError, r"advantages has shape \(2,\) but log_prob has shape \(2, 4\).*broadcast")
refuse("ppo_policy_loss-int-new-logps", "dtype", lambda: F.ppo_policy_loss(NEW.long(), OLD, ADV, MASK, 0.2),
       TypeError, r"log_prob must be a floating-point tensor")
refuse("ppo_policy_loss-mask-2", "mask-values", lambda: F.ppo_policy_loss(NEW, OLD, ADV, MASK.long() + 1, 0.2),
       ValueError, r"\bmask\b")
accept("ppo_policy_loss-nan-inf-at-masked", "masked-garbage", lambda: F.ppo_policy_loss(NEW, OLD, ADV, MASK, 0.2),
       lambda out: close(out, reference_ppo_policy_loss(NEW, OLD, ADV, MASK, 0.2)))
accept("ppo_policy_loss-clip-higher-nan-inf-at-masked", "masked-garbage",
       lambda: F.ppo_policy_loss(NEW, OLD, ADV, MASK, (0.1, 0.3)),
       lambda out: close(out, reference_ppo_policy_loss(NEW, OLD, ADV, MASK, (0.1, 0.3))))
accept("ppo_policy_loss-stats-ignore-masked-garbage", "masked-garbage",
       lambda: F.ppo_policy_loss(NEW, OLD, ADV, MASK, 0.2, return_stats=True)[1],
       lambda stats: (close(stats["kl_approx"], naive_mean([0.5 * (n - o) ** 2 for n, o in zip(valid(NEW), valid(OLD))])),
                      close(stats["max_ratio"], max(math.exp(n - o) for n, o in zip(valid(NEW), valid(OLD)))),
                      close(stats["clip_fraction"], naive_mean([float(abs(math.exp(n - o) - 1) > 0.2) for n, o in zip(valid(NEW), valid(OLD))]))))
accept("ppo_policy_loss-empty-mask-loss-and-stats-zero", "mask-empty",
       lambda: F.ppo_policy_loss(NEW, OLD, ADV, torch.zeros(2, 4, dtype=torch.bool), 0.2, return_stats=True),
       lambda out: (exactly_zero(out[0]), [exactly_zero(v) for v in out[1].values()]))
accept("ppo_policy_loss-fp16-inputs-float32-math", "dtype",
       lambda: F.ppo_policy_loss(NEW.half(), OLD.half(), ADV.half(), MASK, 0.2),
       lambda out: (_assert_dtype(out, torch.float32),
                    close(out, reference_ppo_policy_loss(NEW.half().double(), OLD.half().double(), ADV.half().double(), MASK, 0.2))))
refuse("ppo_policy_loss-old-logps-on-other-device", "device", lambda: F.ppo_policy_loss(NEW, meta_like(OLD), ADV, MASK, 0.2),
       ValueError, r"\bsample_log_prob on meta")
refuse("ppo_policy_loss-clip-nan", "hyper", lambda: F.ppo_policy_loss(NEW, OLD, ADV, MASK, NAN),
       ValueError, r"clip_epsilon=nan")
refuse("ppo_policy_loss-dual-clip-below-1", "hyper", lambda: F.ppo_policy_loss(NEW, OLD, ADV, MASK, 0.2, dual_clip=0.9),
       ValueError, r"dual_clip=0\.9 must be a finite number > 1.*must exceed 1")
refuse("ppo_policy_loss-unknown-agg-mode", "hyper", lambda: F.ppo_policy_loss(NEW, OLD, ADV, MASK, 0.2, aggregation="sum"),
       ValueError, r"aggregation='sum'")
accept("ppo_policy_loss-empty-batch", "empty-batch",
       lambda: F.ppo_policy_loss(*(torch.empty(0, 4),) * 3, torch.empty(0, 4, dtype=torch.bool), 0.2, return_stats=True),
       lambda out: (exactly_zero(out[0]), [exactly_zero(v) for v in out[1].values()]))

accept("approx_kl-nan-inf-at-masked", "masked-garbage", lambda: F.approx_kl(NEW, OLD, MASK),
       lambda out: close(out, naive_mean([0.5 * (n - o) ** 2 for n, o in zip(valid(NEW), valid(OLD))])))
accept("approx_kl-empty-mask", "mask-empty", lambda: F.approx_kl(NEW, OLD, torch.zeros(2, 4, dtype=torch.bool)), exactly_zero)

# ---- reference KL -----------------------------------------------------------
refuse("kl_estimate-shape", "shape", lambda: F.kl_estimate(NEW, OLD[:1]),
       ValueError, r"ref_log_prob has shape \(1, 4\) but log_prob has shape \(2, 4\)")
refuse("kl_estimate-int-ref", "dtype", lambda: F.kl_estimate(NEW, OLD.long()),
       TypeError, r"ref_log_prob must be a floating-point tensor")
refuse("kl_estimate-clamp-0", "hyper", lambda: F.kl_estimate(NEW, OLD, clamp=0.0),
       ValueError, r"clamp=0\.0 must be a finite number > 0")
refuse("kl_estimate-ref-on-other-device", "device", lambda: F.kl_estimate(NEW, meta_like(OLD)),
       ValueError, r"\bref_log_prob on meta")
refuse("reference_kl_penalty-mask-trailing-one", "shape", lambda: F.reference_kl_penalty(NEW, OLD, MASK[..., None]),
       ValueError, r"mask has shape \(2, 4, 1\) but log_prob has shape \(2, 4\)")
accept("reference_kl_penalty-k3-nan-inf-at-masked", "masked-garbage", lambda: F.reference_kl_penalty(NEW, OLD, MASK),
       lambda out: close(out, mean_k3(NEW, OLD, MASK)))
accept("reference_kl_penalty-k1-nan-inf-at-masked", "masked-garbage",
       lambda: F.reference_kl_penalty(NEW, OLD, MASK, estimator="k1"),
       lambda out: close(out, naive_mean([n - o for n, o in zip(valid(NEW), valid(OLD))])))
accept("reference_kl_penalty-empty-mask", "mask-empty",
       lambda: F.reference_kl_penalty(NEW, OLD, torch.zeros(2, 4, dtype=torch.bool)), exactly_zero)
refuse("reference_kl_penalty-unknown-agg-mode", "hyper", lambda: F.reference_kl_penalty(NEW, OLD, MASK, aggregation="x"),
       ValueError, r"aggregation='x' is not one of")

# ---- the clipped value loss -------------------------------------------------
refuse("clipped_value_loss-returns-trailing-one", "shape", lambda: F.clipped_value_loss(VAL, VAL, RET[..., None], MASK, 0.2),
       ValueError, r"returns has shape \(2, 4, 1\)")
refuse("clipped_value_loss-int-returns", "dtype", lambda: F.clipped_value_loss(VAL, VAL, RET.long(), MASK, 0.2),
       TypeError, r"returns must be a floating-point tensor")
accept("clipped_value_loss-nan-inf-at-masked", "masked-garbage",
       lambda: F.clipped_value_loss(VAL + 0.5, VAL, RET, MASK, 0.2),
       lambda out: close(out, naive_value_loss(VAL + 0.5, VAL, RET, MASK, 0.2)))
accept("clipped_value_loss-empty-mask", "mask-empty",
       lambda: F.clipped_value_loss(VAL, VAL, RET, torch.zeros(2, 4, dtype=torch.bool), 0.2, return_stats=True),
       lambda out: (exactly_zero(out[0]), exactly_zero(out[1]["value_clip_fraction"])))
refuse("clipped_value_loss-returns-on-other-device", "device", lambda: F.clipped_value_loss(VAL, VAL, meta_like(RET), MASK, 0.2),
       ValueError, r"\breturns on meta")

# ---- more devices and the readable GAE loop ---------------------------------
refuse("explained_variance-returns-on-other-device", "device", lambda: F.explained_variance(VAL, meta_like(RET), MASK),
       ValueError, r"\breturns on meta")
refuse("approx_kl-mask-on-other-device", "device", lambda: F.approx_kl(NEW, OLD, meta_like(MASK)),
       ValueError, r"\bmask on meta")
refuse("reference_kl_penalty-ref-on-other-device", "device", lambda: F.reference_kl_penalty(NEW, meta_like(OLD), MASK),
       ValueError, r"\bref_log_prob on meta")
refuse("loss_normalizer-mask-2", "mask-values", lambda: F.loss_normalizer(MASK.long() * 2),
       ValueError, r"\bmask\b")
refuse("masked_gae_reference-mask-shape", "shape", lambda: F.masked_gae_reference(REW, VAL, MASK[:1], 1.0, 0.95),
       ValueError, r"mask has shape \(1, 4\) but token_rewards has shape \(2, 4\)")
refuse("masked_gae_reference-lam-2", "hyper", lambda: F.masked_gae_reference(REW, VAL, MASK, 1.0, 2.0),
       ValueError, r"lmbda=2\.0 is outside \[0, 1\]")
accept("masked_gae_reference-nan-inf-at-masked-whitened", "masked-garbage",
       lambda: F.masked_gae_reference(REW, VAL, MASK, 0.99, 0.9),
       lambda out: (close(out[0], reference_gae_response(REW, VAL, MASK, 0.99, 0.9, average_gae=True)[0]),
                    close(out[1], reference_gae_response(REW, VAL, MASK, 0.99, 0.9)[1])))
accept("masked_gae_reference-empty-mask", "mask-empty",
       lambda: F.masked_gae_reference(REW, VAL, torch.zeros(2, 4, dtype=torch.bool), 1.0, 0.95),
       lambda out: (exactly_zero(out[0]), exactly_zero(out[1])))


# =========================================================================== #
# value.py: MaskedGAE
# =========================================================================== #


def gae_td(drop=(), batch=(2, 4), **entries):
    d = {"state_value": VAL, "mask": MASK, ("next", "reward"): REW}
    d.update({(tuple(k.split("__")) if "__" in k else k): v for k, v in entries.items()})
    for k in drop:
        d.pop(k)
    return TensorDict(d, batch_size=list(batch))


refuse("MaskedGAE-gamma-1.5", "hyper", lambda: MaskedGAE(gamma=1.5, lmbda=0.95),
       ValueError, r"gamma=1\.5 is outside \[0, 1\]")
refuse("MaskedGAE-lmbda-negative", "hyper", lambda: MaskedGAE(gamma=1.0, lmbda=-0.5),
       ValueError, r"lmbda=-0\.5 is outside \[0, 1\]")
refuse("MaskedGAE-missing-value-no-network", "missing-key", lambda: MaskedGAE(gamma=1.0, lmbda=0.95)(gae_td(drop=["state_value"])),
       KeyError, r"no 'state_value' \(the critic's values\); no value_network was given.*value_network=")
refuse("MaskedGAE-done-flags-without-next-value", "missing-key",
       lambda: MaskedGAE(gamma=1.0, lmbda=0.95)(gae_td(next__done=torch.zeros(2, 4, 1, dtype=torch.bool))),
       KeyError, r"no \('next', 'state_value'\) \(the next values\); done flags are present.*bootstrap")
refuse("MaskedGAE-per-sequence-reward-refused", "shape",
       lambda: MaskedGAE(gamma=1.0, lmbda=0.95)(gae_td(batch=(2,), next__reward=torch.ones(2, 1))),
       ValueError, r"reward \('next', 'reward'\) has shape \(2, 1\).*Broadcasting it would mix")
refuse("MaskedGAE-mask-0.5", "mask-values", lambda: MaskedGAE(gamma=1.0, lmbda=0.95)(gae_td(mask=torch.full((2, 4), 0.5))),
       ValueError, r"\bmask\b")
refuse("MaskedGAE-int-reward", "dtype",
       lambda: MaskedGAE(gamma=1.0, lmbda=0.95)(gae_td(next__reward=torch.ones(2, 4, dtype=torch.long))),
       TypeError, r"(token_rewards|reward) must be a floating-point tensor")
accept("MaskedGAE-nan-inf-at-masked", "masked-garbage", lambda: MaskedGAE(gamma=0.9, lmbda=0.8)(gae_td()),
       lambda td: (close(td["advantage"], reference_gae_response(REW, VAL, MASK, 0.9, 0.8)[0]),
                   close(td["value_target"], reference_gae_response(REW, VAL, MASK, 0.9, 0.8)[1])))
accept("MaskedGAE-collector-layout-nan-inf-at-masked", "masked-garbage",
       lambda: MaskedGAE(gamma=0.9, lmbda=0.8)(gae_td(next__state_value=torch.zeros(2, 4),
                                                       next__done=torch.zeros(2, 4, dtype=torch.bool),
                                                       next__terminated=torch.zeros(2, 4, dtype=torch.bool))),
       # no flag set: each row is cut by the batch boundary and bootstrapped from ("next", "state_value") = 0
       lambda td: close(td["advantage"], reference_gae_response(REW, VAL, MASK, 0.9, 0.8)[0]))
accept("MaskedGAE-empty-mask-whitened", "mask-empty",
       lambda: MaskedGAE(gamma=1.0, lmbda=0.95, average_gae=True)(gae_td(mask=torch.zeros(2, 4, dtype=torch.bool))),
       lambda td: (exactly_zero(td["advantage"]), exactly_zero(td["value_target"])))
accept("MaskedGAE-truncated-no-eos-bootstraps-next-value", "no-eos",
       lambda: MaskedGAE(gamma=1.0, lmbda=0.95)(gae_td(
           next__state_value=torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 2.5]]),
           next__done=torch.tensor([[False, True, False, False], [False, False, False, True]]),
           next__truncated=torch.tensor([[False, False, False, False], [False, False, False, True]]))),
       # row 0 terminates at its last valid token; row 1 is truncated (no EOS): bootstrap V = 2.5
       lambda td: close(td["advantage"], reference_gae_response(REW, VAL, MASK, 1.0, 0.95, bootstrap_value=torch.tensor([0.0, 2.5]))[0]))
refuse("MaskedGAE-value-on-other-device", "device",
       lambda: MaskedGAE(gamma=1.0, lmbda=0.95)(gae_td(state_value=meta_like(VAL))),
       ValueError, r"\bvalues on meta")
accept("MaskedGAE-empty-batch", "empty-batch",
       lambda: MaskedGAE(gamma=1.0, lmbda=0.95, average_gae=True)(gae_td(
           batch=(0, 4), state_value=torch.empty(0, 4), mask=torch.empty(0, 4, dtype=torch.bool),
           next__reward=torch.empty(0, 4))),
       lambda td: (_assert_shape(td["advantage"], (0, 4)), _assert_shape(td["value_target"], (0, 4))))


# =========================================================================== #
# loss.py: TokenPPOLoss
# =========================================================================== #


class _LogProbNet(nn.Module):
    """log_prob = -0.1 * (token + 1) + w, entropy = 1 + 0.01 * token (no NaN anywhere)."""

    def __init__(self, entropy=True):
        super().__init__()
        self.w = nn.Parameter(torch.tensor(0.05))
        self.entropy = entropy

    def forward(self, tokens):
        logp = -0.1 * (tokens.float() + 1) + self.w
        return (logp, 1.0 + 0.01 * tokens.float()) if self.entropy else logp


class _ValueNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.u = nn.Parameter(torch.tensor(0.3))

    def forward(self, tokens):
        return 0.1 * tokens.float() + self.u


TOKENS = torch.tensor([[3, 1, 4, 1], [5, 9, 2, 6]])


def ppo_nets(entropy=True):
    actor = TensorDictModule(_LogProbNet(entropy), in_keys=["tokens"],
                             out_keys=["log_prob", "entropy"] if entropy else ["log_prob"])
    critic = TensorDictModule(_ValueNet(), in_keys=["tokens"], out_keys=["state_value"])
    return actor, critic


def ppo_td(drop=(), batch=(2, 4), **entries):
    d = {"tokens": TOKENS, "mask": MASK, "sample_log_prob": OLD, "ref_log_prob": OLD - 0.1,
         "advantage": ADV, "value_target": RET, "state_value": VAL}
    d.update(entries)
    for k in drop:
        d.pop(k)
    return TensorDict(d, batch_size=list(batch))


def ppo_loss(**kw):
    actor, critic = ppo_nets(kw.pop("entropy", True))
    return TokenPPOLoss(actor, critic, **kw)


def _check_ppo_garbage(out):
    new = -0.1 * (TOKENS.float() + 1) + 0.05
    values = 0.1 * TOKENS.float() + 0.3
    close(out["loss_objective"], reference_ppo_policy_loss(new, OLD, ADV, MASK, 0.2))
    close(out["loss_critic"], 0.5 * naive_value_loss(values, VAL, RET, MASK, 0.2))
    close(out["kl_ref"], mean_k3(new, OLD - 0.1, MASK))
    close(out["entropy"], naive_mean(valid(1.0 + 0.01 * TOKENS.float())))


refuse("TokenPPOLoss-critic-coeff-negative", "hyper", lambda: ppo_loss(critic_coeff=-0.5),
       ValueError, r"critic_coeff=-0\.5 must be a float >= 0")
refuse("TokenPPOLoss-kl-coeff-nan", "hyper", lambda: ppo_loss(kl_to_ref_coeff=NAN),
       ValueError, r"kl_to_ref_coeff=nan")
refuse("TokenPPOLoss-missing-advantage-and-reward", "missing-key", lambda: ppo_loss()(ppo_td(drop=["advantage"])),
       KeyError, r"MaskedGAE: the TensorDict has no \('next', 'reward'\) \(the per-step reward\)")
refuse("TokenPPOLoss-per-sequence-advantage", "shape", lambda: ppo_loss()(ppo_td(batch=(2,), advantage=ADV[:, 0])),
       ValueError, r"advantage 'advantage' has shape \(2,\).*Broadcasting it would mix")
refuse("TokenPPOLoss-int-sample-log-prob", "dtype", lambda: ppo_loss()(ppo_td(sample_log_prob=torch.zeros(2, 4, dtype=torch.long))),
       TypeError, r"sample_log_prob must be a floating-point tensor")
refuse("TokenPPOLoss-mask-0.5", "mask-values", lambda: ppo_loss()(ppo_td(mask=torch.full((2, 4), 0.5))),
       ValueError, r"\bmask\b")
accept("TokenPPOLoss-nan-inf-at-masked", "masked-garbage",
       lambda: ppo_loss(clip_value=0.2, kl_to_ref_coeff=0.02, entropy_coeff=0.01)(ppo_td()), _check_ppo_garbage)
accept("TokenPPOLoss-empty-mask-all-terms-zero", "mask-empty",
       expecting_warning(lambda: ppo_loss(clip_value=0.2, kl_to_ref_coeff=0.02, entropy_coeff=0.01)(
           ppo_td(mask=torch.zeros(2, 4, dtype=torch.bool))), r"no valid token"),
       lambda out: [exactly_zero(out[k].detach()) for k in ("loss_objective", "loss_critic", "loss_kl_ref", "loss_entropy",
                                                            "clip_fraction", "kl_approx", "entropy", "explained_variance")])
refuse("TokenPPOLoss-sample-log-prob-on-other-device", "device",
       lambda: ppo_loss()(ppo_td(sample_log_prob=meta_like(OLD), mask=torch.ones(2, 4, dtype=torch.bool))),
       ValueError, r"\bsample_log_prob on meta")
accept("TokenPPOLoss-empty-batch", "empty-batch",
       lambda: ppo_loss(clip_value=0.2)(TensorDict(
           {"tokens": torch.empty(0, 4, dtype=torch.long), "mask": torch.empty(0, 4, dtype=torch.bool),
            **{k: torch.empty(0, 4) for k in ("sample_log_prob", "ref_log_prob", "advantage", "value_target", "state_value")}},
           batch_size=[0, 4])),
       lambda out: [exactly_zero(out[k].detach()) for k in ("loss_objective", "loss_critic", "loss_kl_ref")])


# =========================================================================== #
# transforms.py: KLPenaltyTransform and the KL controllers
# =========================================================================== #


def kl_td(drop=(), batch=(2, 4), **entries):
    d = {"sample_log_prob": NEW, "ref_log_prob": OLD, "mask": MASK, ("next", "reward"): REW}
    d.update({(tuple(k.split("__")) if "__" in k else k): v for k, v in entries.items()})
    for k in drop:
        d.pop(k)
    return TensorDict(d, batch_size=list(batch))


def _check_kl_garbage(td):
    k1 = torch.where(MASK, torch.where(MASK, NEW, 0.0) - torch.where(MASK, OLD, 0.0), 0.0)
    close(td["kl_penalty"], k1)
    close(td["next", "reward"], torch.where(MASK, torch.where(MASK, REW, 0.0) - 0.1 * k1, 0.0))


def _empty_row_score():
    td = kl_td(batch=(2,), next__reward=torch.tensor([1.0, 3.0]),
               mask=torch.tensor([[True, True, False, False], [False] * 4]))
    return KLPenaltyTransform(coeff=0.1)(td)


refuse("KLPenaltyTransform-unknown-estimator", "hyper", lambda: KLPenaltyTransform(estimator="k5"),
       ValueError, r"estimator='k5' is not one of")
refuse("KLPenaltyTransform-clamp-negative", "hyper", lambda: KLPenaltyTransform(clamp=-1.0),
       ValueError, r"clamp=-1\.0 must be a finite number > 0")
refuse("KLPenaltyTransform-negative-coeff", "hyper", lambda: KLPenaltyTransform(coeff=-0.1),
       ValueError, r"coeff=-0\.1 must be a float >= 0")
refuse("KLPenaltyTransform-coeff-module-not-a-controller", "dtype", lambda: KLPenaltyTransform(coeff=nn.Linear(1, 1)),
       TypeError, r"coeff=Linear is not a KL controller")
refuse("KLPenaltyTransform-missing-reward", "missing-key", lambda: KLPenaltyTransform()(kl_td(drop=[("next", "reward")])),
       KeyError, r"no \('next', 'reward'\) \(the reward, needed because add_to_reward=True\).*add_to_reward=False")
refuse("KLPenaltyTransform-reward-shape", "shape", lambda: KLPenaltyTransform()(kl_td(next__reward=torch.zeros(2, 5), batch=(2,))),
       ValueError, r"reward \('next', 'reward'\) has shape \(2, 5\).*broadcasting it would mix")
refuse("KLPenaltyTransform-ref-shape", "shape", lambda: KLPenaltyTransform()(kl_td(ref_log_prob=OLD[:, :3], batch=(2,))),
       ValueError, r"reference log-probs 'ref_log_prob' has shape \(2, 3\).*\(2, 4\)")
refuse("KLPenaltyTransform-int-ref", "dtype", lambda: KLPenaltyTransform()(kl_td(ref_log_prob=OLD.nan_to_num().long())),
       TypeError, r"ref_log_prob must be a floating-point tensor")
refuse("KLPenaltyTransform-mask-0.5", "mask-values", lambda: KLPenaltyTransform()(kl_td(mask=torch.full((2, 4), 0.5))),
       ValueError, r"\bmask\b")
accept("KLPenaltyTransform-nan-inf-at-masked", "masked-garbage", lambda: KLPenaltyTransform(coeff=0.1)(kl_td()),
       _check_kl_garbage)
accept("KLPenaltyTransform-empty-mask", "mask-empty",
       lambda: _kl_and_last(KLPenaltyTransform(coeff=0.1), kl_td(mask=torch.zeros(2, 4, dtype=torch.bool))),
       lambda out: (exactly_zero(out[0]["kl_penalty"]), exactly_zero(out[0]["next", "reward"]), exactly_zero(out[1])))
refuse("KLPenaltyTransform-sequence-score-on-an-empty-row", "mask-empty", _empty_row_score,
       ValueError, r"(no valid token|empty).*score")
accept("KLPenaltyTransform-empty-batch", "empty-batch",
       lambda: _kl_and_last(KLPenaltyTransform(coeff=0.1), kl_td(
           batch=(0,), sample_log_prob=torch.empty(0, 4), ref_log_prob=torch.empty(0, 4),
           mask=torch.empty(0, 4, dtype=torch.bool), next__reward=torch.empty(0, 4))),
       lambda out: (_assert_shape(out[0]["kl_penalty"], (0, 4)), exactly_zero(out[1])))


accept("KLPenaltyTransform-sequence-score-of-a-response-without-eos", "no-eos",
       # row 0 ran to the budget (every token valid, no EOS): its score lands on its last token
       lambda: KLPenaltyTransform(coeff=0.0)(kl_td(batch=(2,), next__reward=torch.tensor([1.0, 3.0]),
                                                   mask=torch.tensor([[True] * 4, [True, True, False, False]]),
                                                   sample_log_prob=torch.zeros(2, 4), ref_log_prob=torch.zeros(2, 4))),
       lambda td: close(td["next", "reward"], [[0.0, 0.0, 0.0, 1.0], [0.0, 3.0, 0.0, 0.0]]))


def _kl_env_step(ref_model=None, log_prob=True):
    from torchrl.envs import TransformedEnv

    env = TransformedEnv(TokenLMEnv.from_task(TASK, num_envs=1, seed=0), KLPenaltyTransform(ref_model))
    td = env.reset()
    td["action"] = torch.tensor([3])
    if log_prob:
        td["sample_log_prob"] = torch.tensor([-1.0])
    return env.step(td)




def _kl_and_last(transform, td):
    out = transform(td)
    return out, transform.last_kl


def _adaptive_after(kl, n_steps=1, **kw):
    ctl = AdaptiveKLController(**kw)
    ctl.update(kl, n_steps=n_steps)
    return ctl.coeff


refuse("FixedKLController-string-coeff", "dtype", lambda: FixedKLController("0.1"),
       (TypeError, ValueError), r"coeff='0\.1' must be a float")
refuse("AdaptiveKLController-target-0", "hyper", lambda: AdaptiveKLController(target=0.0),
       ValueError, r"target=0\.0 must be a finite number > 0")
refuse("AdaptiveKLController-horizon-negative", "hyper", lambda: AdaptiveKLController(horizon=-10),
       ValueError, r"horizon=-10\.0 must be a finite number > 0")
accept("AdaptiveKLController-update-with-nan-kl-keeps-coeff", "masked-garbage",
       lambda: _adaptive_after(NAN, init_coeff=0.2, target=6.0, horizon=100),
       lambda coeff: close(coeff, 0.2))
refuse("AdaptiveKLController-n-steps-beyond-horizon-flips-sign", "hyper",
       # e = -0.2 and n_steps / horizon = 10: beta * (1 - 2) would make the KL coefficient negative
       lambda: _adaptive_after(0.0, n_steps=1000, init_coeff=0.2, target=6.0, horizon=100),
       ValueError, r"n_steps.*horizon")


# =========================================================================== #
# envs.py: DigitTask, TokenLMEnv, trajectories_to_llm_batch
# =========================================================================== #

TASK = DigitTask("reverse", 3)


def _env(**kw):
    kw = {"num_envs": 1, "prompt_len": 4, "max_new_tokens": 4, "vocab_size": 16, "eos_id": 1, **kw}
    prompts = kw.pop("prompts", TASK)
    return TokenLMEnv(prompts, TASK.reward, **kw)


def _answer_without_eos():
    """Step the reverse env with the right three digits, then a digit instead of EOS."""
    env = TokenLMEnv.from_task(TASK, num_envs=1, seed=0)
    td = env.reset()
    prompt = td["tokens"][0, : env.prompt_len].tolist()  # [d0, d1, d2, '<']
    for tok in prompt[:3][::-1] + TASK.encode("0"):
        td["action"] = torch.tensor([tok])
        td = env.step(td)
        out = td["next"].clone()
        td = td["next"]
    return out


def _step_action(action):
    env = TokenLMEnv.from_task(TASK, num_envs=1, seed=0)
    td = env.reset()
    td["action"] = torch.tensor([action])
    return env.step(td)


def _constant_policy(token):
    def policy(td):
        n = td.batch_size[0]
        td["action"] = torch.full((n,), token, dtype=torch.long)
        td["sample_log_prob"] = torch.full((n,), -1.0)
        return td

    return policy


def _rollout(steps, token=TASK.encode("5")[0]):
    env = TokenLMEnv.from_task(TASK, num_envs=2, seed=0)
    return env.rollout(steps, _constant_policy(token), break_when_any_done=False), env


def _truncated_llm_batch():
    ro, env = _rollout(4)
    return trajectories_to_llm_batch(ro, env.prompt_len, env.max_new_tokens), ro, env


def _check_truncated_llm_batch(out):
    llm, ro, env = out
    P, M = env.prompt_len, env.max_new_tokens
    five = TASK.encode("5")[0]
    assert llm.batch_size == torch.Size([2])
    assert llm["truncated"].all() and not llm["terminated"].any()
    assert llm["mask"].all()  # every one of the M tokens was generated: no EOS, no padding
    close(llm["sample_log_prob"], torch.full((2, M), -1.0))
    # partial credit by hand: the target is the reversed prompt digits then EOS (K + 1 = 4 tokens)
    expected = []
    for row in ro[:, 0]["tokens"][:, :P].tolist():
        target = row[:3][::-1] + [TASK.EOS]
        expected.append(sum(t == five for t in target) / 4)
    close(llm["score"], expected)


refuse("DigitTask-min-digits-above-num-digits", "hyper", lambda: DigitTask("copy", 2, min_digits=3),
       ValueError, r"min_digits=3 must be in \[1, num_digits=2\]")
accept("DigitTask-reward-response-without-eos", "no-eos",
       lambda: TASK.reward(torch.tensor([TASK.encode("123<")]), torch.ones(1, 4, dtype=torch.bool),
                           torch.tensor([TASK.encode("3210")]), torch.ones(1, 4, dtype=torch.bool)),
       lambda out: close(out, [3 / 4]))  # three digits right, EOS missing
accept("DigitTask-reward-budget-shorter-than-answer", "no-eos",
       lambda: TASK.reward(torch.tensor([TASK.encode("123<")]), torch.ones(1, 4, dtype=torch.bool),
                           torch.tensor([TASK.encode("32")]), torch.ones(1, 2, dtype=torch.bool)),
       lambda out: close(out, [2 / 4]))  # '3', '2' right; '1' and EOS never generated
accept("DigitTask-reward-empty-batch", "empty-batch",
       lambda: TASK.reward(*(torch.zeros(0, 4, dtype=torch.long), torch.zeros(0, 4, dtype=torch.bool)) * 2),
       lambda out: _assert_shape(out, (0,)))
refuse("TokenLMEnv-max-new-tokens-0", "hyper", lambda: _env(max_new_tokens=0), ValueError, r"max_new_tokens=0 must be an int >= 1")
refuse("TokenLMEnv-empty-prompt-list", "empty-batch", lambda: _env(prompts=[]), ValueError, r"prompt source is empty")
refuse("TokenLMEnv-prompt-longer-than-prompt-len", "long-prompt", lambda: _env(prompts=[[3, 4, 5, 6, 14]]).reset(),
       ValueError, r"prompt 0 has 5 tokens but the env's prompt_len is P=4.*raise prompt_len or shorten")
refuse("TokenLMEnv-zero-length-prompt", "empty-batch", lambda: _env(prompts=[torch.tensor([], dtype=torch.long)]).reset(),
       ValueError, r"prompt 0 has 0 tokens.*every prompt needs 1\.\.P tokens")
refuse("TokenLMEnv-prompt-token-outside-vocab", "token-ids", lambda: _env(prompts=[[3, 20, 14]]).reset(),
       ValueError, r"prompt.*20.*vocab")
refuse("TokenLMEnv-action-outside-vocab", "token-ids", lambda: _step_action(99),
       ValueError, r"action.*99.*vocab")
accept("TokenLMEnv-response-without-eos-is-truncated-with-partial-credit", "no-eos", _answer_without_eos,
       lambda nxt: (close(nxt["reward"], [[0.75]]), _assert_flags(nxt, done=True, terminated=False, truncated=True)))
refuse("trajectories_to_llm_batch-missing-done", "missing-key",
       lambda: trajectories_to_llm_batch(_rollout(4)[0].exclude(("next", "done")), 4, 4),
       KeyError, r"done")
refuse("trajectories_to_llm_batch-missing-sample-log-prob", "missing-key",
       lambda: trajectories_to_llm_batch(_rollout(4)[0].exclude("sample_log_prob"), 4, 4),
       KeyError, r"sample_log_prob")
accept("trajectories_to_llm_batch-responses-without-eos", "no-eos", _truncated_llm_batch, _check_truncated_llm_batch)
accept("trajectories_to_llm_batch-no-finished-response-is-an-empty-batch", "empty-batch",
       lambda: trajectories_to_llm_batch(_rollout(2)[0], 4, 4),
       lambda llm: (_assert_shape(llm["mask"], (0, 4)), _assert_shape(llm["input_ids"], (0, 8))))


def _assert_flags(td, **flags):
    for key, value in flags.items():
        assert bool(td[key].all()) is value and bool(td[key].any()) is value, f"{key}={td[key]}, expected {value}"


# =========================================================================== #
# models.py: TinyCausalLM, the actor / critic read-outs, sampling
# =========================================================================== #


def _lm(block_size=8, seed=0):
    torch.manual_seed(seed)
    return TinyCausalLM(TinyLMConfig.preset("pico", vocab_size=16, block_size=block_size)).eval()


def _padded_row_does_not_change_the_valid_row():
    lm = _lm()
    ids = torch.tensor([[1, 2, 3], [0, 0, 0]])
    both = lm(ids, torch.tensor([[True] * 3, [False] * 3])).logits
    alone = lm(ids[:1]).logits
    return both, alone


def _ntl(position, S=6):
    with torch.no_grad():
        return NextTokenLogits(_lm())(torch.ones(1, S, dtype=torch.long), torch.ones(1, S, dtype=torch.bool),
                                      torch.tensor([position]))


def _sampled():
    lm = _lm(block_size=10)
    prompt = torch.tensor([[0, 3, 4, 14], [5, 6, 7, 14]])
    pmask = prompt != 0
    ids, logps, mask = sample_with_kv_cache(lm, prompt, pmask, 5, eos_id=1, generator=torch.Generator().manual_seed(3))
    return lm, prompt, pmask, ids, logps, mask


def _check_sampled(out):
    lm, prompt, pmask, ids, logps, mask = out
    for b in range(2):
        toks = ids[b].tolist()
        eos_at = toks.index(1) if 1 in toks else None
        expected_mask = [eos_at is None or j <= eos_at for j in range(5)]  # no EOS: every token stays valid
        assert mask[b].tolist() == expected_mask, (toks, mask[b])
    # log-probs of the valid tokens equal one full forward over prompt + response
    full_ids = torch.cat([prompt, ids], 1)
    full_mask = torch.cat([pmask, mask], 1)
    logits = lm(full_ids, full_mask).logits.double()
    ref = reference_log_probs(logits[:, 3:-1], ids)
    close(logps, torch.where(mask, ref, 0.0), atol=1e-4)


refuse("TinyLMConfig-heads-do-not-divide-width", "hyper", lambda: TinyLMConfig(n_embd=10, n_head=4),
       ValueError, r"n_embd=10 is not divisible by n_head=4.*divisors")
refuse("TinyLMConfig-vocab-0", "hyper", lambda: TinyLMConfig(vocab_size=0), ValueError, r"vocab_size=0 must be a positive int")
refuse("TinyLMConfig-dropout-1", "hyper", lambda: TinyLMConfig(dropout=1.0), ValueError, r"dropout=1\.0 must be in \[0, 1\)")
refuse("TinyCausalLM-sequence-longer-than-block-size", "long-prompt", lambda: _lm()(torch.ones(1, 9, dtype=torch.long)),
       ValueError, r"input_ids has T=9 > block_size=8")
refuse("TinyCausalLM-token-id-outside-vocab", "token-ids", lambda: _lm()(torch.tensor([[1, 20]])),
       ValueError, r"input_ids.*20.*vocab_size=16")
refuse("TinyCausalLM-attention-mask-0.5", "mask-values", lambda: _lm()(torch.tensor([[1, 2, 3]]), torch.full((1, 3), 0.5)),
       ValueError, r"\bmask\b")
refuse("TinyCausalLM-input-ids-on-other-device", "device", lambda: _lm()(torch.ones(1, 3, dtype=torch.long, device="meta")),
       ValueError, r"input_ids.*meta.*cpu")
accept("TinyCausalLM-all-padding-row-is-finite-and-isolated", "mask-empty", _padded_row_does_not_change_the_valid_row,
       lambda out: (close(out[0][1], out[0][1]), close(out[0][:1], out[1])))
accept("TinyCausalLM-empty-batch", "empty-batch", lambda: _lm()(torch.empty(0, 3, dtype=torch.long)).logits,
       lambda out: _assert_shape(out, (0, 3, 16)))
refuse("make_actor_critic-prompt-len-0", "hyper", lambda: make_actor_critic(TinyLMConfig.preset("pico"), 0),
       ValueError, r"prompt_len=0")
refuse("ResponseLogProbs-no-response-tokens", "long-prompt",
       lambda: ResponseLogProbs(_lm(), 3)(torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.bool)),
       ValueError, r"T=3 columns but prompt_len=3: there is no response to score")
refuse("ResponseValues-no-response-tokens", "long-prompt",
       lambda: ResponseValues(_lm(), 3)(torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.bool)),
       ValueError, r"T=3 columns but prompt_len=3: there is no response")
accept("ResponseLogProbs-empty-batch", "empty-batch",
       lambda: ResponseLogProbs(_lm(), 3)(torch.empty(0, 5, dtype=torch.long), torch.empty(0, 5, dtype=torch.bool)),
       lambda out: (_assert_shape(out[0], (0, 2)), _assert_shape(out[1], (0, 2))))
refuse("NextTokenLogits-position-beyond-the-buffer", "shape", lambda: _ntl(7),
       ValueError, r"position.*7.*\[1, 6\]")
refuse("NextTokenLogits-buffer-longer-than-block-size", "long-prompt", lambda: _ntl(4, S=9),
       ValueError, r"max_len=9\b")
refuse("sample_with_kv_cache-prompt-plus-budget-beyond-block-size", "long-prompt",
       lambda: sample_with_kv_cache(_lm(), torch.ones(1, 6, dtype=torch.long), torch.ones(1, 6, dtype=torch.bool), 4, eos_id=1),
       ValueError, r"max_len=10 exceeds block_size=8")
accept("sample_with_kv_cache-rows-without-eos-stay-valid", "no-eos", _sampled, _check_sampled)


def _hf_adapter():
    pytest.importorskip("transformers")
    from transformers import LlamaConfig

    from ppo_objectives.llm.hf import HFCausalLMAdapter

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, max_position_embeddings=16)
    return HFCausalLMAdapter.from_config(cfg)


refuse("HFCausalLMAdapter-kv-cache-refused", "hyper",
       lambda: _hf_adapter()(torch.ones(1, 3, dtype=torch.long), cache=object()),
       ValueError, r"cache=object is no per-row KV cache of HFCausalLMAdapter: pass the KVCache")


# =========================================================================== #
# llm/chat.py: LLMToTokenBatch, bootstrap_from_next_turn, CausalLMCritic, CausalLMTokenLogProbs
# =========================================================================== #


def _turn(prompt=(5, 6), full=(5, 6, 7, 8), log_probs=(-0.5, -0.25), reward=1.0, done=True, drop=()):
    d = {("tokens", "prompt"): torch.tensor(prompt), ("tokens", "full"): torch.tensor(full),
         ("next", "done"): torch.tensor([done]), ("next", "terminated"): torch.tensor([done])}
    if log_probs is not None:
        d[("log_probs", "response")] = torch.tensor(log_probs, dtype=torch.float32)
    if reward is not None:
        d[("next", "reward")] = torch.tensor([reward])
    for k in drop:
        d.pop(k)
    return TensorDict(d)


def _turns(*turns):
    return lazy_stack([lazy_stack(list(turns))])  # [N=1, S]


class _Decoder(nn.Module):
    """Stands in for a causal LM's decoder: last_hidden_state = embedding of the token."""

    def __init__(self, hidden=True):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10)
        self.hidden = hidden

    def forward(self, input_ids, attention_mask=None):
        h = self.emb(input_ids)
        return type("Out", (), {"last_hidden_state": h, "logits": self.head(h)} if self.hidden else {"logits": self.head(h)})()


ROW_TOKENS = torch.tensor([[1, 2, 3, 0], [4, 5, 6, 7]])
ROW_MASK = torch.tensor([[False, True, True, False], [False, True, False, True]])


def _critic(**kw):
    return CausalLMCritic(_Decoder(**kw), hidden_size=4)


def _boot_td(drop=()):
    d = {"mask": torch.tensor([[False, True, True]]), "next_turn_row": torch.full((1, 3), -1),
         "state_value": torch.zeros(1, 3), ("next", "state_value"): torch.zeros(1, 3)}
    for k in drop:
        d.pop(k)
    return TensorDict(d, [1, 3])


refuse("LLMToTokenBatch-unknown-layout", "hyper", lambda: LLMToTokenBatch(layout="row"), ValueError, r"layout='row' must be 'dialog'.*or 'turn'")
refuse("LLMToTokenBatch-unknown-out-key", "missing-key", lambda: LLMToTokenBatch().set_out_keys(maskk="m"),
       ValueError, r"unknown out key 'maskk'; the out keys are")
refuse("LLMToTokenBatch-single-turn-without-batch", "shape", lambda: LLMToTokenBatch()(_turn()),
       ValueError, r"needs a batch of turns.*lazy_stack")
refuse("LLMToTokenBatch-missing-tokens", "missing-key", lambda: LLMToTokenBatch()(_turns(_turn(drop=[("tokens", "full")]))),
       KeyError, r"LLMToTokenBatch: the TensorDict has no \('tokens', 'full'\) \(the turn tokens\)")
refuse("LLMToTokenBatch-missing-prompt", "missing-key", lambda: LLMToTokenBatch()(_turns(_turn(drop=[("tokens", "prompt")]))),
       KeyError, r"no \('tokens', 'prompt'\) \(the prompt tokens\); they locate the generated tokens")
refuse("LLMToTokenBatch-missing-reward", "missing-key", lambda: LLMToTokenBatch()(_turns(_turn(reward=None))),
       KeyError, r"turn \[0, 0\]: the TensorDict has no \('next', 'reward'\) \(the reward\);.*reward_key=None")
refuse("LLMToTokenBatch-prompt-not-a-prefix", "shape", lambda: LLMToTokenBatch()(_turns(_turn(prompt=(5, 9)))),
       ValueError, r"prompt \('tokens', 'prompt'\) \(length 2\) is not a prefix")
refuse("LLMToTokenBatch-log-probs-length", "shape", lambda: LLMToTokenBatch()(_turns(_turn(log_probs=(-0.5,)))),
       ValueError, r"has 1 entries but the turn generated 2 tokens")
refuse("LLMToTokenBatch-float-token-ids", "dtype", lambda: LLMToTokenBatch()(_turns(_turn(prompt=(5.0, 6.0), full=(5.0, 6.0, 7.0)))),
       TypeError, r"token ids must be integers, got torch\.float32")
refuse("LLMToTokenBatch-empty-batch", "empty-batch",
       lambda: LLMToTokenBatch()(TensorDict({("tokens", "full"): torch.zeros(0, 3, dtype=torch.long),
                                             ("tokens", "prompt"): torch.zeros(0, 2, dtype=torch.long)}, [0])),
       ValueError, r"LLMToTokenBatch.*(no turns|empty batch)")
accept("LLMToTokenBatch-unfinished-dialog-no-eos", "no-eos", lambda: LLMToTokenBatch()(_turns(_turn(done=False))),
       lambda out: (exactly_zero(out["next", "done"].float()), exactly_zero(out["next", "terminated"].float()),
                    close(out["next", "reward"].squeeze(-1), [[0.0, 0.0, 0.0, 1.0]]),
                    close(out["sample_log_prob"], [[0.0, 0.0, -0.5, -0.25]])))
refuse("bootstrap_from_next_turn-missing-link", "missing-key", lambda: bootstrap_from_next_turn(_boot_td(drop=["next_turn_row"])),
       KeyError, r"no 'next_turn_row' \(the next turn's row\); it is written by LLMToTokenBatch\(layout='turn'\)")
refuse("bootstrap_from_next_turn-missing-values", "missing-key", lambda: bootstrap_from_next_turn(_boot_td(drop=["state_value"])),
       KeyError, r"run the critic first")
refuse("bootstrap_from_next_turn-missing-mask", "missing-key", lambda: bootstrap_from_next_turn(_boot_td(drop=["mask"])),
       KeyError, r"bootstrap_from_next_turn: the TensorDict has no 'mask' \(the response mask\)")
refuse("CausalLMCritic-no-hidden-size", "hyper", lambda: CausalLMCritic(_Decoder()),
       ValueError, r"cannot read hidden_size from _Decoder\.config; pass hidden_size=")
refuse("CausalLMCritic-float-tokens", "dtype", lambda: _critic().values(ROW_TOKENS.float()),
       TypeError, r"CausalLMCritic: tokens")
refuse("CausalLMCritic-mask-shape", "shape", lambda: _critic().values(ROW_TOKENS, mask=ROW_MASK[:, :3]),
       ValueError, r"mask has shape \(2, 3\) but tokens has shape \(2, 4\)")
refuse("CausalLMCritic-mask-2", "mask-values", lambda: _critic().values(ROW_TOKENS, mask=ROW_MASK.long() * 2),
       ValueError, r"\bmask\b")
refuse("CausalLMCritic-model-without-hidden-states", "dtype", lambda: _critic(hidden=False).values(ROW_TOKENS),
       TypeError, r"returned no last_hidden_state.*model\.base_model")
accept("CausalLMCritic-empty-mask-values-zero", "mask-empty",
       lambda: _critic().values(ROW_TOKENS, mask=torch.zeros(2, 4, dtype=torch.bool)),
       lambda out: (exactly_zero(out[0]), exactly_zero(out[1])))
refuse("CausalLMCritic-mask-on-other-device", "device", lambda: _critic().values(ROW_TOKENS, mask=meta_like(ROW_MASK)),
       ValueError, r"\bmask on meta")


def _hf_critic_values():
    adapter = _hf_adapter()
    critic = CausalLMCritic(adapter.hf_model)  # hidden_size read from the Llama config
    mask = torch.zeros(2, 4, dtype=torch.bool)
    return critic.values(torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]]), torch.ones(2, 4, dtype=torch.bool), mask)


accept("CausalLMCritic-hf-llama-empty-mask-values-zero", "mask-empty", _hf_critic_values,
       lambda out: (exactly_zero(out[0].detach()), exactly_zero(out[1].detach())))
refuse("CausalLMTokenLogProbs-attention-mask-0.5", "mask-values",
       lambda: CausalLMTokenLogProbs(_Decoder()).log_probs(ROW_TOKENS, torch.full((2, 4), 0.5)),
       ValueError, r"\bmask\b")
accept("CausalLMTokenLogProbs-matches-naive-and-zero-off-mask", "mask-empty",
       lambda: (CausalLMTokenLogProbs(_Decoder()).log_probs(ROW_TOKENS, mask=ROW_MASK)[0],
                _Decoder()(ROW_TOKENS).logits.detach()),
       lambda out: close(out[0].detach(), torch.where(ROW_MASK, torch.cat(
           [torch.zeros(2, 1, dtype=torch.float64),
            reference_log_probs(out[1][:, :-1], ROW_TOKENS[:, 1:])], 1), 0.0)))
accept("CausalLMTokenLogProbs-one-token-rows-are-zero", "empty-batch",
       lambda: CausalLMTokenLogProbs(_Decoder()).log_probs(ROW_TOKENS[:, :1]),
       lambda out: (exactly_zero(out[0].detach()), _assert_shape(out[0], (2, 1))))


# =========================================================================== #
# train.py: the public entry points
# =========================================================================== #


def _train(**overrides):
    from ppo_objectives import train as T

    with tempfile.TemporaryDirectory() as out:
        cfg = T.TrainConfig(**{"iterations": 1, "preset": "pico", "num_envs": 2, "warmup_steps": 0, "ppo_epochs": 1,
                               "minibatches": 1, "no_plot": True, "no_progress": True, "out": out, **overrides})
        return T.train(cfg)


def _llm_batch(B, P=4, R=4, drop=()):
    llm = TensorDict({"input_ids": torch.ones(B, P + R, dtype=torch.long), "attention_mask": torch.ones(B, P + R, dtype=torch.bool),
                      "mask": torch.ones(B, R, dtype=torch.bool),
                      **{k: torch.zeros(B, R) for k in ("sample_log_prob", "advantage", "value_target", "state_value")}},
                     batch_size=[B])
    return llm.exclude(*drop)


def _ppo_update_on(llm, P=4, R=4):
    from ppo_objectives import train as T

    torch.manual_seed(0)
    ac = make_actor_critic(TinyLMConfig.preset("pico", vocab_size=16, block_size=P + R), P)
    loss = TokenPPOLoss(ac.actor, ac.critic, kl_to_ref_coeff=0.0, entropy_bonus=True, functional=False)
    opts = (torch.optim.AdamW(ac.actor_parameters()), torch.optim.AdamW(ac.critic_parameters()))
    before = [p.detach().clone() for p in ac.actor_parameters()]
    stats = T.ppo_update(llm, loss, ac, opts, T.TrainConfig(), torch.Generator().manual_seed(0))
    return stats, before, ac


def _ppo_update_on_empty_batch():
    return _ppo_update_on(_llm_batch(B=0))


def _check_no_update(out):
    stats, before, ac = out
    assert stats["updates"] == 0 and stats["early_stopped"] == 0, stats
    assert all(torch.equal(a, b) for a, b in zip(before, ac.actor_parameters()))


refuse("train-gamma-1.5", "hyper", lambda: _train(gamma=1.5), ValueError, r"gamma=1\.5 is outside \[0, 1\]")
refuse("train-clip-epsilon-0", "hyper", lambda: _train(clip_epsilon=0.0), ValueError, r"TrainConfig clip_epsilon=0\.0")
refuse("train-negative-kl-coef", "hyper", lambda: _train(kl_reward_coeff=-0.1), ValueError, r"coeff=-0\.1 must be a float >= 0")
refuse("train-zero-digits", "hyper", lambda: _train(digits=0), ValueError, r"num_digits=0")
refuse("train-zero-envs", "hyper", lambda: _train(num_envs=0), ValueError, r"TrainConfig num_envs=0")
refuse("train-zero-minibatches", "hyper", lambda: _train(minibatches=0), ValueError, r"minibatches=0")
refuse("train-cli-unknown-preset", "hyper", lambda: _cli(["--preset", "giga"]), SystemExit, r"^2$")
accept("ppo_update-empty-batch-takes-no-step", "empty-batch", _ppo_update_on_empty_batch, _check_no_update)
refuse("ppo_update-batch-without-sampling-log-probs", "missing-key", lambda: _ppo_update_on(_llm_batch(B=2, drop=["sample_log_prob"])),
       KeyError, r"TokenPPOLoss: .*'sample_log_prob'")



def _cli(argv):
    import contextlib
    import io

    from ppo_objectives import train as T

    with contextlib.redirect_stderr(io.StringIO()):
        return T.main(argv)


# =========================================================================== #
# What a user working from the README, tutorials and docstrings ran into:
# mistakes that passed silently, and errors that did not say what to do
# =========================================================================== #

ALL = torch.ones(2, 4, dtype=torch.bool)


def clean(x):
    """``x`` with its masked garbage replaced by 0 (finite everywhere)."""
    return torch.where(MASK, x, 0.0)


def at(x, pos, value):
    """A copy of ``x`` holding ``value`` at ``pos``."""
    x = x.clone()
    x[pos] = value
    return x


def _step_with_reward(reward_fn):
    """Two rows of a one-token env; both finish at the first step, so reward_fn gets k = 2 responses."""
    env = TokenLMEnv(TASK, reward_fn, num_envs=2, prompt_len=4, max_new_tokens=1, vocab_size=16, eos_id=1)
    td = env.reset()
    td["action"] = torch.tensor([5, 1])
    return env.step(td)


def _factory(vocab_size=16, P=4, R=4):
    torch.manual_seed(0)
    return make_actor_critic(TinyLMConfig.preset("pico", vocab_size=vocab_size, block_size=P + R), P)


def _policy_on_env(vocab_size):
    """The env policy of a model with ``vocab_size`` tokens on a TokenLMEnv of 16 (prompts hold '<' = 14)."""
    env = TokenLMEnv.from_task(TASK, num_envs=2, seed=0)
    with torch.no_grad():
        return _factory(vocab_size).policy(env.reset())


def _loss_on_raw_collector_batch():
    env = TokenLMEnv.from_task(TASK, num_envs=2, seed=0)
    ac = _factory()
    with torch.no_grad():
        batch = env.rollout(4, ac.policy, break_when_any_done=False)  # [N, T] steps, as a collector gives them
    return TokenPPOLoss(ac.actor, ac.critic)(batch)


def _loss_with_critic_reading(key):
    actor = TensorDictModule(_LogProbNet(entropy=False), in_keys=["tokens"], out_keys=["log_prob"])
    critic = TensorDictModule(_ValueNet(), in_keys=[key], out_keys=["state_value"])
    return TokenPPOLoss(actor, critic)(ppo_td())


def _torchrl_gae_on_response_layout():
    from torchrl.objectives.utils import ValueEstimators

    ac = _factory()
    loss = TokenPPOLoss(ac.actor, ac.critic, kl_to_ref_coeff=0.0)
    loss.make_value_estimator(ValueEstimators.GAE, gamma=1.0, lmbda=0.95)
    llm = _llm_batch(2, drop=["advantage", "value_target"])
    llm.set(("next", "reward"), torch.zeros(2, 4))
    return loss(llm)


def _check_nan_reaches_only_its_row(td):
    adv = td["advantage"]
    assert torch.isnan(adv[0, :2]).all(), adv  # the checks are off: the NaN goes through, as documented
    close(adv[1], reference_gae_response(at(REW, (0, 1), 0.0), VAL, MASK, 1.0, 0.95)[0][1])


def _empty_mask_warnings_shown_by_default():
    """Python's default filter: the warning of three calls on all-False masks is shown once."""
    loss, td = ppo_loss(), ppo_td(mask=torch.zeros(2, 4, dtype=torch.bool))
    with warnings.catch_warnings(record=True) as seen:
        warnings.resetwarnings()
        warnings.simplefilter("default")
        for _ in range(3):
            loss(td)
    return [w for w in seen if "no valid token" in str(w.message)]


def _check_missing_mask_counts_every_token(out):
    new = -0.1 * (TOKENS.float() + 1) + 0.05
    close(out["loss_objective"], reference_ppo_policy_loss(new, clean(OLD), clean(ADV), ALL, 0.2))
    close(out["kl_ref"], mean_k3(new, clean(OLD) - 0.1, ALL))


# 1. a float action is not a token id
refuse("TokenLMEnv-float-action-is-not-truncated-to-a-token", "dtype", lambda: _step_action(3.7),
       TypeError, r"action has dtype torch\.float32.*pass an integer tensor.*\(3\.7 is not token 3\)")
refuse("TokenLMEnv-bool-action", "dtype", lambda: _step_action(True), TypeError, r"action has dtype torch\.bool")
# 2. reward_fn returns exactly [k]
refuse("TokenLMEnv-reward-fn-returns-k-by-1", "shape",
       lambda: _step_with_reward(lambda p, pm, r, rm: torch.ones(r.shape[0], 1)),
       ValueError, r"reward_fn returned shape \(2, 1\) for k=2 finished responses; expected \[k\] = \(2,\).*squeeze\(-1\)")
refuse("TokenLMEnv-reward-fn-returns-a-scalar", "shape", lambda: _step_with_reward(lambda p, pm, r, rm: torch.tensor(1.0)),
       ValueError, r"reward_fn returned shape \(\) for k=2 finished responses; expected \[k\]")
accept("TokenLMEnv-reward-fn-returns-a-list-of-k", "shape",
       lambda: _step_with_reward(lambda p, pm, r, rm: [0.5, 0.25]),
       lambda td: close(td["next", "reward"], [[0.5], [0.25]]))
# 3. NaN / inf at a valid token is refused by MaskedGAE (garbage at masked tokens stays allowed, see above)
refuse("MaskedGAE-nan-reward-at-a-valid-token", "non-finite",
       lambda: MaskedGAE(gamma=1.0, lmbda=0.95)(gae_td(next__reward=at(REW, (0, 1), NAN))),
       ValueError, r"reward \('next', 'reward'\) holds nan at the valid position \(0, 1\).*mask the step out")
refuse("MaskedGAE-inf-value-at-a-valid-token-whitened", "non-finite",
       lambda: MaskedGAE(gamma=1.0, lmbda=0.95, average_gae=True)(gae_td(state_value=at(VAL, (1, 2), INF))),
       ValueError, r"value 'state_value' holds inf at the valid position \(1, 2\)")
refuse("MaskedGAE-nan-bootstrap-value-of-a-truncated-row", "non-finite",
       lambda: MaskedGAE(gamma=1.0, lmbda=0.95)(gae_td(
           next__state_value=at(torch.zeros(2, 4), (1, 3), NAN),
           next__done=torch.tensor([[False, True, False, False], [False, False, False, True]]),
           next__truncated=torch.tensor([[False, False, False, False], [False, False, False, True]]))),
       ValueError, r"next value \('next', 'state_value'\) holds nan at the valid position \(1, 3\)")
refuse("TokenPPOLoss-nan-reward-at-a-valid-token-via-its-estimator", "non-finite",
       lambda: ppo_loss()(ppo_td(drop=["advantage"]).set(("next", "reward"), at(REW, (1, 3), NAN))),
       ValueError, r"MaskedGAE: the reward \('next', 'reward'\) holds nan at the valid position \(1, 3\)")
accept("MaskedGAE-nan-at-a-valid-token-passes-under-value-checks-off", "non-finite",
       unchecked(lambda: MaskedGAE(gamma=1.0, lmbda=0.95)(gae_td(next__reward=at(REW, (0, 1), NAN)))),
       _check_nan_reaches_only_its_row)
# 4. a batch with no valid token: warned about (once, by Python's default filter), still exactly 0
accept("TokenPPOLoss-all-false-mask-warns-once", "mask-empty", _empty_mask_warnings_shown_by_default,
       lambda shown: len(shown) == 1 or pytest.fail(f"shown {len(shown)} times"))
accept("TokenPPOLoss-all-false-mask-silent-under-value-checks-off", "mask-empty",
       unchecked(lambda: ppo_loss()(ppo_td(mask=torch.zeros(2, 4, dtype=torch.bool)))),
       lambda out: exactly_zero(out["loss_objective"].detach()))
# 5. a missing mask counts every token (TorchRL's convention, documented in each docstring)
accept("TokenPPOLoss-missing-mask-counts-every-token", "missing-key",
       lambda: ppo_loss()(ppo_td(drop=["mask"], sample_log_prob=clean(OLD), ref_log_prob=clean(OLD) - 0.1,
                                 advantage=clean(ADV), value_target=clean(RET), state_value=clean(VAL))),
       _check_missing_mask_counts_every_token)
accept("MaskedGAE-missing-mask-counts-every-step", "missing-key",
       lambda: MaskedGAE(gamma=0.9, lmbda=0.8)(gae_td(drop=["mask"], next__reward=clean(REW), state_value=clean(VAL))),
       lambda td: close(td["advantage"], reference_gae_response(clean(REW), clean(VAL), ALL, 0.9, 0.8)[0]))
accept("KLPenaltyTransform-missing-mask-counts-every-token", "missing-key",
       lambda: KLPenaltyTransform(coeff=0.1)(kl_td(drop=["mask"], sample_log_prob=clean(NEW), ref_log_prob=clean(OLD),
                                                   next__reward=clean(REW))),
       lambda td: close(td["kl_penalty"], clean(NEW) - clean(OLD)))
# 6. a model vocabulary smaller than the env's
refuse("NextTokenLogits-model-vocab-smaller-than-the-env's", "token-ids", lambda: _policy_on_env(vocab_size=8),
       ValueError, r"tokens holds token id 14, outside the model's vocabulary \[0, vocab_size=8\).*"
                   r"TokenLMEnv vocab_size.*vocab_size >= env\.vocab_size")
refuse("HFCausalLMAdapter-token-id-outside-vocab", "token-ids", lambda: _hf_adapter()(torch.tensor([[1, 40]])),
       ValueError, r"HFCausalLMAdapter: input_ids holds token id 40, outside \[0, vocab_size=32\)")
refuse("make_actor_critic-actor-model-vocab-smaller-than-the-batch's", "token-ids",
       lambda: _factory(vocab_size=8).actor(_llm_batch(2).set("input_ids", torch.full((2, 8), 12))),
       ValueError, r"input_ids holds token id 12, outside \[0, vocab_size=8\)")
# 7. the loss checks its networks' in_keys before calling them
refuse("TokenPPOLoss-raw-collector-batch", "layout", _loss_on_raw_collector_batch,
       KeyError, r"'input_ids'.*raw collector batch")
refuse("TokenPPOLoss-critic-input-missing", "missing-key", lambda: _loss_with_critic_reading("prev_tokens"),
       KeyError, r"no 'prev_tokens' \(an input of the critic_network, whose in_keys are \['prev_tokens'\]\)")
# 8. a TensorDict without a batch dimension
refuse("TokenPPOLoss-no-batch-dimension", "shape",
       lambda: TokenPPOLoss(_factory().actor, _factory().critic, kl_to_ref_coeff=0.0)(_llm_batch(1)[0]),
       ValueError, r"TokenPPOLoss: the TensorDict has batch_size=\(\) \(no batch dimension\); expected \[B\].*td\.unsqueeze\(0\)")
refuse("ResponseLogProbs-no-batch-dimension", "shape", lambda: _factory().actor(_llm_batch(1)[0]),
       ValueError, r"ResponseLogProbs: input_ids has shape \(8,\) but \[B, P \+ R\] is expected.*batch_size=\[B\].*td\.unsqueeze\(0\)")
refuse("ResponseValues-no-batch-dimension", "shape", lambda: _factory().critic(_llm_batch(1)[0]),
       ValueError, r"ResponseValues: input_ids has shape \(8,\) but \[B, P \+ R\] is expected")
# 9. TorchRL's GAE on response-layout data
refuse("TokenPPOLoss-torchrl-gae-on-response-layout", "layout", _torchrl_gae_on_response_layout,
       ValueError, r"the value estimator is GAE.*holds a mask 'mask' that TorchRL's GAE ignores.*"
                   r"Response-layout data needs MaskedGAE: loss\.make_value_estimator\(MaskedGAE\(")
# 10. the collector postproc
refuse("ToLLMBatch-prompt-len-0", "hyper", lambda: ToLLMBatch(0, 4),
       ValueError, r"ToLLMBatch prompt_len=0 must be an int >= 1 \(the env's prompt width, env\.prompt_len\)")
refuse("ToLLMBatch-single-step", "shape", lambda: ToLLMBatch(4, 4)(TokenLMEnv.from_task(TASK, num_envs=1).reset()[0]),
       ValueError, r"got batch_size \(\)")
accept("ToLLMBatch-reward-where-MaskedGAE-reads-it", "no-eos", lambda: ToLLMBatch(4, 4)(_rollout(4)[0]),
       lambda llm: (close(llm["next", "reward"], llm["token_reward"]), _assert_shape(llm["next", "reward"], (2, 4))))


# ---- composing the modules: the silent mistakes ------------------------------


def _add_rollout():
    """A collector-style rollout of the two-digit add task: P = 6, M = 4 (swapping them is visible)."""
    task = DigitTask("add", 2)
    env = TokenLMEnv.from_task(task, num_envs=2, seed=0)
    return env.rollout(4, _constant_policy(task.encode("5")[0]), break_when_any_done=False)


def _kit():
    from ppo_objectives import testing as K

    return K


def _kit_loss(critic: bool, **kw):
    actor, crit = _kit().tiny_actor_critic()
    return TokenPPOLoss(actor, crit if critic else None, **kw)


def _singleton_groups():
    from ppo_objectives.value.critic_free import GroupAdvantage

    td = _kit().response_batch(batch_size=4, response_len=3, seed=0)
    td.set("score", torch.rand(4))
    td.set("group", torch.arange(4))
    return GroupAdvantage("grpo")(td)


def _dropout_module():
    class Noisy(nn.Module):  # a reward shaper with dropout left in training mode
        def __init__(self):
            super().__init__()
            self.drop = nn.Dropout(0.5)

        def forward(self, r):
            return self.drop(r)

    m = TensorDictModule(Noisy(), in_keys=[("next", "reward")], out_keys=["shaped"])
    return _kit().assert_mask_invariant(m, _kit().response_batch(batch_size=4, response_len=5, seed=0))


def _untokenized_checkpoint():
    from ppo_objectives.train.pretrained import load_policy_model, write_tiny_checkpoint

    path = write_tiny_checkpoint(tempfile.mkdtemp(), "llama", hidden_size=16, num_layers=1, with_tokenizer=False)
    return load_policy_model(path, TASK)


refuse("ToLLMBatch-arguments-swapped", "composition", lambda: ToLLMBatch(4, 6)(_add_rollout()),
       ValueError, r"responses of this batch start at column 6, but prompt_len is 4 .*were the two swapped\?.*"
                   r"ToLLMBatch\(env\.prompt_len, env\.max_new_tokens\)")
refuse("ToLLMBatch-wrong-budget", "composition", lambda: ToLLMBatch(6, 5)(_add_rollout()),
       ValueError, r"token buffer has S=10 columns, but prompt_len \+ max_new_tokens = 6 \+ 5 = 11")
refuse("KLPenaltyTransform-after-GAE", "composition",
       lambda: KLPenaltyTransform(coeff=0.1)(_kit().response_batch(batch_size=2, response_len=3, with_advantage=True)),
       ValueError, r"already holds 'advantage'.*run KLPenaltyTransform before MaskedGAE")
refuse("kl_estimate-probabilities", "composition", lambda: F.kl_estimate(torch.tensor([[0.5, 0.25]]), torch.tensor([[-0.2, -1.0]])),
       ValueError, r"log_prob has a value of 0\.5 at a valid position, but log-probabilities are <= 0; it holds no "
                   r"negative value, so it looks like probabilities: pass the log-probs")
refuse("TokenPPOLoss-no-reference-log-probs", "missing-key",
       lambda: _kit_loss(False)(_kit().response_batch(batch_size=2, response_len=3, with_advantage=True,
                                                      with_ref_log_prob=False)),
       KeyError, r"ref_log_prob.*run KLPenaltyTransform\(ref\) on the batch first.*frozen_reference.*kl_to_ref_coeff=0\.0")
refuse("TokenPPOLoss-critic-free-without-advantage", "missing-key",
       lambda: _kit_loss(False, kl_to_ref_coeff=0.0)(_kit().response_batch(batch_size=2, response_len=3)),
       KeyError, r"has no critic and the batch has no 'advantage'.*GroupAdvantage")
refuse("TokenPPOLoss-critic-with-GroupAdvantage", "composition",
       lambda: _kit_loss(True).make_value_estimator(__import__("ppo_objectives").GroupAdvantage("grpo")),
       ValueError, r"GroupAdvantage has no critic .* would regress the critic onto advantages.*TokenPPOLoss\(actor, None")
warns("TokenPPOLoss-dr-grpo-token-mean", "composition",
      lambda: _kit_loss(False).make_value_estimator(__import__("ppo_objectives").GroupAdvantage("dr_grpo")),
      UserWarning, r"defined with aggregation='token-sum-norm'")
warns("GroupAdvantage-every-group-a-singleton", "composition", _singleton_groups,
      UserWarning, r"every group in this batch of 4 responses has one response.*group_size")
refuse("frozen_reference-of-the-read-out", "composition",
       lambda: frozen_reference(_factory().actor, 4),
       TypeError, r"actor_model must be the causal LM.*pass ac\.actor_model, not the TensorDict read-out ac\.actor")
refuse("assert_mask_invariant-dropout-in-train-mode", "composition", _dropout_module,
       AssertionError, r"not deterministic.*dropout in training mode.*module\.eval\(\)")


# =========================================================================== #
# The tests
# =========================================================================== #


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_refused_clearly_or_handled_correctly(case):
    if case.raises is not None:
        with pytest.raises(case.raises, match=case.match):
            case.call()
    else:
        case.check(case.call())


def test_matrix_covers_every_category_with_enough_cases():
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids)), [i for i, n in Counter(ids).items() if n > 1]
    kinds = Counter(c.kind for c in CASES)
    assert set(kinds) <= set(KINDS), set(kinds) - set(KINDS)
    assert set(KINDS) <= set(kinds), f"categories without a case: {set(KINDS) - set(kinds)}"
    assert len(CASES) >= 60
    for c in CASES:
        assert (c.raises is None) != (c.check is None), c.id
        assert c.raises is None or c.match, f"{c.id}: an expected error needs a message pattern"

"""The real-model paths on every available device (CPU here, CUDA as well on a GPU machine).

Each test takes the ``device`` fixture (``tests/conftest.py``), so ``pytest -m cuda`` selects its
CUDA cases and ``benchmarks/gpu_check.sh`` runs them: the hidden-state log-probs (float32 and
bf16), the Hugging Face per-row KV cache against the full forward, and the training job on a
local checkpoint in bfloat16 with activation checkpointing.
"""

from __future__ import annotations

import pytest
import torch

from ppo_objectives import pretrained as PT
from ppo_objectives import train as T
from ppo_objectives.envs import DigitTask
from ppo_objectives.functional import response_log_probs_from_hidden
from ppo_objectives.models import HFCausalLMAdapter, position_ids_from_mask

transformers = pytest.importorskip("transformers")


def _naive(hidden, weight, ids, prompt_lens, R):
    """float64 ``log_softmax(hidden @ W.T).gather`` and the entropy at the response positions."""
    logq = torch.log_softmax(hidden.double() @ weight.double().T, dim=-1)
    pos = prompt_lens[:, None] - 1 + torch.arange(R, device=hidden.device)
    rows = logq[torch.arange(hidden.shape[0], device=hidden.device)[:, None], pos]
    logp = rows.gather(-1, ids.gather(1, pos + 1)[..., None]).squeeze(-1)
    return logp, -(rows.exp() * rows).sum(-1)


def _inputs(device, dtype, B=3, T_=40, C=16, V=5000, R=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T_, C, generator=g, dtype=torch.float64)
    weight = torch.randn(V, C, generator=g, dtype=torch.float64) / C**0.5
    ids = torch.randint(0, V, (B, T_), generator=g)
    prompt_lens = torch.randint(1, T_ - R + 1, (B,), generator=g)
    to = dict(device=device, dtype=dtype)
    return (hidden.to(**to).requires_grad_(), weight.to(**to).requires_grad_(), ids.to(device),
            prompt_lens.to(device), R)


def _value_and_grads(fn, hidden, weight, *rest):
    logp, ent = fn(hidden, weight, *rest)
    (logp.sum() + 0.1 * ent.sum()).backward()
    return logp.detach(), ent.detach(), hidden.grad.clone(), weight.grad.clone()


def test_hidden_log_probs_and_their_gradients_equal_the_float64_reference(device):
    h, w, ids, lens, R = _inputs(device, torch.float32)
    got = _value_and_grads(
        lambda *a: response_log_probs_from_hidden(*a, return_entropy=True, chunk_size=7), h, w, ids, lens, R)
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = _value_and_grads(_naive, h64, w64, ids, lens, R)
    for name, a, b in zip(("logp", "entropy", "d hidden", "d weight"), got, ref):
        assert a.device.type == device.type
        torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=1e-5, msg=name)


def test_hidden_log_probs_in_bf16_are_within_the_documented_rounding_of_float32(device):
    # tests/test_logprobs_hidden.py derives the bound: 0.01 + 0.005 * max|logit| for the values,
    # 0.03 of the largest float32 gradient entry for the gradients
    h, w, ids, lens, R = _inputs(device, torch.float32, seed=1)
    ref = _value_and_grads(lambda *a: response_log_probs_from_hidden(*a, return_entropy=True), h, w, ids, lens, R)
    hb, wb = h.detach().bfloat16().requires_grad_(), w.detach().bfloat16().requires_grad_()
    got = _value_and_grads(lambda *a: response_log_probs_from_hidden(*a, return_entropy=True), hb, wb, ids, lens, R)
    assert got[0].dtype == torch.float32  # log-probs come back in float32 from bf16 inputs
    bound = 0.01 + 0.005 * float((h.detach() @ w.detach().T).abs().max())
    for name, a, b in zip(("logp", "entropy"), got[:2], ref[:2]):
        torch.testing.assert_close(a.float(), b, atol=bound, rtol=0, msg=name)
    for name, a, b in zip(("d hidden", "d weight"), got[2:], ref[2:]):
        torch.testing.assert_close(a.float(), b, atol=0.03 * float(b.abs().max()), rtol=0, msg=name)


def _llama(device):
    cfg = transformers.LlamaConfig(
        vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return HFCausalLMAdapter.from_config(cfg).to(device).eval()


def test_hf_kv_cache_with_left_padding_equals_the_full_forward(device):
    lm = _llama(device)
    assert lm.supports_kv_cache
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(1, 48, (3, 10), generator=g).to(device)
    mask = torch.ones(3, 10, dtype=torch.bool, device=device)
    mask[0, :3] = False  # left padding of different widths
    mask[1, :5] = False
    pos = position_ids_from_mask(mask)
    cache = lm.new_cache(3, 12)
    assert cache.k.device.type == device.type
    with torch.no_grad():
        full = lm(ids, mask).logits
        pieces = [lm(ids[:, :6], mask[:, :6], position_ids=pos[:, :6], cache=cache, cache_slots=0).logits]
        for t in range(6, 10):  # one token per call, at per-row slots
            slots = torch.full((3, 1), t, device=device)
            pieces.append(lm(ids[:, t:t + 1], mask[:, t:t + 1], position_ids=pos[:, t:t + 1], cache=cache,
                             cache_slots=slots).logits)
    torch.testing.assert_close(torch.cat(pieces, 1)[mask], full[mask], atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_the_job_on_a_checkpoint_in_bfloat16_with_activation_checkpointing(device, tmp_path):
    path = PT.write_tiny_checkpoint(tmp_path / "ckpt", "qwen2", task=DigitTask("reverse", 3), hidden_size=32,
                                    num_layers=1, num_heads=4, num_kv_heads=2)
    out = tmp_path / "run"
    T.main(["--model", str(path), "--device", device.type, "--dtype", "bfloat16", "--grad-checkpointing",
            "--iterations", "2", "--num-envs", "8", "--warmup-steps", "3", "--ppo-epochs", "1",
            "--minibatches", "2", "--no-plot", "--no-progress", "--out", str(out)])
    rows = T.read_metrics(out / "metrics.csv")
    assert len(rows) == 2 and rows[-1]["updates"] >= 1
    for key in ("reward", "loss_objective", "loss_critic", "kl_ref", "entropy"):
        assert all(torch.isfinite(torch.tensor(r[key])) for r in rows), key
    state = torch.load(out / "checkpoint.pt", weights_only=False, map_location="cpu")
    assert {v.dtype for v in state["actor_model"].values()} == {torch.float32}
    assert {v.dtype for v in state["reference"].values()} == {torch.bfloat16}

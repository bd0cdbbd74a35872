"""Mixed precision (``autocast_dtype``) on both causal LMs, and the per-row KV cache of HFCausalLMAdapter."""

import copy

import pytest
import torch

from ppo_objectives.models import HFCausalLMAdapter, TinyCausalLM, TinyLMConfig, position_ids_from_mask
from ppo_objectives.policy import NextTokenLogits

transformers = pytest.importorskip("transformers")

# Largest |log_softmax difference| measured against float32 on the tiny models below (seed 0):
# TinyCausalLM nano bf16 2.3e-3, fp16 3.7e-4; Llama (32 wide, 2 layers) bf16 1.4e-3, fp16 2.1e-4.
# The tolerances leave about 4x headroom over those measurements.
AUTOCAST_ATOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _tiny(seed=0, **kw):
    torch.manual_seed(seed)
    return TinyCausalLM(TinyLMConfig.preset("nano", vocab_size=32, block_size=16), **kw).eval()


def _llama(seed=0, **kw):
    cfg = transformers.LlamaConfig(
        vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32,
    )
    torch.manual_seed(seed)
    return HFCausalLMAdapter.from_config(cfg, **kw).eval()


def _batch(B=4, T=12, vocab=32, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, :3] = False  # left padding of different widths
    mask[2, :5] = False
    return ids, mask


# ----------------------------------------------------------------------------- autocast


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("build", [_tiny, _llama], ids=["tiny", "llama"])
def test_autocast_forward_is_close_to_float32_and_returns_float32_logits(build, dtype):
    lm = build()
    ids, mask = _batch()
    ref = torch.log_softmax(lm(ids, mask).logits, -1)
    lm.autocast_dtype = dtype  # a plain attribute, settable after construction
    out = lm(ids, mask)
    assert out.logits.dtype == torch.float32
    got = torch.log_softmax(out.logits, -1)
    assert not torch.equal(got, ref)  # autocast really ran
    torch.testing.assert_close(got[mask], ref[mask], atol=AUTOCAST_ATOL[dtype], rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_cache_is_allocated_in_the_autocast_dtype_and_matches_its_full_forward(dtype):
    lm = _tiny(autocast_dtype=dtype)
    ids, mask = _batch()
    cache = lm.new_cache(4, 16)
    assert cache.k.dtype == cache.v.dtype == dtype and cache.valid.dtype == torch.bool
    with torch.no_grad():
        full = lm(ids, mask).logits
        cached = lm(ids, mask, position_ids=position_ids_from_mask(mask), cache=cache, cache_slots=0).logits
    # the same ops in the same dtype, differently batched: a few units of the last place of the dtype
    torch.testing.assert_close(cached[mask], full[mask], atol=AUTOCAST_ATOL[dtype], rtol=0)


def test_autocast_none_is_bit_identical_to_the_plain_model():
    plain = _tiny()
    explicit = _tiny(autocast_dtype=None)
    back = copy.deepcopy(plain)
    back.autocast_dtype = torch.bfloat16
    back.autocast_dtype = None  # switched on and off again
    ids, mask = _batch()
    ref = plain(ids, mask)
    for lm in (explicit, back):
        out = lm(ids, mask)
        assert torch.equal(out.logits, ref.logits) and torch.equal(out.hidden, ref.hidden)
    assert plain.new_cache(2, 8).k.dtype == torch.float32


def test_autocast_env_policy_rebuilds_its_cache_when_the_dtype_changes():
    lm = _tiny()
    head = NextTokenLogits(lm)
    ids, mask = _batch()
    pos = torch.full((4,), 12)
    with torch.no_grad():
        fp32 = head(ids, mask, pos)
        assert head._cache.k.dtype == torch.float32
        lm.autocast_dtype = torch.bfloat16
        bf16 = head(ids, mask, pos)
        assert head._cache.k.dtype == torch.bfloat16
        full = head._full(ids, mask, pos)  # the uncached path applies the head under autocast too
    assert bf16.dtype == full.dtype == torch.float32
    torch.testing.assert_close(bf16, fp32, atol=AUTOCAST_ATOL[torch.bfloat16] * 10, rtol=0)
    torch.testing.assert_close(full, fp32, atol=AUTOCAST_ATOL[torch.bfloat16] * 10, rtol=0)


def test_autocast_refuses_an_unsupported_dtype():
    with pytest.raises(ValueError, match=r"TinyCausalLM.autocast_dtype=torch.float64 is not supported"):
        _tiny(autocast_dtype=torch.float64)
    with pytest.raises(ValueError, match=r"HFCausalLMAdapter.autocast_dtype=torch.int8 is not supported"):
        _llama(autocast_dtype=torch.int8)
    lm = _llama()
    lm.autocast_dtype = "bf16"
    with pytest.raises(ValueError, match=r"autocast_dtype='bf16' is not supported: use torch.bfloat16"):
        lm(torch.ones(1, 2, dtype=torch.long))


def test_autocast_refuses_a_cache_of_another_dtype():
    lm = _tiny()
    cache = lm.new_cache(1, 8)
    lm.autocast_dtype = torch.bfloat16
    with pytest.raises(ValueError, match=r"cache holds torch.float32 keys/values but this forward computes them in "
                                         r"torch.bfloat16"):
        lm(torch.ones(1, 2, dtype=torch.long), cache=cache, cache_slots=0)


def test_from_pretrained_loads_a_local_directory(tmp_path):
    lm = _llama()
    lm.hf_model.save_pretrained(tmp_path)
    loaded = HFCausalLMAdapter.from_pretrained(tmp_path, autocast_dtype=torch.bfloat16).eval()
    assert loaded.autocast_dtype == torch.bfloat16
    loaded.autocast_dtype = None
    ids, mask = _batch()
    torch.testing.assert_close(loaded(ids, mask).logits, lm(ids, mask).logits, atol=0, rtol=0)

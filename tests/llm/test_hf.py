"""Mixed precision (``autocast_dtype``) on both causal LMs, and the per-row KV cache of HFCausalLMAdapter."""

import copy

import pytest
import torch
from torchrl.envs.utils import ExplorationType, set_exploration_type

from ppo_objectives.llm.env import TokenLMEnv
from ppo_objectives.llm.hf import HFCausalLMAdapter
from ppo_objectives.llm.models import KVCache, TinyCausalLM, TinyLMConfig, position_ids_from_mask
from ppo_objectives.llm.policy import NextTokenLogits, make_actor
from ppo_objectives.train.digit import DigitTask

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
    mask[B - 2, :5] = False
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
    with pytest.raises(ValueError, match=r"TinyCausalLM\.autocast_dtype=torch\.float64 is not supported"):
        _tiny(autocast_dtype=torch.float64)
    with pytest.raises(ValueError, match=r"HFCausalLMAdapter\.autocast_dtype=torch\.int8 is not supported"):
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


# ----------------------------------------------------------------------------- the per-row KV cache


def _hf(kind="llama", attn="sdpa", vocab=32, seed=0, **kw):
    """Tiny Llama (grouped-query attention: 4 query heads, 2 key/value heads) or Qwen2 (4 / 4, q/k/v biases)."""
    common = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=32, attn_implementation=attn)
    if kind == "llama":
        cfg = transformers.LlamaConfig(num_key_value_heads=2, **common, **kw)
    elif kind == "qwen2":
        cfg = transformers.Qwen2Config(num_key_value_heads=4, **common, **kw)
    elif kind == "qwen3":  # q / k RMSNorm, an explicit head_dim
        cfg = transformers.Qwen3Config(num_key_value_heads=2, head_dim=8, **common, **kw)
    else:
        cfg = transformers.MistralConfig(num_key_value_heads=2, **{"sliding_window": None, **common, **kw})
    torch.manual_seed(seed)
    return HFCausalLMAdapter.from_config(cfg).eval()


MODELS = [("llama", "sdpa"), ("llama", "eager"), ("qwen2", "sdpa"), ("qwen2", "eager"), ("qwen3", "sdpa"),
          ("mistral", "sdpa")]


@pytest.mark.parametrize("kind, attn", MODELS)
def test_hf_cache_in_pieces_equals_the_full_forward_with_left_padding(kind, attn, device):
    lm = _hf(kind, attn).to(device)
    assert lm.supports_kv_cache
    ids, mask = (x.to(device) for x in _batch(B=3, T=10))
    pos = position_ids_from_mask(mask)
    cache = lm.new_cache(3, 12)
    assert cache.k.device.type == device.type
    H_kv = 4 if kind == "qwen2" else 2
    assert cache.k.shape == (2, 3, H_kv, 12, 8) and cache.v.shape == cache.k.shape
    with torch.no_grad():
        full = lm(ids, mask).logits
        pieces = [lm(ids[:, :6], mask[:, :6], position_ids=pos[:, :6], cache=cache, cache_slots=0).logits]
        for t in range(6, 10):  # one token at a time, through [B, T] slots
            slots = torch.full((3, 1), t, device=device)
            pieces.append(lm(ids[:, t:t + 1], mask[:, t:t + 1], position_ids=pos[:, t:t + 1], cache=cache,
                             cache_slots=slots).logits)
    torch.testing.assert_close(torch.cat(pieces, 1)[mask], full[mask], atol=1e-5, rtol=1e-5)
    assert torch.equal(cache.valid[:, :10], mask) and not cache.valid[:, 10:].any()


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_hf_cache_rows_at_different_slots_equal_their_own_full_forward(kind):
    # rows 0 / 1 / 2 (3 / 5 / 0 pads) write columns 4 / 6 / 7 in the same call: per-row slots and positions
    lm = _hf(kind)
    ids, mask = _batch(B=3, T=8)
    pos = position_ids_from_mask(mask)
    cache = lm.new_cache(3, 8)
    last = torch.tensor([4, 6, 7])
    with torch.no_grad():
        prefix = mask & (torch.arange(8) < last[:, None])
        lm(ids, prefix, position_ids=pos, cache=cache, cache_slots=0, compute_logits=False)
        col = last[:, None]  # [B, 1]
        step = lm(ids.gather(1, col), mask.gather(1, col), position_ids=pos.gather(1, col), cache=cache,
                  cache_slots=col).logits[:, 0]
        ref = torch.stack([lm(ids[b:b + 1, : int(last[b]) + 1], mask[b:b + 1, : int(last[b]) + 1]).logits[0, -1]
                           for b in range(3)])
    torch.testing.assert_close(step, ref, atol=1e-5, rtol=1e-5)


def _rollout_logits(head, env, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    td = env.reset()
    out = []
    for _ in range(steps):
        with torch.no_grad():
            logits = head(td["tokens"], td["attention_mask"], td["position"])
        out.append((td.clone(), logits))
        td["action"] = torch.multinomial(logits.softmax(-1), 1, generator=g).squeeze(-1)
        _, td = env.step_and_maybe_reset(td)  # done rows get a fresh prompt (partial reset)
    return out


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "mistral"])
def test_hf_next_token_logits_equal_the_full_forward_through_partial_resets(kind):
    task = DigitTask("reverse", 3, min_digits=1)  # prompts of 2 to 4 tokens, left-padded to 4
    env = TokenLMEnv.from_task(task, num_envs=5, seed=1)
    lm = _hf(kind, vocab=task.vocab_size)
    head = NextTokenLogits(lm)
    assert head.use_kv_cache
    resets = 0
    for td, logits in _rollout_logits(head, env, steps=14):
        resets += int((td["position"] == env.prompt_len).sum())
        with torch.no_grad():
            ref = lm(td["tokens"], td["attention_mask"]).logits[torch.arange(5), td["position"] - 1]
        torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-5)
    assert resets > 5  # rows finished (EOS or length) and reset at different steps


def _collect(model, use_kv_cache, *, seed=0, num_envs=4, batches=2, exploration=ExplorationType.RANDOM):
    from torchrl.collectors import Collector

    task = DigitTask("reverse", 3, min_digits=1)
    env = TokenLMEnv.from_task(task, num_envs=num_envs, seed=seed)
    N, M = num_envs, env.max_new_tokens
    torch.manual_seed(seed)
    collector = Collector(env, make_actor(model, use_kv_cache=use_kv_cache), frames_per_batch=N * M,
                          total_frames=batches * N * M, reset_at_each_iter=True, auto_register_policy_transforms=False)
    try:
        with set_exploration_type(exploration):
            return torch.cat([b.clone() for b in collector], -1)
    finally:
        collector.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_hf_collector_rollouts_with_the_cache_equal_the_uncached_ones(kind):
    lm = _hf(kind, vocab=DigitTask("copy", 1).vocab_size)
    cached, plain = _collect(lm, True), _collect(lm, False)
    assert torch.equal(cached["action"], plain["action"])  # the same draws from (nearly) the same logits
    torch.testing.assert_close(cached["sample_log_prob"], plain["sample_log_prob"], atol=1e-5, rtol=1e-5)
    done = cached["next", "done"].reshape(4, 2, -1)  # [N, batches, M]
    assert done[..., :-1].any()  # some rows finished (EOS) before the batch's last step, then reset


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_hf_greedy_decoding_gives_the_same_token_stream_with_and_without_the_cache(kind):
    lm = _hf(kind, vocab=DigitTask("copy", 1).vocab_size, seed=3)
    greedy = ExplorationType.DETERMINISTIC
    cached, plain = _collect(lm, True, exploration=greedy), _collect(lm, False, exploration=greedy)
    assert torch.equal(cached["action"], plain["action"])
    torch.testing.assert_close(cached["sample_log_prob"], plain["sample_log_prob"], atol=1e-5, rtol=1e-5)


def test_hf_cache_under_autocast_matches_the_autocast_full_forward():
    lm = _hf("llama")
    lm.autocast_dtype = torch.bfloat16
    ids, mask = _batch(B=3, T=10)
    cache = lm.new_cache(3, 10)
    assert cache.k.dtype == torch.bfloat16
    with torch.no_grad():
        full = lm(ids, mask).logits
        cached = lm(ids, mask, position_ids=position_ids_from_mask(mask), cache=cache, cache_slots=0).logits
    torch.testing.assert_close(cached[mask], full[mask], atol=AUTOCAST_ATOL[torch.bfloat16], rtol=0)


# ----------------------------------------------------------------------------- refusals


def test_hf_cache_is_refused_for_unverified_models_and_the_env_policy_falls_back():
    sliding = _hf("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1)
    assert not sliding.supports_kv_cache and not NextTokenLogits(sliding).use_kv_cache
    with pytest.raises(ValueError, match=r"no per-row KV cache for this model: layer_types=\['full_attention', "
                                         r"'sliding_attention'\] holds non-full attention layers"):
        sliding.new_cache(1, 8)
    windowed = _hf("mistral", sliding_window=4)
    assert not windowed.supports_kv_cache
    with pytest.raises(ValueError, match=r"sliding_window=4: the per-row mask attends to the whole prefix"):
        windowed.new_cache(1, 8)
    cfg = transformers.GemmaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    gemma = HFCausalLMAdapter.from_config(cfg)
    assert not gemma.supports_kv_cache
    with pytest.raises(ValueError, match=r"model_type='gemma' is not among the verified ones"):
        gemma.new_cache(1, 8)
    cache = _hf("llama").new_cache(1, 8)
    with pytest.raises(ValueError, match=r"model_type='gemma' is not among the verified ones"):
        gemma(torch.ones(1, 2, dtype=torch.long), cache=cache, cache_slots=0)
    lm = _hf("llama")
    lm.hf_model.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match=r"attention implementation 'flex_attention' does not read an explicit"):
        lm.new_cache(1, 8)


def test_hf_cache_errors_name_the_problem():
    lm = _hf("llama")
    cache = lm.new_cache(2, 8)
    ids = torch.ones(3, 2, dtype=torch.long)
    with pytest.raises(ValueError, match=r"cache holds 2 rows but input_ids has B=3"):
        lm(ids, cache=cache, cache_slots=0)
    with pytest.raises(ValueError, match=r"cache_slots is required with a cache"):
        lm(ids[:2], cache=cache)
    with pytest.raises(ValueError, match=r"cache_slots has shape \(2, 1\) but input_ids has shape \(2, 2\)"):
        lm(ids[:2], cache=cache, cache_slots=torch.zeros(2, 1, dtype=torch.long))
    with pytest.raises(ValueError, match=r"cache=dict is no per-row KV cache of HFCausalLMAdapter"):
        lm(ids[:2], cache={}, cache_slots=0)
    with pytest.raises(ValueError, match=r"max_len=33 exceeds max_position_embeddings=32"):
        lm.new_cache(1, 33)
    with pytest.raises(ValueError, match=r"batch_size=0 must be an int >= 1"):
        lm.new_cache(0, 8)
    lm.autocast_dtype = torch.float16
    with pytest.raises(ValueError, match=r"cache holds torch.float32 keys/values but this forward computes them in "
                                         r"torch.float16"):
        lm(ids[:2], cache=cache, cache_slots=0)
    assert isinstance(lm.new_cache(1, 4), KVCache) and lm.new_cache(1, 4).k.dtype == torch.float16

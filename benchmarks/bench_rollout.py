"""Rollout throughput: TokenLMEnv + TorchRL Collector vs the model's own batched KV-cache sampling loop.

Both sides generate ``N x M`` tokens per batch with the same TinyCausalLM (same
weights) on the same device, in the same run:

* **collector**: ``Collector(TokenLMEnv, make_actor(model), frames_per_batch=N*M,
  reset_at_each_iter=True)`` -- one env step per token, the policy's per-row KV
  cache, partial resets of rows that emitted EOS (they start a new prompt).
* **plain loop**: :func:`ppo_objectives.llm.policy.sample_with_kv_cache` -- one prefill,
  then ``M`` cached steps for all rows (finished rows keep stepping, masked).

Two policies: ``random`` (a fresh model: EOS anywhere, so rows finish early and the
collector resets them mid-batch -- every reset costs a prefill) and ``format`` (a
model warm-started on the answer format, the regime of the main job: every answer
has full length, rows reset only at batch boundaries).

Reported: tokens/s of each (median of ``--repeats`` timed batches after one
warm-up batch, the two sides interleaved batch by batch) and the ratio collector / plain (goal >= 0.5).

**Hugging Face section** (``--model llama`` or ``both``): a Llama-config model of
about 16M parameters built from its config (vocab 8192, hidden 384, 6 layers,
6 query heads, 2 key/value heads, intermediate 1024; the count is printed)
behind :class:`~ppo_objectives.llm.hf.HFCausalLMAdapter`, ``N`` rows of random
prompts left-padded to width ``P`` (lengths in ``[P/2, P]``), ``M`` new tokens.
Three sides on the same prompts, the first two interleaved batch by batch:

* **collector**: ``Collector(TokenLMEnv(prompts, <zero reward>, vocab_size=V + 1,
  eos_id=V, max_new_tokens=M), make_actor(adapter), frames_per_batch=N*M,
  reset_at_each_iter=True)`` -- the adapter's per-row KV cache;
* **generate**: ``hf_model.generate(prompts, attention_mask=mask, do_sample=True,
  top_k=0, max_new_tokens=M)`` with no EOS token -- Hugging Face's own cached loop;
* **uncached**: the collector with ``make_actor(adapter, use_kv_cache=False)``
  (a full forward over the buffer per token), one timed batch on the row's ``N``
  rows (it is slow; ``--uncached-rows K`` runs it on ``K`` rows and re-times the
  cached collector on those ``K`` rows for the ratio).

EOS is equal on both sides: the env's EOS is the id ``V``, one past the model's
vocabulary, which the model never samples, and ``generate`` has no EOS token, so
every row of both generates exactly ``M`` tokens (checked). Goals: collector
>= 0.7x generate, cached >= 20x uncached (tokens/s).

    python benchmarks/bench_rollout.py               # TinyCausalLM table over a few sizes
    python benchmarks/bench_rollout.py --quick       # one small size, seconds
    python benchmarks/bench_rollout.py --model llama # the Hugging Face section (a few minutes on CPU)
    python benchmarks/bench_rollout.py --device cuda
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ppo_objectives.train.digit import DigitTask
from ppo_objectives.llm.env import TokenLMEnv
from ppo_objectives.llm.models import TinyCausalLM, TinyLMConfig
from ppo_objectives.llm.policy import make_actor, sample_with_kv_cache


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(num_envs: int, preset: str, digits: int, device: torch.device, repeats: int, policy: str, seed: int = 0):
    from torchrl.collectors import Collector

    from ppo_objectives.train.digit import warm_start

    torch.manual_seed(seed)
    task = DigitTask("copy", digits)
    env = TokenLMEnv.from_task(task, num_envs=num_envs, device=device, seed=seed)
    P, M = env.prompt_len, env.max_new_tokens
    model = TinyCausalLM(TinyLMConfig.preset(preset, vocab_size=task.vocab_size, block_size=P + M)).to(device)
    if policy == "format":  # the main job's regime: answers have the full length, no early EOS
        warm_start(model, task, 100, 3e-3, torch.Generator().manual_seed(seed), device)
    model.eval()
    tokens = num_envs * M

    collector = Collector(
        env, make_actor(model), frames_per_batch=tokens, total_frames=-1, reset_at_each_iter=True,
        auto_register_policy_transforms=False,
    )  # fmt: skip
    it = iter(collector)
    gen = torch.Generator(device=device).manual_seed(seed)
    prompts = task.sample_prompts(num_envs, torch.Generator().manual_seed(seed)).to(device)
    pmask = torch.ones_like(prompts, dtype=torch.bool)
    next(it)  # warm-up, both sides
    sample_with_kv_cache(model, prompts, pmask, M, eos_id=task.EOS, generator=gen)
    coll_times, plain_times = [], []
    for _ in range(repeats):  # interleaved, so a change of machine load hits both sides alike
        _sync(device)
        t0 = time.perf_counter()
        next(it)
        _sync(device)
        t1 = time.perf_counter()
        sample_with_kv_cache(model, prompts, pmask, M, eos_id=task.EOS, generator=gen)
        _sync(device)
        coll_times.append(t1 - t0)
        plain_times.append(time.perf_counter() - t1)
    collector.shutdown()
    coll, plain = statistics.median(coll_times), statistics.median(plain_times)
    return dict(
        num_envs=num_envs, preset=preset, P=P, M=M, policy=policy,
        collector_tok_s=tokens / coll, plain_tok_s=tokens / plain, ratio=plain / coll,
    )  # fmt: skip


def _llama_adapter(device: torch.device, seed: int = 0):
    from transformers import LlamaConfig

    from ppo_objectives.llm.hf import HFCausalLMAdapter

    cfg = LlamaConfig(
        vocab_size=8192, hidden_size=384, num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=2,
        intermediate_size=1024, max_position_embeddings=512, pad_token_id=0, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(seed)
    adapter = HFCausalLMAdapter.from_config(cfg).to(device).eval()
    gen = adapter.hf_model.generation_config
    gen.eos_token_id, gen.bos_token_id, gen.pad_token_id = None, None, 0
    return adapter


def _random_prompts(n: int, width: int, vocab: int, seed: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``[n, width]`` random token ids in ``[1, vocab)``, left-padded with 0 to lengths in ``[width / 2, width]``."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (n, width), generator=g)
    lengths = torch.randint(max(1, width // 2), width + 1, (n,), generator=g)
    mask = torch.arange(width) >= (width - lengths)[:, None]
    return ids.masked_fill(~mask, 0).to(device), mask.to(device)


def _hf_collector(adapter, prompts, M: int, use_kv_cache: bool):
    from torchrl.collectors import Collector

    N, P = prompts.shape
    V = adapter.vocab_size
    env = TokenLMEnv(
        prompts, lambda pi, pm, ri, rm: torch.zeros(pi.shape[0], device=pi.device), num_envs=N, prompt_len=P,
        max_new_tokens=M, vocab_size=V + 1, eos_id=V, pad_id=0, device=prompts.device,
    )  # fmt: skip  # EOS = V: outside the model's V logits, never sampled, so every row runs M steps
    return Collector(
        env, make_actor(adapter, use_kv_cache=use_kv_cache), frames_per_batch=N * M, total_frames=-1,
        reset_at_each_iter=True, auto_register_policy_transforms=False,
    )  # fmt: skip


def _timed(fn, device) -> tuple[float, object]:
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - t0, out


def measure_hf(num_envs: int, P: int, M: int, device, repeats: int, uncached_rows: int, seed: int = 0) -> dict:
    adapter = _llama_adapter(device, seed)
    prompts, pmask = _random_prompts(num_envs, P, adapter.vocab_size, seed, device)
    generate = lambda: adapter.hf_model.generate(  # noqa: E731
        prompts, attention_mask=pmask.long(), do_sample=True, top_k=0, top_p=1.0, temperature=1.0,
        max_new_tokens=M, min_new_tokens=M, pad_token_id=0,
    )  # fmt: skip
    collector = _hf_collector(adapter, prompts, M, use_kv_cache=True)
    it = iter(collector)
    with torch.no_grad():
        batch, out = next(it), generate()  # warm-up, both sides
    assert batch.numel() == num_envs * M and not batch["next", "terminated"].any(), "the collector stopped early"
    assert out.shape == (num_envs, P + M), f"generate returned {tuple(out.shape)}, not {(num_envs, P + M)}"
    coll_times, gen_times = [], []
    for _ in range(repeats):  # interleaved, so a change of machine load hits both sides alike
        with torch.no_grad():
            coll_times.append(_timed(lambda: next(it), device)[0])
            gen_times.append(_timed(generate, device)[0])
    collector.shutdown()
    coll, gen = statistics.median(coll_times), statistics.median(gen_times)
    cached_same = num_envs * M / coll  # the cached collector on the uncached side's rows
    if uncached_rows != num_envs:
        small = _hf_collector(adapter, prompts[:uncached_rows], M, use_kv_cache=True)
        small_it = iter(small)
        with torch.no_grad():
            next(small_it)
            cached_same = uncached_rows * M / statistics.median(
                _timed(lambda: next(small_it), device)[0] for _ in range(3)
            )
        small.shutdown()
    slow = _hf_collector(adapter, prompts[:uncached_rows], M, use_kv_cache=False)
    slow_it = iter(slow)
    with torch.no_grad():
        uncached_s = _timed(lambda: next(slow_it), device)[0]  # one batch: it is slow (O(M^2) tokens)
    slow.shutdown()
    tokens = num_envs * M
    return dict(
        num_envs=num_envs, P=P, M=M, params=sum(p.numel() for p in adapter.parameters()),
        collector_tok_s=tokens / coll, generate_tok_s=tokens / gen, uncached_rows=uncached_rows,
        uncached_tok_s=uncached_rows * M / uncached_s, cached_same_rows_tok_s=cached_same,
    )  # fmt: skip


def _print_hf(rows: list[dict], device, repeats: int) -> None:
    print(f"\nHugging Face Llama ({rows[0]['params'] / 1e6:.1f}M parameters) on {device}, median of {repeats}")
    print(f"{'N':>5} {'P':>3} {'M':>3} {'collector tok/s':>16} {'generate tok/s':>15} {'coll/gen':>9} "
          f"{'uncached rows':>14} {'uncached tok/s':>15} {'cached/uncached':>16}")
    for r in rows:
        r["ratio_generate"] = r["collector_tok_s"] / r["generate_tok_s"]
        r["ratio_uncached"] = r["cached_same_rows_tok_s"] / r["uncached_tok_s"]
        print(f"{r['num_envs']:>5} {r['P']:>3} {r['M']:>3} {r['collector_tok_s']:>16,.0f} "
              f"{r['generate_tok_s']:>15,.0f} {r['ratio_generate']:>9.2f} {r['uncached_rows']:>14} {r['uncached_tok_s']:>15,.0f} "
              f"{r['ratio_uncached']:>16.1f}")
    print("coll/gen = collector tokens/s / generate tokens/s; cached/uncached = the cached collector's tokens/s / "
          "the uncached collector's, both on the uncached rows")


def _tiny_table(args, device, repeats: int) -> list[dict]:
    if args.quick:
        configs = [(16, "pico", 3)]
    elif device.type == "cuda":
        configs = [(64, "nano", 3), (256, "nano", 3), (1024, "nano", 3), (256, "micro", 8)]
    else:
        configs = [(64, "nano", 3), (256, "nano", 3), (64, "micro", 8)]
    print(f"rollout throughput on {device} (torch threads: {torch.get_num_threads()}), median of {repeats}")
    print(f"{'policy':>7} {'N':>6} {'model':>6} {'P':>3} {'M':>3} {'collector tok/s':>16} {'plain tok/s':>12} "
          f"{'ratio':>6}")
    rows = []
    policies = ("random", "format") if args.policy == "both" else (args.policy,)
    for policy in policies:
        for n, preset, digits in configs:
            r = measure(n, preset, digits, device, repeats, policy)
            rows.append(r)
            print(
                f"{policy:>7} {r['num_envs']:>6} {r['preset']:>6} {r['P']:>3} {r['M']:>3} "
                f"{r['collector_tok_s']:>16,.0f} {r['plain_tok_s']:>12,.0f} {r['ratio']:>6.2f}"
            )
    print("ratio = collector tokens/s / plain-loop tokens/s")
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where model and env run")
    p.add_argument("--quick", action="store_true", help="one small configuration, few repeats")
    p.add_argument("--repeats", type=int, default=None, help="timed batches per side (default 10, quick 3)")
    p.add_argument("--policy", default="both", choices=("random", "format", "both"),
                   help="random init (EOS anywhere: many partial resets) and/or format-trained (full-length answers)")
    p.add_argument("--model", default="tiny", choices=("tiny", "llama", "both"),
                   help="TinyCausalLM tables (collector vs plain loop) and/or the Hugging Face Llama section")
    p.add_argument("--rows", type=int, nargs="+", default=None, help="Llama section: N values (default 16 64)")
    p.add_argument("--prompt-len", type=int, default=16, help="Llama section: prompt width P")
    p.add_argument("--new-tokens", type=int, default=64, help="Llama section: M, new tokens per row")
    p.add_argument("--uncached-rows", type=int, default=None, help="Llama section: rows of the uncached batch "
                   "(default: N of the row; fewer is faster, the cached side is then re-timed on as many rows)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (0 = torch's default)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    repeats = args.repeats or (3 if args.quick else 10)
    rows, hf_rows = [], []
    if args.model in ("tiny", "both"):
        rows = _tiny_table(args, device, repeats)
    if args.model in ("llama", "both"):
        ns = args.rows or ([4] if args.quick else [16, 64])
        M = 16 if args.quick and args.new_tokens == 64 else args.new_tokens
        for n in ns:
            hf_rows.append(measure_hf(n, args.prompt_len, M, device, repeats, min(args.uncached_rows or n, n)))
        _print_hf(hf_rows, device, repeats)
    print("Goals:")
    for r in rows:
        verdict = "met" if r["ratio"] >= 0.5 else "not met"
        print(f"  {r['policy']} N={r['num_envs']} {r['preset']}: collector {r['ratio']:.2f}x the plain loop "
              f"(goal >= 0.5x): {verdict}")
    for r in hf_rows:
        v1 = "met" if r["ratio_generate"] >= 0.7 else "not met"
        v2 = "met" if r["ratio_uncached"] >= 20 else "not met"
        print(f"  llama N={r['num_envs']} M={r['M']}: collector {r['ratio_generate']:.2f}x generate (goal >= 0.7x): "
              f"{v1}; cached {r['ratio_uncached']:.1f}x uncached (goal >= 20x): {v2}")
    return rows + hf_rows


if __name__ == "__main__":
    main()

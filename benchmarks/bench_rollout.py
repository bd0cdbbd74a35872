"""Rollout throughput: TokenLMEnv + TorchRL Collector vs the model's own batched KV-cache sampling loop.

Both sides generate ``N x M`` tokens per batch with the same TinyCausalLM (same
weights) on the same device, in the same run:

* **collector**: ``Collector(TokenLMEnv, make_actor(model), frames_per_batch=N*M,
  reset_at_each_iter=True)`` -- one env step per token, the policy's per-row KV
  cache, partial resets of rows that emitted EOS (they start a new prompt).
* **plain loop**: :func:`ppo_objectives.models.sample_with_kv_cache` -- one prefill,
  then ``M`` cached steps for all rows (finished rows keep stepping, masked).

Two policies: ``random`` (a fresh model: EOS anywhere, so rows finish early and the
collector resets them mid-batch -- every reset costs a prefill) and ``format`` (a
model warm-started on the answer format, the regime of the main job: every answer
has full length, rows reset only at batch boundaries).

Reported: tokens/s of each (median of ``--repeats`` timed batches after one
warm-up batch, the two sides interleaved batch by batch) and the ratio collector / plain (goal >= 0.5).

    python benchmarks/bench_rollout.py               # table over a few sizes
    python benchmarks/bench_rollout.py --quick       # one small size, seconds
    python benchmarks/bench_rollout.py --device cuda
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ppo_objectives.envs import DigitTask, TokenLMEnv
from ppo_objectives.models import TinyCausalLM, TinyLMConfig
from ppo_objectives.policy import make_actor, sample_with_kv_cache


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(num_envs: int, preset: str, digits: int, device: torch.device, repeats: int, policy: str, seed: int = 0):
    from torchrl.collectors import Collector

    from ppo_objectives.train import warm_start

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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where model and env run")
    p.add_argument("--quick", action="store_true", help="one small configuration, few repeats")
    p.add_argument("--repeats", type=int, default=None, help="timed batches per side (default 10, quick 3)")
    p.add_argument("--policy", default="both", choices=("random", "format", "both"),
                   help="random init (EOS anywhere: many partial resets) and/or format-trained (full-length answers)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (0 = torch's default)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    repeats = args.repeats or (3 if args.quick else 10)
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
    print("Goals:")
    for r in rows:
        verdict = "met" if r["ratio"] >= 0.5 else "not met"
        print(f"  {r['policy']} N={r['num_envs']} {r['preset']}: collector {r['ratio']:.2f}x the plain loop "
              f"(goal >= 0.5x): {verdict}")
    return rows


if __name__ == "__main__":
    main()

"""Masked GAE: MiniMind's loop vs the readable loop vs the fast torch path (vs Triton on CUDA), both layouts.

Every implementation is timed in the same run on the same data; runs are interleaved
round-robin and the median of the repeats is reported, so a busy machine slows every side
alike. The script also measures the copy bandwidth of the device (one large copy, bytes read
plus bytes written) and reports each time against the memory floor: the bytes the call must
read and write, divided by that bandwidth.

Run from the repository root::

    python benchmarks/bench_gae.py                  # CPU, one thread, about a minute
    python benchmarks/bench_gae.py --device cuda    # adds the Triton kernel
    python benchmarks/bench_gae.py --quick          # fewer repeats, smoke test

Two tables:

1. **Response rows** (the course setting: MiniMind's ``trainer/train_ppo.py``): ``gamma=1.0``,
   ``lmbda=0.95``, float32, a float 0/1 mask with right padding and random lengths in
   ``[1, R]``. Rows: ``minimind-loop`` (MiniMind's arithmetic transcribed: values zeroed at
   padding, a Python loop over time, masked whitening), ``loop`` (``masked_gae(...,
   backend="loop")``), ``torch`` (``masked_gae(...)``: validation, kernel, returns,
   whitening), ``torch-kernel`` (the raw-advantage kernel alone), ``triton`` /
   ``triton-kernel`` on CUDA. Floor: read rewards, values, mask, write advantages, returns
   (5 x 4 bytes per token).
2. **Collector rows** (TorchRL's layout, several trajectories per row): unmasked,
   ``gamma=0.99``, ``lmbda=0.95``, ``done`` at random steps (one in 64, half of them
   terminations), next values. Rows: ``response-torch`` (``masked_gae`` on the same rows
   without flags, an all-True mask: the baseline), ``torch`` / ``loop`` / ``triton``
   (``masked_gae`` with ``done`` / ``terminated`` / ``next_values`` and the all-True mask),
   ``torch-no-mask`` (the same with ``mask=None``, as MaskedGAE runs a TorchRL batch that
   has no mask entry: no packing), ``torchrl-vec`` / ``torchrl-loop``
   (TorchRL 0.14's ``vec_generalized_advantage_estimate`` / ``generalized_advantage_estimate``
   on ``[B, R, 1]``, which compute the same advantages on these unmasked rows, without
   whitening). Floor: read rewards, values, next values (4 bytes), done, terminated (1 byte),
   write advantages, returns.

Before timing, every fast path is checked against its reference on the same data.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a fresh clone, no install
from ppo_objectives._kernels import gae as _gae_fast
from ppo_objectives.functional import masked_gae

COURSE = (1.0, 0.95)  # MiniMind's gamma, lmbda
COLLECTOR = (0.99, 0.95)
DONE_RATE = 1 / 64
GOALS_VS_MINIMIND = {(64, 1024): 20.0, (16, 4096): 50.0}
GOAL_COLLECTOR_RATIO = 1.5  # collector rows with done flags at most this much slower than response rows
GOAL_CUDA_SPEEDUP = 200.0  # at R >= 1024, against MiniMind's loop
GOAL_CUDA_FLOOR = 5.0  # time / memory floor


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(fns: dict, device, min_time: float, repeats: int) -> dict:
    """Median seconds per call of each function; calls interleaved round-robin per repeat."""
    numbers = {}
    for name, fn in fns.items():  # warm up (Triton / allocator), then calibrate the call count
        fn()
        fn()
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        once = max(time.perf_counter() - t0, 1e-7)
        numbers[name] = max(1, int(min_time / repeats / once))
    samples = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            n = numbers[name]
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            _sync(device)
            samples[name].append((time.perf_counter() - t0) / n)
    return {name: statistics.median(s) for name, s in samples.items()}


def copy_bandwidth(device) -> float:
    """Bytes per second of one large copy on ``device`` (bytes read plus bytes written)."""
    nbytes = (1 << 30) if device.type == "cuda" else (1 << 28)
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    t = measure({"copy": lambda: dst.copy_(src)}, device, min_time=0.5, repeats=5)["copy"]
    return 2 * nbytes / t


def minimind_gae(token_rewards, values, mask, gamma, lmbda):
    """MiniMind's PPO-stage GAE, transcribed: values zeroed at padding, a loop over time, masked whitening."""
    old_values = values * mask
    length = values.size(1)
    lastgaelam = torch.zeros(values.size(0), dtype=values.dtype, device=values.device)
    reversed_advantages = []
    for t in reversed(range(length)):
        next_values = old_values[:, t + 1] if t < length - 1 else 0.0
        delta = token_rewards[:, t] + gamma * next_values - old_values[:, t]
        lastgaelam = delta + gamma * lmbda * lastgaelam
        reversed_advantages.append(lastgaelam)
    advantages = torch.stack(reversed_advantages[::-1], dim=1)
    returns = advantages + old_values
    mean = (advantages * mask).sum() / mask.sum()
    var = ((advantages - mean) ** 2 * mask).sum() / mask.sum()
    return (advantages - mean) * torch.rsqrt(var + 1e-8) * mask, returns


def response_rows(b, r, device):
    gen = torch.Generator().manual_seed(0)
    rewards = torch.randn(b, r, generator=gen).to(device)
    values = torch.randn(b, r, generator=gen).to(device)
    lengths = torch.randint(1, r + 1, (b,), generator=gen)
    mask = (torch.arange(r)[None, :] < lengths[:, None]).float().to(device)
    return rewards * mask, values, mask  # MiniMind's token rewards are 0 at padding


def collector_rows(b, r, device):
    gen = torch.Generator().manual_seed(1)
    rewards = torch.randn(b, r, generator=gen).to(device)
    values = torch.randn(b, r, generator=gen).to(device)
    next_values = torch.cat([values[:, 1:], torch.randn(b, 1, generator=gen).to(device)], dim=1)
    done = (torch.rand(b, r, generator=gen) < DONE_RATE).to(device)
    terminated = done & (torch.rand(b, r, generator=gen) < 0.5).to(device)
    return rewards, values, next_values, done, terminated


def course_implementations(b, r, device):
    rewards, values, mask = response_rows(b, r, device)
    bool_mask = mask > 0.5
    g, lmbda = COURSE
    fns = {
        "minimind-loop": lambda: minimind_gae(rewards, values, mask, g, lmbda),
        "loop": lambda: masked_gae(rewards, values, mask, g, lmbda, backend="loop"),
        "torch": lambda: masked_gae(rewards, values, mask, g, lmbda, backend="torch"),
        "torch-kernel": lambda: _gae_fast.gae_advantages_torch(rewards, values, bool_mask, g, lmbda, None),
    }
    if device.type == "cuda" and _gae_fast.triton_available():
        fns["triton"] = lambda: masked_gae(rewards, values, mask, g, lmbda, backend="triton")
        fns["triton-kernel"] = lambda: _gae_fast.gae_advantages_triton(rewards, values, bool_mask, g, lmbda, None)
    ref, _ = minimind_gae(rewards, values, mask, g, lmbda)
    scale = float(ref.abs().max())
    for name in ("loop", "torch", "triton"):
        if name in fns:
            err = float((fns[name]()[0] - ref).abs().max()) / scale
            assert err < 1e-4, f"{name} differs from MiniMind's loop by {err:.2e} (relative to max |A|)"
    return fns, b * r * 5 * 4


def collector_implementations(b, r, device, include_torchrl):
    rewards, values, next_values, done, terminated = collector_rows(b, r, device)
    ones = torch.ones(b, r, dtype=torch.bool, device=device)
    g, lmbda = COLLECTOR
    flags = dict(done=done, terminated=terminated, next_values=next_values)
    fns = {
        "response-torch": lambda: masked_gae(rewards, values, ones, g, lmbda, backend="torch"),
        "torch": lambda: masked_gae(rewards, values, ones, g, lmbda, backend="torch", **flags),
        "torch-no-mask": lambda: masked_gae(rewards, values, None, g, lmbda, backend="torch", **flags),
        "loop": lambda: masked_gae(rewards, values, ones, g, lmbda, backend="loop", **flags),
    }
    if device.type == "cuda" and _gae_fast.triton_available():
        fns["response-triton"] = lambda: masked_gae(rewards, values, ones, g, lmbda, backend="triton")
        fns["triton"] = lambda: masked_gae(rewards, values, ones, g, lmbda, backend="triton", **flags)
    ref, _ = masked_gae(rewards, values, ones, g, lmbda, backend="loop", average_gae=False, **flags)
    scale = float(ref.abs().max())
    for name in ("torch", "triton"):
        if name in fns:
            adv, _ = masked_gae(rewards, values, ones, g, lmbda, backend=name, average_gae=False, **flags)
            err = float((adv - ref).abs().max()) / scale
            assert err < 1e-5, f"collector {name} differs from the loop by {err:.2e} (relative to max |A|)"
    if include_torchrl:
        from torchrl.objectives.value.functional import (
            generalized_advantage_estimate,
            vec_generalized_advantage_estimate,
        )

        sv, nsv, rw = values.unsqueeze(-1), next_values.unsqueeze(-1), rewards.unsqueeze(-1)
        d, t = done.unsqueeze(-1), terminated.unsqueeze(-1)
        fns["torchrl-vec"] = lambda: vec_generalized_advantage_estimate(g, lmbda, sv, nsv, rw, d, t)
        fns["torchrl-loop"] = lambda: generalized_advantage_estimate(g, lmbda, sv, nsv, rw, d, t)
        err = float((fns["torchrl-vec"]()[0].squeeze(-1) - ref).abs().max()) / scale
        assert err < 1e-4, f"torchrl-vec differs from the collector loop by {err:.2e}"
    return fns, b * r * (4 + 4 + 4 + 1 + 1 + 4 + 4)


def print_table(title, b, r, times, baseline, floor, bandwidth):
    print(f"{title}, B={b} R={r}")
    header = f"  {'method':<15} {'time':>11}  {'vs ' + baseline:>18}  {'floor':>9}  {'x floor':>8}"
    print(header)
    print("  " + "-" * (len(header) - 2))
    for name, t in times.items():
        line = f"  {name:<15} {_fmt(t):>11}  {times[baseline] / t:>17.1f}x"
        if bandwidth:
            line += f"  {_fmt(floor):>9}  {t / floor:>8.1f}"
        print(line)
    print()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    parser.add_argument("--quick", action="store_true", help="fewer repeats, shorter timing windows")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads for CPU runs (default 1)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    repeats, min_time = (3, 0.3) if args.quick else (7, 1.5)
    shapes = [(64, 1024), (16, 4096)]
    if device.type == "cuda":
        shapes += [(1024, 4096)] if args.quick else [(1024, 4096), (4096, 4096)]

    print(f"# bench_gae  {datetime.datetime.now():%Y-%m-%d %H:%M}  torch {torch.__version__}  device {device}")
    if device.type == "cuda":
        print(f"# {torch.cuda.get_device_name(device)}; triton available: {_gae_fast.triton_available()}")
    else:
        print(f"# {platform.processor() or platform.machine()}, torch threads {torch.get_num_threads()}")
    bandwidth = copy_bandwidth(device)
    print(f"# copy bandwidth (read + write): {bandwidth / 1e9:.1f} GB/s; median of {repeats} interleaved repeats")
    print()
    verdicts = []
    for b, r in shapes:
        big = b * r >= 2**22  # the Python loops and TorchRL are left out of the large CUDA cases
        fns, nbytes = course_implementations(b, r, device)
        if big:
            fns = {k: v for k, v in fns.items() if k not in ("loop",)}
        times = measure(fns, device, min_time, repeats)
        floor = nbytes / bandwidth
        print_table(f"Response rows (gamma={COURSE[0]}, lmbda={COURSE[1]}, float 0/1 mask)", b, r, times,
                    "minimind-loop", floor, bandwidth)  # fmt: skip
        best = min((n for n in times if n in ("torch", "triton")), key=times.get)
        speedup = times["minimind-loop"] / times[best]
        if device.type == "cpu" and (b, r) in GOALS_VS_MINIMIND:
            goal = GOALS_VS_MINIMIND[(b, r)]
            verdicts.append(f"CPU B={b} R={r}: torch {speedup:.1f}x MiniMind's loop (goal >= {goal:.0f}x): "
                            f"{'met' if speedup >= goal else 'NOT met'}; {times['torch'] / floor:.1f}x the memory floor")
        if device.type == "cuda" and r >= 1024:
            verdicts.append(f"CUDA B={b} R={r}: {best} {speedup:.0f}x MiniMind's loop (goal >= {GOAL_CUDA_SPEEDUP:.0f}x): "
                            f"{'met' if speedup >= GOAL_CUDA_SPEEDUP else 'NOT met'}")
            ratio = times[best] / floor
            verdicts.append(f"CUDA B={b} R={r}: {best} at {ratio:.1f}x the memory floor (goal <= {GOAL_CUDA_FLOOR:.0f}x): "
                            f"{'met' if ratio <= GOAL_CUDA_FLOOR else 'NOT met'}")

        fns, nbytes = collector_implementations(b, r, device, include_torchrl=not big)
        if big:
            fns = {k: v for k, v in fns.items() if k != "loop"}
        times = measure(fns, device, min_time, repeats)
        floor = nbytes / bandwidth
        print_table(f"Collector rows (gamma={COLLECTOR[0]}, lmbda={COLLECTOR[1]}, done 1 in {1 / DONE_RATE:.0f})", b, r,
                    times, "response-torch", floor, bandwidth)  # fmt: skip
        for name, base in (("torch", "response-torch"), ("torch-no-mask", "response-torch"),
                           ("triton", "response-triton")):  # fmt: skip
            if name in times:
                ratio = times[name] / times[base]
                verdicts.append(f"{device.type.upper()} B={b} R={r}: collector rows {name} {ratio:.2f}x the time of "
                                f"response rows (goal <= {GOAL_COLLECTOR_RATIO}x): "
                                f"{'met' if ratio <= GOAL_COLLECTOR_RATIO else 'NOT met'}")
        if "torchrl-vec" in times:
            verdicts.append(f"{device.type.upper()} B={b} R={r}: collector torch {times['torchrl-vec'] / times['torch']:.1f}x "
                            f"faster than torchrl-vec (which whitens nothing)")
    print("Goals:")
    for v in verdicts:
        print(f"  {v}")


def _fmt(seconds: float) -> str:
    if seconds >= 1e-1:
        return f"{seconds:.3f} s"
    if seconds >= 1e-4:
        return f"{seconds * 1e3:.3f} ms"
    return f"{seconds * 1e6:.1f} us"


if __name__ == "__main__":
    main()

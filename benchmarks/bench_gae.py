"""Masked GAE: readable loop vs fast torch path (vs Triton on CUDA) vs TorchRL, side by side.

Every implementation is timed in the same run on the same data (unmasked rows, so TorchRL's
``generalized_advantage_estimate`` / ``vec_generalized_advantage_estimate`` compute the same
advantages); runs are interleaved round-robin and the median of the repeats is reported, so a
busy machine slows every side alike. On CUDA the script also measures the device's copy
bandwidth with a large device-to-device copy and reports each time against the memory
floor ``bytes(read rewards, values, mask; write advantages, returns) / bandwidth``.

Run from the repository root::

    python benchmarks/bench_gae.py                  # CPU, about a minute
    python benchmarks/bench_gae.py --device cuda    # adds the Triton kernel and the floor
    python benchmarks/bench_gae.py --quick          # fewer repeats, smoke test

Rows of the table:

- ``loop``: ``masked_gae(..., backend="loop")``, the Python loop over time (the reference);
- ``torch``: ``masked_gae(..., backend="torch")``, blocked matrix-product path;
- ``triton``: ``masked_gae(..., backend="triton")`` (CUDA with Triton only);
- ``*-kernel``: the raw-advantage kernel alone (no validation, returns or whitening);
- ``torchrl-loop`` / ``torchrl-vec``: TorchRL 0.14's functional GAE on ``[B, R, 1]`` inputs.

``masked_gae`` rows include input validation, returns and batch whitening (``normalize=True``,
the default); TorchRL's functions whiten nothing.
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
from ppo_objectives import _gae_fast
from ppo_objectives.functional import masked_gae

GAMMA, LAM = 0.99, 0.95
GOALS_CPU = {(64, 1024): 20.0, (16, 4096): 50.0}
GOAL_CUDA_SPEEDUP = 200.0  # at R >= 1024
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


def copy_bandwidth(device, nbytes: int = 1 << 30) -> float:
    """Bytes per second of a device-to-device copy, counting bytes read plus bytes written."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    t = measure({"copy": lambda: dst.copy_(src)}, device, min_time=0.5, repeats=5)["copy"]
    return 2 * nbytes / t


def make_data(b, r, device):
    gen = torch.Generator().manual_seed(0)
    rewards = torch.randn(b, r, generator=gen).to(device)
    values = torch.randn(b, r, generator=gen).to(device)
    mask = torch.ones(b, r, dtype=torch.bool, device=device)
    return rewards, values, mask


def implementations(b, r, device, include_loop=True, include_torchrl=True):
    from torchrl.objectives.value.functional import (
        generalized_advantage_estimate,
        vec_generalized_advantage_estimate,
    )

    rewards, values, mask = make_data(b, r, device)
    fns = {}
    if include_loop:
        fns["loop"] = lambda: masked_gae(rewards, values, mask, GAMMA, LAM, backend="loop")
    fns["torch"] = lambda: masked_gae(rewards, values, mask, GAMMA, LAM, backend="torch")
    fns["torch-kernel"] = lambda: _gae_fast.gae_advantages_torch(rewards, values, mask, GAMMA, LAM, None)
    if device.type == "cuda" and _gae_fast.triton_available():
        fns["triton"] = lambda: masked_gae(rewards, values, mask, GAMMA, LAM, backend="triton")
        fns["triton-kernel"] = lambda: _gae_fast.gae_advantages_triton(rewards, values, mask, GAMMA, LAM, None)
    if include_torchrl:
        # TorchRL layout [B, R, 1]; next value 0 after the last step, which is done/terminated
        sv = values.unsqueeze(-1)
        nsv = torch.cat([values[:, 1:], torch.zeros_like(values[:, :1])], dim=1).unsqueeze(-1)
        rw = rewards.unsqueeze(-1)
        done = torch.zeros_like(sv, dtype=torch.bool)
        done[:, -1] = True
        fns["torchrl-vec"] = lambda: vec_generalized_advantage_estimate(GAMMA, LAM, sv, nsv, rw, done, done)
        if include_loop:
            fns["torchrl-loop"] = lambda: generalized_advantage_estimate(GAMMA, LAM, sv, nsv, rw, done, done)
    return fns, (rewards, values, mask)


def check_agreement(fns, data):
    """Every fast path gives the loop's raw advantages (guards the timing against wrong code)."""
    rewards, values, mask = data
    ref, _ = masked_gae(rewards, values, mask, GAMMA, LAM, backend="loop", normalize=False)
    scale = float(ref.abs().max())
    for name in ("torch", "triton"):
        if name in fns:
            adv, _ = masked_gae(rewards, values, mask, GAMMA, LAM, backend=name, normalize=False)
            err = float((adv - ref).abs().max()) / scale
            assert err < 1e-5, f"{name} differs from the loop by {err:.2e} (relative to max |A|)"
    if "torchrl-vec" in fns:
        adv_rl, _ = fns["torchrl-vec"]()
        err = float((adv_rl.squeeze(-1) - ref).abs().max()) / scale
        assert err < 1e-4, f"torchrl-vec differs from the loop by {err:.2e}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    parser.add_argument("--quick", action="store_true", help="fewer repeats, shorter timing windows")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads for CPU runs")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    repeats, min_time = (3, 0.3) if args.quick else (7, 1.5)
    shapes = [(64, 1024), (16, 4096)]
    if device.type == "cuda":
        shapes += [(1024, 4096), (4096, 4096)] if not args.quick else [(1024, 4096)]

    print(f"# bench_gae  {datetime.datetime.now():%Y-%m-%d %H:%M}  torch {torch.__version__}  device {device}")
    if device.type == "cuda":
        print(f"# {torch.cuda.get_device_name(device)}; triton available: {_gae_fast.triton_available()}")
    else:
        print(f"# {platform.processor() or platform.machine()}, torch threads {torch.get_num_threads()}")
    bandwidth = copy_bandwidth(device) if device.type == "cuda" else None
    if bandwidth:
        print(f"# device copy bandwidth (read + write): {bandwidth / 1e12:.2f} TB/s")
    print(f"# gamma={GAMMA} lam={LAM}; median of {repeats} interleaved repeats")
    print()
    header = f"{'B':>5} {'R':>5}  {'method':<14} {'time':>11}  {'vs loop':>9}  {'vs torchrl-vec':>14}"
    if bandwidth:
        header += f"  {'floor':>9}  {'x floor':>7}"
    print(header)
    print("-" * len(header))
    verdicts = []
    for b, r in shapes:
        big = b * r >= 2**22  # TorchRL left out of the large CUDA cases
        fns, data = implementations(b, r, device, include_loop=True, include_torchrl=not big)
        check_agreement(fns, data)
        times = measure(fns, device, min_time, repeats)
        floor = None
        if bandwidth:
            floor = b * r * (4 + 4 + 1 + 4 + 4) / bandwidth  # read r, v, mask; write adv, returns
        for name, t in times.items():
            vs_loop = times["loop"] / t if "loop" in times else float("nan")
            vs_rl = times["torchrl-vec"] / t if "torchrl-vec" in times else float("nan")
            line = f"{b:>5} {r:>5}  {name:<14} {_fmt(t):>11}  {vs_loop:>8.1f}x  {vs_rl:>13.2f}x"
            if floor:
                line += f"  {_fmt(floor):>9}  {t / floor:>7.1f}"
            print(line)
        print()
        best = min((n for n in times if n in ("torch", "triton")), key=times.get)
        speedup = times["loop"] / times[best]
        if device.type == "cpu" and (b, r) in GOALS_CPU:
            goal = GOALS_CPU[(b, r)]
            verdicts.append(f"CPU B={b} R={r}: torch {speedup:.1f}x the loop (goal >= {goal:.0f}x): "
                            f"{'met' if speedup >= goal else 'NOT met'}")
        if device.type == "cuda" and r >= 1024:
            verdicts.append(f"CUDA B={b} R={r}: {best} {speedup:.0f}x the loop (goal >= {GOAL_CUDA_SPEEDUP:.0f}x): "
                            f"{'met' if speedup >= GOAL_CUDA_SPEEDUP else 'NOT met'}")
            for name in ("triton", "triton-kernel", "torch"):
                if name in times:
                    ratio = times[name] / floor
                    verdicts.append(f"CUDA B={b} R={r}: {name} at {ratio:.1f}x the memory floor "
                                    f"(goal <= {GOAL_CUDA_FLOOR:.0f}x): {'met' if ratio <= GOAL_CUDA_FLOOR else 'NOT met'}")
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

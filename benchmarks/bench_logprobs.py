"""Response log-probs (+ entropy): chunked ``response_log_probs`` vs naive ``log_softmax().gather()``.

Both sides run forward + backward on the same logits in the same run, for ``B=8, T=1024`` and
``V`` in {6400, 32000} (CPU, float32 logits) or {6400, 32000, 151936} (CUDA, bfloat16 logits).
Every position but the last is scored (prompt length 1, ``R = T - 1``), the worst case for the
chunked path since the naive one always covers all ``T`` rows.

Memory is the peak of the extra bytes allocated while a step runs, beyond the logits (allocated
before) and beyond their gradient (an output of the backward, as large as the logits in both
versions), reported as a fraction of the logits' size:

- CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``;
- CPU: the torch profiler's memory events (``profile_memory=True``): the running sum of every
  allocation and free, in time order.

Run from the repository root::

    python benchmarks/bench_logprobs.py                # CPU, four to six minutes (both sections)
    python benchmarks/bench_logprobs.py --device cuda  # adds V = 151936, bf16 logits
    python benchmarks/bench_logprobs.py --quick        # V = 6400 only, the small hidden-state case, fewer repeats

The naive version (what most PPO code does)::

    logq = torch.log_softmax(logits.float(), -1)                        # [B, T, V] float32
    logp = logq[:, :-1].gather(-1, input_ids[:, 1:, None]).squeeze(-1)  # then the response slice
    entropy = -(logq.exp() * logq).sum(-1)[:, :-1]

Second section, **whole read-out from hidden states**: every side starts from the last hidden
states ``hidden [B, T, C]`` and an LM head ``W [V, C]`` with the Qwen2 vocabulary ``V = 151936`` and
the Qwen2-0.5B width ``C = 896``, and runs forward + backward with gradients to ``hidden`` and
``W``:

- ``naive``: ``logits = hidden @ W.T``, then the naive log-softmax above;
- ``chunked``: ``logits = hidden @ W.T``, then ``response_log_probs`` (the first section's path);
- ``hidden``: ``response_log_probs_from_hidden(hidden, W, ...)``: the head inside the chunk loop,
  the ``[B, T, V]`` logits never formed.

Memory is the peak of the extra bytes beyond the inputs and beyond the gradients of ``hidden``
and ``W`` (outputs every side has), reported in MB and as a ratio to each materialised path's
peak extra. Sizes: CPU float32, ``B=2, T=1024``; CUDA bfloat16, ``B=8, T=2048``. ``--quick``
(CPU ``B=1, T=256``, CUDA ``T=512``) is a smoke test: at that size the chunks' 64 MiB floor and
the head's gradient dominate, and the memory goal is not expected to hold. Goals: the hidden
path's peak extra <= 0.1x either materialised path's, its time <= 1.5x.

    python benchmarks/bench_logprobs.py --section hidden   # only the second section
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
from ppo_objectives.functional import response_log_probs, response_log_probs_from_hidden

GOAL_MEMORY = 0.25  # peak extra / logits bytes
GOAL_TIME = 1.5  # chunked time / naive time
GOAL_HIDDEN_MEMORY = 0.1  # hidden path's peak extra / a materialised path's peak extra
GOAL_HIDDEN_TIME = 1.5  # hidden path's time / a materialised path's time
QWEN2_VOCAB, QWEN2_05B_WIDTH = 151936, 896


def naive(logits, ids, entropy):
    logq = torch.log_softmax(logits.float(), dim=-1)
    logp = logq[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    if not entropy:
        return logp, None
    return logp, -(logq.exp() * logq).sum(-1)[:, :-1]


def chunked(logits, ids, entropy):
    prompt = torch.ones(logits.shape[0], dtype=torch.long, device=logits.device)
    out = response_log_probs(logits, ids, prompt, logits.shape[1] - 1, return_entropy=entropy)
    return out if entropy else (out, None)


def step(impl, logits, ids, entropy):
    logits.grad = None
    logp, ent = impl(logits, ids, entropy)
    loss = logp.sum() if ent is None else logp.sum() + 0.01 * ent.sum()
    loss.backward()
    return logp.detach(), None if ent is None else ent.detach()


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_extra_bytes(fn, device) -> int:
    """Peak bytes allocated while ``fn`` runs, above what was allocated before it started."""
    if device.type == "cuda":
        _sync(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        _sync(device)
        return torch.cuda.max_memory_allocated(device) - base
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    sizes = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            sizes.append((node.start_time_ns, node.extra_fields.alloc_size))
        stack.extend(node.children)
    running = peak = 0
    for _, size in sorted(sizes):
        running += size
        peak = max(peak, running)
    return peak


def median_time(fns: dict, device, repeats: int, warmup: bool) -> dict:
    """Median seconds of one call of each function, calls interleaved round-robin."""
    samples = {name: [] for name in fns}
    for fn in fns.values():
        if warmup:
            fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            samples[name].append(time.perf_counter() - t0)
    return {name: statistics.median(s) for name, s in samples.items()}


def logits_section(args, device) -> list[str]:
    """The first section: ``response_log_probs`` vs the naive log-softmax on given logits."""
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    vocabs = [6400, 32000, 151936] if cuda else [6400, 32000]
    if args.quick:
        vocabs = vocabs[:1]
    repeats = (3 if args.quick else 10) if cuda else (1 if args.quick else 2)
    b, t = 8, 1024

    print("## response_log_probs on given logits vs the naive log_softmax().gather()")
    where = torch.cuda.get_device_name(device) if cuda else f"{platform.machine()}, torch threads {torch.get_num_threads()}"
    print(f"# {where}; B={b} T={t} R={t - 1}, {str(dtype).replace('torch.', '')} logits, forward + backward")
    print(f"# memory: peak extra beyond logits and their gradient, / logits bytes; time: median of {repeats}")
    print()
    header = (f"{'V':>7} {'entropy':>7}  {'logits':>8}  {'naive mem':>9} {'chunked mem':>11}  "
              f"{'naive time':>10} {'chunked time':>12} {'time ratio':>10}")
    print(header)
    print("-" * len(header))
    verdicts = []
    for v in vocabs:
        gen = torch.Generator(device="cpu").manual_seed(v)
        logits = torch.randn(b, t, v, generator=gen).to(device=device, dtype=dtype).requires_grad_()
        ids = torch.randint(0, v, (b, t), generator=gen).to(device)
        size = logits.numel() * logits.element_size()
        for entropy in (False, True):
            ref = step(naive, logits, ids, entropy)
            got = step(chunked, logits, ids, entropy)
            for a, c in zip(ref, got):
                if a is not None:
                    err = float((a - c).abs().max())
                    assert err < 1e-3, f"chunked and naive differ by {err}"
            mem = {}
            for name, impl in (("naive", naive), ("chunked", chunked)):
                logits.grad = None
                mem[name] = (peak_extra_bytes(lambda impl=impl: step(impl, logits, ids, entropy), device) - size) / size
            logits.grad = None
            times = median_time(
                {
                    "naive": lambda: step(naive, logits, ids, entropy),
                    "chunked": lambda: step(chunked, logits, ids, entropy),
                },
                device,
                repeats,
                warmup=cuda,  # on CPU the agreement check and the memory run already warmed up
            )
            ratio = times["chunked"] / times["naive"]
            print(f"{v:>7} {str(entropy):>7}  {size / 2**20:>6.0f}MB  {mem['naive']:>8.2f}x {mem['chunked']:>10.3f}x  "
                  f"{times['naive'] * 1e3:>8.1f}ms {times['chunked'] * 1e3:>10.1f}ms {ratio:>9.2f}x")
            verdicts.append(
                f"V={v} entropy={entropy}: memory {mem['chunked']:.3f}x (goal <= {GOAL_MEMORY}x: "
                f"{'met' if mem['chunked'] <= GOAL_MEMORY else 'NOT met'}), time {ratio:.2f}x naive "
                f"(goal <= {GOAL_TIME}x: {'met' if ratio <= GOAL_TIME else 'NOT met'})"
            )
        del logits, ids
        if cuda:
            torch.cuda.empty_cache()
    print()
    return verdicts


# --------------------------------------------------------------------------- #
# Whole read-out from hidden states
# --------------------------------------------------------------------------- #


def materialised_naive(hidden, weight, ids):
    return naive(hidden @ weight.T, ids, True)


def materialised_chunked(hidden, weight, ids):
    return chunked(hidden @ weight.T, ids, True)


def from_hidden(hidden, weight, ids):
    prompt = torch.ones(hidden.shape[0], dtype=torch.long, device=hidden.device)
    return response_log_probs_from_hidden(hidden, weight, ids, prompt, hidden.shape[1] - 1, return_entropy=True)


def head_step(impl, hidden, weight, ids):
    """Forward + backward of ``logp.sum() + 0.01 * entropy.sum()``, gradients to hidden and weight."""
    hidden.grad = weight.grad = None
    logp, ent = impl(hidden, weight, ids)
    (logp.sum() + 0.01 * ent.sum()).backward()
    return logp.detach(), ent.detach()


def hidden_section(args, device) -> list[str]:
    """The second section: the whole read-out (head matmul included) from hidden states."""
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    b, t = (8, 512 if args.quick else 2048) if cuda else ((1, 256) if args.quick else (2, 1024))
    v, c = QWEN2_VOCAB, QWEN2_05B_WIDTH
    repeats = (3 if args.quick else 5) if cuda else 1
    gen = torch.Generator(device="cpu").manual_seed(0)
    hidden = torch.randn(b, t, c, generator=gen).to(device=device, dtype=dtype).requires_grad_()
    weight = (torch.randn(v, c, generator=gen) / c**0.5).to(device=device, dtype=dtype).requires_grad_()
    ids = torch.randint(0, v, (b, t), generator=gen).to(device)
    grad_bytes = (hidden.numel() + weight.numel()) * hidden.element_size()
    logits_mb = b * t * v * hidden.element_size() / 2**20
    print(f"## whole read-out from hidden states: hidden [B={b}, T={t}, C={c}], head [V={v}, C={c}], "
          f"{str(dtype).replace('torch.', '')}, R={t - 1}, entropy, forward + backward to hidden and W")
    print(f"# the materialised [B, T, V] logits would take {logits_mb:.0f}MB; memory: peak extra beyond the "
          f"inputs and the gradients of hidden and W; time: median of {repeats}")
    print()
    impls = {"naive": materialised_naive, "chunked": materialised_chunked, "hidden": from_hidden}
    mem, outs = {}, {}
    for name, impl in impls.items():
        box = []
        hidden.grad = weight.grad = None  # the gradients are allocated inside the measured step
        peak = peak_extra_bytes(lambda impl=impl: box.append(head_step(impl, hidden, weight, ids)), device)
        mem[name], outs[name] = peak - grad_bytes, box[0]
    tol = 0.05 if dtype == torch.bfloat16 else 1e-3
    for name in ("naive", "hidden"):
        err = max(float((x - y).abs().max()) for x, y in zip(outs[name], outs["chunked"]))
        assert err < tol, f"{name} and chunked differ by {err}"
    times = median_time(
        {name: (lambda impl=impl: head_step(impl, hidden, weight, ids)) for name, impl in impls.items()},
        device, repeats, warmup=cuda,
    )  # fmt: skip
    header = f"{'path':>8}  {'peak extra':>10}  {'time':>9}"
    print(header)
    print("-" * len(header))
    for name in impls:
        print(f"{name:>8}  {mem[name] / 2**20:>8.0f}MB  {times[name] * 1e3:>7.0f}ms")
    print()
    if args.quick:
        print("(--quick: too few rows for the memory goal; the hidden path's 64 MiB chunk floor dominates)")
    verdicts = []
    for ref in ("chunked", "naive"):
        m, r = mem["hidden"] / mem[ref], times["hidden"] / times[ref]
        print(f"hidden / {ref}: peak extra {m:.3f}x, time {r:.2f}x")
        verdicts.append(
            f"hidden vs materialised {ref}: peak extra {m:.3f}x (goal <= {GOAL_HIDDEN_MEMORY}x: "
            f"{'met' if m <= GOAL_HIDDEN_MEMORY else 'NOT met'}), time {r:.2f}x (goal <= {GOAL_HIDDEN_TIME}x: "
            f"{'met' if r <= GOAL_HIDDEN_TIME else 'NOT met'})"
        )
    print()
    return verdicts


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    parser.add_argument("--quick", action="store_true", help="smallest cases only, fewer repeats (under a minute)")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads for CPU runs (default: 1)")
    parser.add_argument("--section", choices=("all", "logits", "hidden"), default="all",
                        help="logits: response_log_probs on given logits; hidden: the whole read-out from hidden "
                             "states; all: both (default)")  # fmt: skip
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    print(f"# bench_logprobs  {datetime.datetime.now():%Y-%m-%d %H:%M}  torch {torch.__version__}  device {device}")
    print()
    verdicts = []
    if args.section in ("all", "logits"):
        verdicts += logits_section(args, device)
    if args.section in ("all", "hidden"):
        verdicts += hidden_section(args, device)
    print("Goals:")
    for line in verdicts:
        print(f"  {line}")


if __name__ == "__main__":
    main()

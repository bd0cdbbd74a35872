"""Trace one PPO KL spike step by step: why one AdamW step moves a token's log-probability by nats.

Runs the main job's loop (``ppo_objectives.train``) with MiniMind's early stop
(``--no-rollback``: the step that crosses ``--early-stop-kl`` is kept) and the old
actor learning rate 1e-3, and watches every optimizer step: after each step it
measures, on the *whole* rollout batch, the k2 approx-KL of the new policy to the
rollout policy (mean and largest token), the size of the parameter update and the
pre-clip gradient norm. At the first step that multiplies the batch's approx-KL by
``--jump`` (default 20x, and to at least 0.05 nats) it stops and dissects that step:

1. the per-step table of the iteration, which shows ordinary steps (same update
   norm, same gradient norm) before the one that jumps;
2. a line scan ``theta_before + t * (theta_after - theta_before)``, t in [0, 2]:
   the exact KL (full next-token distributions) per response position. A smooth
   loss surface would give a KL growing like t^2; a cliff gives a flat KL and then
   a jump inside one step;
3. the same step applied to one group of parameters at a time, to locate the cliff;
4. what the trust region of ``ppo_update`` does with that step (the fraction of it
   kept by backtracking, and the KL of the kept policy).

    python benchmarks/trace_kl_spike.py                   # seed 14, up to 100 iterations
    python benchmarks/trace_kl_spike.py --seed 0 --max-iterations 200

Where the spike happens depends on the seed and on the CPU's floating-point path
(it is chaotic); on a 2-core AMD EPYC, seed 14 spikes at iteration 9. If no step
jumps within ``--max-iterations`` the script says so and exits 1.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from ppo_objectives import train as T
from ppo_objectives.train import loop, update


class _Found(Exception):
    pass


def _param_groups(names):
    """``wte``, ``wpe``, ``blocks.0.ln_1``, ``blocks.0.attn``, ..., ``ln_f``: one entry per module."""
    groups = []
    for n in names:
        parts = n.split(".")
        g = ".".join(parts[:3]) + "." if parts[0] == "blocks" else parts[0] + "."
        if g not in groups:
            groups.append(g)
    return groups


def _policy_logp(model, llm, P):
    """Full next-token log-distributions at the response positions [B, R, V] (float64)."""
    out = model(llm["input_ids"], llm["attention_mask"]).logits  # [B, P + R, V]
    return out[:, P - 1 : -1].double().log_softmax(-1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=14)
    p.add_argument("--max-iterations", type=int, default=100)
    p.add_argument("--lr", type=float, default=1e-3, help="actor learning rate (1e-3: the recipe that spiked)")
    p.add_argument("--jump", type=float, default=20.0, help="a step multiplying the batch approx-KL by this is a spike")
    args = p.parse_args(argv)
    torch.set_num_threads(1)

    found = {}
    real_update = loop.ppo_update

    def traced_update(llm, loss_module, ac, optimizers, cfg, generator, *, process_group=None):
        model, opt = ac.actor_model, optimizers[0]
        mask, old = llm["mask"], llm["sample_log_prob"]
        trace, before = [], {}

        def kl_on_batch():
            with torch.no_grad():
                td = llm.select("input_ids", "attention_mask").clone()
                d = (ac.actor(td)["log_prob"] - old).masked_fill(~mask, 0.0)
                k2 = 0.5 * d * d
                return float(k2[mask].mean()), float(k2.max())

        def pre(o, a, k):
            before["params"] = [q.detach().clone() for q in model.parameters()]
            before["critic"] = [q.detach().clone() for q in ac.critic_parameters()]
            before["grad"] = float(torch.cat([q.grad.flatten() for q in model.parameters() if q.grad is not None]).norm())
            before["kl"] = kl_on_batch()[0]

        def post(o, a, k):
            mean, top = kl_on_batch()
            upd = torch.cat([(q.detach() - b).flatten() for q, b in zip(model.parameters(), before["params"])])
            trace.append(dict(step=len(trace) + 1, kl=mean, kl_token_max=top, update_norm=float(upd.norm()),
                              update_max_over_lr=float(upd.abs().max()) / cfg.lr, grad_norm=before["grad"]))
            if mean >= max(0.05, args.jump * max(before["kl"], 1e-4)):
                found.update(llm=llm.clone(), ac=ac, cfg=cfg, loss=loss_module, trace=trace, before=before,
                             after=[q.detach().clone() for q in model.parameters()], iteration=len(iters))
                raise _Found

        h1, h2 = opt.register_step_pre_hook(pre), opt.register_step_post_hook(post)
        iters.append(1)
        try:
            return real_update(llm, loss_module, ac, optimizers, cfg, generator, process_group=process_group)
        finally:
            h1.remove()
            h2.remove()

    iters: list[int] = []
    loop.ppo_update = traced_update  # the loop calls the update through its own module
    try:
        T.main(["--seed", str(args.seed), "--iterations", str(args.max_iterations), "--lr", str(args.lr),
                "--no-rollback", "--no-progress", "--no-plot", "--out", str(ROOT / "runs" / "trace_kl_spike"),
                "--overwrite"])  # a fresh trace each time
    except _Found:
        pass
    finally:
        loop.ppo_update = real_update
    if not found:
        print(f"no step multiplied the batch approx-KL by {args.jump}x within {args.max_iterations} iterations")
        return 1

    ac, llm, cfg, P = found["ac"], found["llm"], found["cfg"], found["ac"].actor.module.prompt_len
    model = ac.actor_model
    print(f"seed {args.seed}, actor lr {args.lr}: spike at iteration {found['iteration']}, "
          f"step {found['trace'][-1]['step']}\n")
    print("1. every AdamW step of that iteration, measured on the whole rollout batch after the step")
    print(f"{'step':>4s} {'kl_approx':>10s} {'token max':>10s} {'|update|':>9s} {'max|upd|/lr':>11s} {'grad norm':>9s}")
    for r in found["trace"]:
        print(f"{r['step']:4d} {r['kl']:10.4f} {r['kl_token_max']:10.3f} {r['update_norm']:9.4f} "
              f"{r['update_max_over_lr']:11.2f} {r['grad_norm']:9.3f}")

    names = [n for n, _ in model.named_parameters()]
    before, after = found["before"]["params"], found["after"]

    def set_params(t, only=None):
        with torch.no_grad():
            for n, q, a, b in zip(names, model.parameters(), before, after):
                q.copy_(a + t * (b - a) if only is None or n.startswith(only) else a)

    with torch.no_grad():
        set_params(0.0)
        base = _policy_logp(model, llm, P)
        mask = llm["mask"]

        def exact_kl(only=None, t=1.0):
            set_params(t, only)
            new = _policy_logp(model, llm, P)
            kl = (base.exp() * (base - new)).sum(-1)  # [B, R] KL(old || new) per position
            return [float(kl[:, j][mask[:, j]].mean()) if mask[:, j].any() else 0.0 for j in range(kl.shape[1])]

        print("\n2. line scan along that one step: exact KL(old || new) per response position (nats)")
        print(f"{'t':>4s} " + " ".join(f"{'pos ' + str(j):>9s}" for j in range(mask.shape[1])))
        for t in (0.0, 0.2, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.5, 2.0):
            print(f"{t:4.1f} " + " ".join(f"{v:9.4f}" for v in exact_kl(t=t)))

        print("\n3. the step applied to one group of parameters at a time (t = 1)")
        for g in _param_groups(names):
            kl = exact_kl(only=g)
            print(f"  {g[:-1]:18s} mean KL over positions {sum(kl) / len(kl):8.4f}   largest position {max(kl):8.4f}")

        set_params(1.0)
    # 4. the trust region on the same step: ppo_update's backtracking, measured on the whole batch
    def kl_approx_now():
        with torch.no_grad():
            return float(found["loss"](llm)["kl_approx"])

    print(f"\n4. the trust region (early_stop_kl={cfg.early_stop_kl}) on this step, measured on the whole batch")
    kept = None
    for frac in (1.0, *update._BACKTRACK):
        set_params(frac)
        kl = kl_approx_now()
        print(f"  fraction {frac:5.3f} of the step: kl_approx {kl:.4f}" + ("  <- kept" if kl <= cfg.early_stop_kl
                                                                         and kept is None else ""))
        if kl <= cfg.early_stop_kl and kept is None:
            kept = frac
    if kept is None:
        print("  no fraction is inside the limit: the step is undone")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""PPO-iteration time: the TorchRL pipeline of ``ppo_objectives.train`` vs a plain-PyTorch MiniMind-style loop.

Same model (TinyCausalLM, same initial weights, format warm start), same task,
same batch size, same learning rate (1e-4), same schedule (``ppo_epochs`` x ``minibatches`` AdamW steps,
grad clip 1.0, early stop disabled on both sides so both take every step), in
the same run.

* **torchrl**: ``Collector`` + ``TokenLMEnv`` rollout -> ``trajectories_to_llm_batch``
  -> critic -> ``KLPenaltyTransform`` -> ``MaskedGAE`` -> ``TokenPPOLoss`` minibatches
  (``train.rollout_batch`` and ``train.ppo_update``, the code the main job runs).
* **plain**: ``sample_with_kv_cache`` rollout, reward, reference log-probs and values
  by direct forwards, k1 penalty in the reward, MiniMind's reversed GAE loop,
  masked whitening, and hand-written clipped policy / value losses.

Reported: median seconds per iteration (rollout and update split; the two sides
alternate iteration by iteration) and the ratio plain / torchrl (goal >= 0.8).

    python benchmarks/bench_iteration.py
    python benchmarks/bench_iteration.py --quick
    python benchmarks/bench_iteration.py --device cuda
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import time

import torch

from ppo_objectives import train as T
from ppo_objectives.train.digit import DigitTask, warm_start
from ppo_objectives.llm.env import TokenLMEnv
from ppo_objectives.loss import TokenPPOLoss
from ppo_objectives.llm.models import TinyCausalLM, TinyLMConfig
from ppo_objectives.llm.policy import sample_with_kv_cache
from ppo_objectives.llm.readouts import frozen_reference, make_actor_critic
from ppo_objectives.transforms import FixedKLController, KLPenaltyTransform
from ppo_objectives.value.gae import MaskedGAE


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --------------------------------------------------------------------------- plain PyTorch, MiniMind style


def _logp(lm, ids, attn, P):
    logits = lm(ids, attn).logits[:, P - 1 : -1].float()  # predicts response tokens
    logp_all = torch.log_softmax(logits, -1)
    return logp_all.gather(-1, ids[:, P:, None]).squeeze(-1), -(logp_all.exp() * logp_all).sum(-1)


class PlainPPO:
    def __init__(self, actor_lm, critic_lm, ref_lm, task, cfg, device):
        self.actor, self.critic, self.ref, self.task, self.cfg = actor_lm, critic_lm, ref_lm, task, cfg
        self.head = torch.nn.Linear(critic_lm.hidden_size, 1).to(device)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)
        self.a_opt = torch.optim.AdamW(actor_lm.parameters(), lr=cfg.lr, weight_decay=0.0)
        self.c_opt = torch.optim.AdamW(list(critic_lm.parameters()) + list(self.head.parameters()), lr=cfg.critic_lr,
                                       weight_decay=0.0)
        self.device = device
        self.gen = torch.Generator().manual_seed(0)

    def values(self, ids, attn, P):
        return self.head(self.critic(ids, attn, compute_logits=False).hidden[:, P - 1 : -1]).squeeze(-1).float()

    def rollout(self, N, P, M):
        cfg, task = self.cfg, self.task
        prompts = task.sample_prompts(N, self.gen).to(self.device)
        pmask = prompts != task.PAD
        resp, old_logp, mask = sample_with_kv_cache(self.actor, prompts, pmask, M, eos_id=task.EOS)
        ids, attn = torch.cat([prompts, resp], 1), torch.cat([pmask, mask], 1)
        with torch.no_grad():
            score = task.reward(prompts, pmask, resp, mask)
            ref_logp, _ = _logp(self.ref, ids, attn, P)
            values = self.values(ids, attn, P) * mask
        m = mask.float()
        rewards = -cfg.kl_reward_coeff * (old_logp - ref_logp) * m
        last = (mask.long().cumsum(1) == mask.long().sum(1, keepdim=True)) & mask  # last valid token
        rewards = rewards + score[:, None] * last
        adv = torch.zeros_like(rewards)  # MiniMind's GAE: reversed loop, next value 0 after the end
        lastgaelam = torch.zeros(N, device=self.device)
        for t in reversed(range(M)):
            next_v = values[:, t + 1] if t + 1 < M else torch.zeros(N, device=self.device)
            delta = rewards[:, t] + cfg.gamma * next_v - values[:, t]
            lastgaelam = delta + cfg.gamma * cfg.lmbda * lastgaelam
            adv[:, t] = lastgaelam
        adv = adv * m
        returns = adv + values
        mean = (adv * m).sum() / m.sum()
        var = (((adv - mean) * m) ** 2).sum() / m.sum()
        adv = (adv - mean) * torch.rsqrt(var + 1e-8) * m
        return dict(ids=ids, attn=attn, mask=m, old_logp=old_logp, adv=adv, returns=returns, values=values)

    def update(self, b, P):
        cfg = self.cfg
        B = b["ids"].shape[0]
        mb = max(1, math.ceil(B / cfg.minibatches))
        for _ in range(cfg.ppo_epochs):
            perm = torch.randperm(B, generator=self.gen).to(self.device)
            for s in range(0, B, mb):
                i = perm[s : s + mb]
                m = b["mask"][i]
                n = m.sum().clamp(min=1)
                logp, _ = _logp(self.actor, b["ids"][i], b["attn"][i], P)
                ratio = torch.exp(logp - b["old_logp"][i])
                adv = b["adv"][i]
                pg = torch.max(-adv * ratio, -adv * ratio.clamp(1 - cfg.clip_epsilon, 1 + cfg.clip_epsilon))
                policy_loss = (pg * m).sum() / n
                v = self.values(b["ids"][i], b["attn"][i], P)
                v_old = b["values"][i]
                v_clip = v_old + (v - v_old).clamp(-cfg.clip_value, cfg.clip_value)
                vf = torch.max((v - b["returns"][i]) ** 2, (v_clip - b["returns"][i]) ** 2)
                value_loss = 0.5 * (vf * m).sum() / n
                loss = policy_loss + cfg.critic_coeff * value_loss
                self.a_opt.zero_grad(set_to_none=True)
                self.c_opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(self.actor.parameters(), cfg.max_grad_norm)
                torch.nn.utils.clip_grad_norm_(list(self.critic.parameters()) + list(self.head.parameters()),
                                               cfg.max_grad_norm)
                self.a_opt.step()
                self.c_opt.step()
                _ = float(((logp.detach() - b["old_logp"][i]) ** 2 * m).sum() / n)  # MiniMind reads approx-KL


# --------------------------------------------------------------------------- the comparison


def measure(num_envs, preset, device, iterations, seed=0):
    torch.manual_seed(seed)
    # early stop off so both sides take all 16 steps; a small learning rate keeps the policy (and with it
    # the response lengths, i.e. the work) from drifting during the timed iterations
    cfg = T.TrainConfig(num_envs=num_envs, preset=preset, early_stop_kl=0.0, device=device.type, lr=1e-4, critic_lr=1e-4)
    task = DigitTask("reverse", 3)
    env = TokenLMEnv.from_task(task, num_envs=num_envs, device=device, seed=seed)
    P, M = env.prompt_len, env.max_new_tokens
    base = TinyCausalLM(TinyLMConfig.preset(preset, vocab_size=task.vocab_size, block_size=P + M)).to(device)
    warm_start(base, task, 100, 3e-3, torch.Generator().manual_seed(seed), device)

    # --- torchrl side
    ac = make_actor_critic(copy.deepcopy(base), P, entropy_grad=False)
    ref = frozen_reference(ac.actor_model, P)
    kl = KLPenaltyTransform(ref, coeff=FixedKLController(cfg.kl_reward_coeff), estimator="k1")
    gae = MaskedGAE(gamma=cfg.gamma, lmbda=cfg.lmbda, average_gae=True, device=device)
    loss = TokenPPOLoss(ac.actor, ac.critic, clip_epsilon=cfg.clip_epsilon, clip_value=cfg.clip_value,
                        critic_coeff=cfg.critic_coeff, kl_to_ref_coeff=0.0, entropy_bonus=True, functional=False, device=device)
    opts = (torch.optim.AdamW(ac.actor_parameters(), lr=cfg.lr, weight_decay=0.0),
            torch.optim.AdamW(ac.critic_parameters(), lr=cfg.critic_lr, weight_decay=0.0))
    collector = T.make_collector(cfg, task, ac.policy, env)
    it = iter(collector)
    gen = torch.Generator().manual_seed(seed)

    # --- plain side
    plain = PlainPPO(copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base).requires_grad_(False), task, cfg,
                     device)
    ours, theirs = [], []
    for k in range(iterations + 1):  # the sides alternate iteration by iteration; the first is warm-up
        _sync(device)
        t0 = time.perf_counter()
        llm = T.rollout_batch(it, ac, kl, gae, P, M)
        _sync(device)
        t1 = time.perf_counter()
        T.ppo_update(llm, loss, ac, opts, cfg, gen)
        _sync(device)
        t2 = time.perf_counter()
        b = plain.rollout(num_envs, P, M)
        _sync(device)
        t3 = time.perf_counter()
        plain.update(b, P)
        _sync(device)
        if k:
            ours.append((t1 - t0, t2 - t1, llm.batch_size[0]))
            theirs.append((t3 - t2, time.perf_counter() - t3))
    collector.shutdown()

    def med(xs, i):
        return statistics.median(x[i] for x in xs)

    o_total = statistics.median(a + b for a, b, _ in ours)
    p_total = statistics.median(a + b for a, b in theirs)
    return dict(
        num_envs=num_envs, preset=preset, B=statistics.median(x[2] for x in ours),
        torchrl_rollout=med(ours, 0), torchrl_update=med(ours, 1), torchrl_total=o_total,
        plain_rollout=med(theirs, 0), plain_update=med(theirs, 1), plain_total=p_total, ratio=p_total / o_total,
    )  # fmt: skip


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where everything runs")
    p.add_argument("--quick", action="store_true", help="one small configuration, few iterations")
    p.add_argument("--iterations", type=int, default=None, help="timed iterations per side (default 8, quick 2)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (0 = torch's default)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    iterations = args.iterations or (2 if args.quick else 8)
    if args.quick:
        configs = [(16, "pico")]
    elif device.type == "cuda":
        configs = [(64, "nano"), (256, "nano"), (256, "micro")]
    else:
        configs = [(64, "nano"), (256, "nano"), (64, "micro")]
    print(f"PPO iteration time on {device} (torch threads: {torch.get_num_threads()}), median of {iterations}; "
          f"4 epochs x 4 minibatches, no early stop")
    print(f"{'N':>5} {'model':>6} {'B':>5} | {'torchrl roll':>12} {'update':>8} {'total s':>8} | "
          f"{'plain roll':>10} {'update':>8} {'total s':>8} | {'ratio':>5}")
    rows = []
    for n, preset in configs:
        r = measure(n, preset, device, iterations)
        rows.append(r)
        print(f"{n:>5} {preset:>6} {r['B']:>5.0f} | {r['torchrl_rollout']:>12.4f} {r['torchrl_update']:>8.4f} "
              f"{r['torchrl_total']:>8.4f} | {r['plain_rollout']:>10.4f} {r['plain_update']:>8.4f} "
              f"{r['plain_total']:>8.4f} | {r['ratio']:>5.2f}")
    print("ratio = plain seconds per iteration / torchrl seconds per iteration")
    print("Goals:")
    for r in rows:
        verdict = "met" if r["ratio"] >= 0.8 else "not met"
        print(f"  N={r['num_envs']} {r['preset']}: torchrl iteration at {r['ratio']:.2f}x the plain loop's speed "
              f"(goal >= 0.8x): {verdict}")
    return rows


if __name__ == "__main__":
    main()

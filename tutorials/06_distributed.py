"""Tutorial 6: data-parallel PPO with torch.distributed -- 2 ranks give the numbers of 1 process.

Run it:  python tutorials/06_distributed.py

With DistributedDataParallel each rank holds part of the batch, and DDP
*averages* the ranks' gradients. Two statistics then need the whole batch, not
the rank's share, or the numbers change with the number of processes:

1. the whitening of the advantages (mean and variance over *all* valid tokens);
2. the token-mean denominator: a rank with 10 valid tokens and one with 30 must
   weigh each token the same, so every rank divides by the global count
   (``functional.loss_normalizer(mask, process_group=pg)``) and DDP's average
   turns ``world * local_sum / global_count`` into ``global_sum / global_count``.

Part 1 starts 2 CPU processes (gloo) with ``torch.multiprocessing`` and checks
both against one process holding the whole batch. Part 2 launches the real
training loop the way you would: ``torchrun --nproc_per_node 2 -m ppo_objectives.train``.
``PPO_TUTORIAL_SMOKE=1`` runs a tiny budget in seconds (the test suite does).
"""

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ppo_objectives.functional import clipped_value_loss, loss_normalizer, masked_gae

SMOKE = os.environ.get("PPO_TUTORIAL_SMOKE") == "1"
WORLD = 2


def global_batch():
    """4 responses of R = 5 tokens; rank 0 gets rows 0-1 (7 valid tokens), rank 1 rows 2-3 (3 tokens)."""
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.bool)
    rewards = torch.zeros(4, 5)
    rewards[torch.arange(4), mask.sum(1) - 1] = torch.tensor([1.0, 0.0, 1.0, 0.5])  # score on the last token
    features = torch.randn(4, 5, 3, generator=g)  # what the toy critic reads
    return rewards, mask, features


def step(rewards, mask, features, critic, process_group):
    """GAE (whitened), then the value loss and its gradient: the pieces that depend on the batch."""
    with torch.no_grad():
        values = critic(features).squeeze(-1)
    advantages, returns = masked_gae(rewards, values, mask, 1.0, 0.95, process_group=process_group)
    norm = loss_normalizer(mask, process_group=process_group)  # one all-reduce per optimizer step
    new_values = critic(features).squeeze(-1)  # through the DDP wrapper when there is one
    loss = clipped_value_loss(new_values, values, returns, mask, 0.2, normalizer=norm)
    loss.backward()
    return advantages, loss.detach()


def rank_main(rank, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    rewards, mask, features = (x[2 * rank : 2 * rank + 2] for x in global_batch())  # this rank's rows
    torch.manual_seed(0)
    critic = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 1))  # gradients averaged in backward
    adv, loss = step(rewards, mask, features, critic, dist.group.WORLD)
    dist.all_reduce(loss)  # for printing: the mean over the ranks is the global loss
    torch.save(
        {"adv": adv, "loss": loss / WORLD, "grad": critic.module.weight.grad.clone()},
        os.path.join(out_dir, f"rank{rank}.pt"),
    )
    del critic  # free DDP while the process group still exists, then leave together
    dist.barrier()
    dist.destroy_process_group()


def part1():
    print("== 1. two gloo processes vs one process on the whole batch")
    rewards, mask, features = global_batch()
    torch.manual_seed(0)
    critic = torch.nn.Linear(3, 1)
    adv_1, loss_1 = step(rewards, mask, features, critic, None)
    grad_1 = critic.weight.grad
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(rank_main, args=(os.path.join(tmp, "init"), tmp), nprocs=WORLD, join=True)
        ranks = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(WORLD)]
    adv_2 = torch.cat([r["adv"] for r in ranks])
    print(f"valid tokens per rank: {mask[:2].sum().item()} and {mask[2:].sum().item()}")
    print(f"whitened advantages, max |2 ranks - 1 process| = {(adv_2 - adv_1).abs().max():.1e}")
    print(f"value loss: 1 process {loss_1:.6f}, 2 ranks {ranks[0]['loss']:.6f}")
    print(f"gradient (after DDP's average) max |difference| = {(ranks[0]['grad'] - grad_1).abs().max():.1e}, "
          f"identical on both ranks: {torch.equal(ranks[0]['grad'], ranks[1]['grad'])}")  # fmt: skip

    # what goes wrong without the process group: each rank whitens and averages on its own
    halves = (slice(0, 2), slice(2, 4))
    local = torch.cat([masked_gae(rewards[s], torch.zeros(2, 5), mask[s], 1.0, 0.95)[0] for s in halves])
    ref = masked_gae(rewards, torch.zeros(4, 5), mask, 1.0, 0.95)[0]
    print(f"look: whitening per rank instead (V = 0) is off by up to {(local - ref).abs().max():.2f}, and a per-rank")
    print("      token mean would weigh rank 1's 3 tokens like rank 0's 7: pass process_group everywhere")


def part2():
    print("\n== 2. the training loop under torchrun (gloo on CPU; --device cuda uses nccl, one GPU per rank)")
    iterations = "2" if SMOKE else "150"  # ~1-2 minutes on 2 CPU cores; the reward climbs from ~0.3 to ~0.7
    small = ["--preset", "pico", "--num-envs", "16", "--warmup-steps", "5"] if SMOKE else []
    with tempfile.TemporaryDirectory() as out:
        cmd = ["torchrun", "--nproc_per_node", "2", "-m", "ppo_objectives.train", "--iterations", iterations,
               "--out", out, "--no-progress", "--no-plot", *small]  # fmt: skip
        print("$", " ".join(cmd))
        root = str(Path(__file__).resolve().parents[1])  # the package of this checkout
        env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
        t0 = time.perf_counter()
        # python -m torch.distributed.run is the torchrun command, with this interpreter
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", *cmd[1:]], env=env,
                              capture_output=True, text=True, timeout=600)  # fmt: skip
        if proc.returncode != 0:
            sys.exit(f"torchrun failed:\n{proc.stderr[-3000:]}")
        print(proc.stdout.strip())
        print([line for line in proc.stderr.splitlines() if "identical" in line][0])
        with open(os.path.join(out, "metrics.csv")) as f:
            header, *rows = f.read().splitlines()
        episodes = rows[-1].split(",")[header.split(",").index("episodes")]
        print(f"{len(rows)} metric rows (rank 0 writes them), {episodes} responses per iteration from both ranks, "
              f"{time.perf_counter() - t0:.0f}s in all")  # fmt: skip


if __name__ == "__main__":
    part1()
    part2()

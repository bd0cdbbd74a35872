"""What LoRA would save in an update step on SmolLM2: full fine-tuning against LoRA adapters, same batch, one run.

The job's update (and the plain loop's) is a forward, a backward and an AdamW step of all 134.5M
parameters. With LoRA adapters (``peft``: rank ``--rank`` on every attention and MLP projection,
the base weights frozen) the backward still carries the activations' gradients through every layer
but computes no gradient of a base weight, and AdamW touches only the adapters. This benchmark
measures how much of an update step that removes on this machine. It does not train: what LoRA
would cost in learning (it needs its own learning rate) is not measured here.

Both sides run in one process on the same batch: 8 prompts x 4 completions of ``--task`` sampled
once from the model at T = 1 (up to 16 new tokens), a policy-gradient loss on the response tokens
(the plain loop's ``plain_pg_loop.sample_group_batch`` and ``pg_loss``: log-probs of the response
positions from the model's logits, group-mean advantages). The sides alternate step by step; the
first step of each is a warm-up. Printed: the median seconds of the forward, the backward and the AdamW step per side,
trainable parameters, and the ratios LoRA / full.

    pip install peft
    python benchmarks/bench_lora_update.py               # chat-add1, rank 16, 5 measured steps a side
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]  # this checkout

from plain_pg_loop import pg_loss, sample_group_batch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from ppo_objectives.train.pretrained import export_hf_checkpoint, load_tokenizer
from ppo_objectives.train.text import TextTask, arithmetic_examples, number_reward

DEFAULT_MODEL = Path("runs/smollm2-135m-instruct")
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def update_step(model, opt, batch: dict) -> dict:
    """The plain loop's update (``pg_loss``, backward, AdamW step); seconds of each part."""
    t0 = time.perf_counter()
    loss = pg_loss(model, batch)
    t1 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    t2 = time.perf_counter()
    opt.step()
    t3 = time.perf_counter()
    return dict(forward=t1 - t0, backward=t2 - t1, adamw=t3 - t2, total=t3 - t0)


def lora_model(model_dir: Path, rank: int):
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError as e:
        raise SystemExit(f"error: this benchmark needs peft ({e}); install it: pip install peft") from None
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32)
    model = inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=PROJECTIONS), model)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    return model


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--task", default="chat-add1", choices=("chat-add1", "chat-add2"))
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--steps", type=int, default=5, help="measured steps a side (after one warm-up)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = p.parse_args(argv)
    if args.rank < 1 or args.steps < 1:
        p.error("--rank and --steps must be at least 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    if not (args.model / "config.json").is_file():
        export_hf_checkpoint("smollm2", args.model)
    task = TextTask(arithmetic_examples(args.task, "train"), number_reward, load_tokenizer(args.model),
                    max_new_tokens=16)
    full = AutoModelForCausalLM.from_pretrained(args.model, local_files_only=True, dtype=torch.float32)
    torch.manual_seed(args.seed)  # generate's sampling stream
    batch = sample_group_batch(full, task, torch.Generator().manual_seed(args.seed))
    lora = lora_model(args.model, args.rank)
    sides = {"full": (full, torch.optim.AdamW(full.parameters(), lr=1e-5, weight_decay=0.0)),
             "lora": (lora, torch.optim.AdamW([q for q in lora.parameters() if q.requires_grad], lr=1e-4,
                                              weight_decay=0.0))}
    times: dict[str, list[dict]] = {name: [] for name in sides}
    for step in range(args.steps + 1):
        for name, (model, opt) in sides.items():
            t = update_step(model, opt, batch)
            if step:
                times[name].append(t)
    rows, tokens = int(batch["out"].shape[0]), int(batch["resp_mask"].sum())
    print(f"{args.task}, {rows} rows, {batch['out'].shape[1]} tokens each, {tokens} response tokens; "
          f"LoRA rank {args.rank} on {', '.join(PROJECTIONS)}; median of {args.steps} steps, {torch.get_num_threads()} "
          f"threads")
    print("| side | trainable parameters | forward s | backward s | AdamW s | step s |")
    print("|---|---|---|---|---|---|")
    med = {n: {k: statistics.median(t[k] for t in ts) for k in ts[0]} for n, ts in times.items()}
    for name, (model, _) in sides.items():
        n = sum(q.numel() for q in model.parameters() if q.requires_grad)
        m = med[name]
        print(f"| {name} | {n / 1e6:.2f}M | {m['forward']:.2f} | {m['backward']:.2f} | {m['adamw']:.2f} | "
              f"{m['total']:.2f} |")
    ratio = {k: med["lora"][k] / med["full"][k] for k in med["full"]}
    print(f"| lora / full | | {ratio['forward']:.2f}x | {ratio['backward']:.2f}x | {ratio['adamw']:.2f}x | "
          f"{ratio['total']:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

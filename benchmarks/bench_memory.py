"""Peak host memory of a SmolLM2 training iteration: full fine-tuning against LoRA, with and without the KL term.

What it compares: the job (``python -m ppo_objectives.train --model DIR --task chat-add1``, the
``pretrained`` recipe) in the rows of ``bench_real_lm_split.py`` (``kl``, ``no-kl``, ``lora-kl``,
``lora-no-kl``), each in a process of its own. The number is the peak resident set size
(``VmHWM`` of ``/proc/self/status``) over the training iterations 2 to ``--iterations - 1``: the
mark is reset after iteration 1 (``/proc/self/clear_refs``), so the loading of the models and the
held-out evaluations at the start and at the end, whose batched prefill of 64 prompts over the
whole vocabulary outgrows an iteration, are not in it. Also printed: the resident size after the
last of those iterations, each row's ratio to the ``kl`` row (full fine-tuning, the recipe), and the job's update
time per iteration (the upper median over the same iterations, so a measured one: with the default 4 the
larger of iterations 2 and 3; what ``--micro-batches`` costs in time). ``--plain`` adds
the plain loop of ``plain_pg_loop.py`` (full fine-tuning, its model loaded as ``bench_real_lm_split.py`` loads it)
under the same protocol.

    python benchmarks/bench_memory.py                    # the four rows, 4 iterations each (Linux only)
    python benchmarks/bench_memory.py --task chat-calc --rows kl --plain    # the recipe against the plain loop
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]  # this checkout

from bench_real_lm_split import ROWS, row_parser  # noqa: E402


def _status_gib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 2**20  # kB
    raise RuntimeError(f"/proc/self/status has no {field}")


def one_row(args, row: str) -> dict:
    from ppo_objectives import train as T

    marks, update_s = {}, []

    def callback(r: dict, run) -> None:
        it = int(r["iteration"])
        if it == 1:  # from here on: the training iterations only
            Path("/proc/self/clear_refs").write_text("5")
        elif it >= 2:
            update_s.append(float(r["update_s"]))
        if it == args.iterations - 1:
            marks.update(peak_gib=_status_gib("VmHWM"), rss_gib=_status_gib("VmRSS"),
                         update_s=statistics.median_high(update_s))

    with tempfile.TemporaryDirectory(prefix="bench_memory_") as out:
        flags = ["--model", str(args.model), "--task", args.task, "--iterations", str(args.iterations), "--out", out,
                 "--threads", str(args.threads), "--no-progress", "--no-plot", "--eval-every", "0",
                 "--save-every", "100000", *ROWS[row]]
        T.train(T.TrainConfig(**vars(T.build_parser().parse_args(flags))), callbacks=[callback])
    return dict(row=row, flags=ROWS[row], **marks)


def plain_row(args) -> dict:
    """The plain loop (``plain_pg_loop.plain_pg_step`` on the same model and training prompts, its gradient
    accumulated on ``chat-word`` as in the study) under the same protocol: the mark reset after step 1, read after
    step ``--iterations - 1``."""
    import torch
    from bench_real_lm_split import plain_model
    from plain_pg_loop import build_tasks, plain_pg_step
    from sides import PLAIN_MICRO_BATCHES

    from ppo_objectives.train.pretrained import load_tokenizer

    torch.set_num_threads(args.threads)
    task, _, _ = build_tasks(args.task, load_tokenizer(args.model))
    model, opt = plain_model(args.model, 0)
    gen, marks = torch.Generator().manual_seed(0), {}
    for it in range(1, args.iterations):
        plain_pg_step(model, opt, task, gen, micro_batches=PLAIN_MICRO_BATCHES.get(args.task, 1))
        if it == 1:
            Path("/proc/self/clear_refs").write_text("5")
    marks.update(peak_gib=_status_gib("VmHWM"), rss_gib=_status_gib("VmRSS"))
    return dict(row="plain", flags=["plain_pg_loop.py"], **marks)


def main(argv=None) -> int:
    p = row_parser(__doc__.split("\n\n")[0])
    p.add_argument("--iterations", type=int, default=4, help="iterations per row; the peak is over 2 .. N-1")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--plain", action="store_true", help="also the plain loop's peak, under the same protocol")
    args = p.parse_args(argv)
    if not Path("/proc/self/clear_refs").exists():
        p.error("this benchmark reads and resets the peak RSS through /proc (Linux only)")
    if args.iterations < 3:
        p.error(f"--iterations must be >= 3 (the peak is over iterations 2 .. N-1), got {args.iterations}")
    if not (args.model / "config.json").is_file():
        p.error(f"--model {args.model} is not a checkpoint directory; write it with: python -m "
                f"ppo_objectives.pretrained --gguf smollm2 --out {args.model}")
    if args.one_row:
        print(json.dumps(plain_row(args) if args.one_row == "plain" else one_row(args, args.one_row)))
        return 0
    results = []
    for row in [*args.rows, *(["plain"] if args.plain else [])]:
        cmd = [sys.executable, __file__, "--one-row", row, "--model", str(args.model), "--task", args.task,
               "--iterations", str(args.iterations), "--threads", str(args.threads)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TQDM_DISABLE": "1"})
        if proc.returncode:
            print(proc.stderr[-3000:], file=sys.stderr)
            print(f"error: row {row} failed", file=sys.stderr)
            return 1
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(f"{row}: peak {results[-1]['peak_gib']:.2f} GiB", file=sys.stderr, flush=True)
    base = next((r["peak_gib"] for r in results if r["row"] == "kl"), None)
    print(f"\n{args.task} on {args.model}: peak RSS over training iterations 2..{args.iterations - 1}\n")
    print("| row | job flags | peak RSS GiB | RSS after GiB | peak / kl row | update s (upper median) |")
    print("|---|---|---|---|---|---|")
    for r in results:
        ratio = f"{r['peak_gib'] / base:.2f}x" if base else ""
        update = f"{r['update_s']:.2f}" if "update_s" in r else "-"
        print(f"| {r['row']} | `{' '.join(r['flags']) or '(the recipe)'}` | {r['peak_gib']:.2f} | {r['rss_gib']:.2f} | "
              f"{ratio} | {update} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

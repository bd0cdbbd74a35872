"""Where a PPO iteration of the job spends its time on SmolLM2, next to the plain loop's iteration, row by row.

``bench_real_lm.py`` compares learning per minute; this benchmark says what an iteration costs and
where the time goes, for four rows of settings:

* ``kl``: the job as ``python -m ppo_objectives.train --model DIR --task TASK`` builds it (the
  ``pretrained`` recipe: 32 rows, a value head on the actor's trunk, one pass in two minibatch
  steps, the in-reward KL penalty to a frozen reference);
* ``no-kl``: the same with ``--kl-reward-coeff 0`` (no reference is built, no reference forward);
* ``lora-kl`` / ``lora-no-kl``: the same two with ``--lora-rank 16`` (the reference is the actor
  with its adapters off).

Each row runs in a process of its own, where the job (``train.train`` with a callback) and the
plain loop alternate iteration by iteration: the callback takes the phases of the job's iteration
(its own ``rollout_s + reference_s + update_s``) and then runs one iteration of the plain loop
(``plain_pg_loop.plain_pg_step``: ``model.generate`` of 8 prompts x 4 samples at T = 1, one
forward and backward, one AdamW step) on its own copy of the model, with LoRA adapters of the same
rank in the LoRA rows. Each phase of the job is timed on its own (a phase nested in another is not
counted in its parent). Reported per row: the median seconds per iteration over the measured
iterations (the first of each side is a warm-up), the job / plain ratio, and the job's phases.
Each row's numbers are written to ``benchmarks/results/split/TASK-ROW.json``; ``--summary-only``
prints the tables of the rows written.

    python benchmarks/bench_real_lm_split.py                           # chat-add1, the four rows
    python benchmarks/bench_real_lm_split.py --rows kl bf16-ref --iterations 8
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]  # this checkout

from plain_pg_loop import plain_pg_step  # noqa: E402
from sides import PLAIN_MICRO_BATCHES  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402


from ppo_objectives import train as T
from ppo_objectives.train import loop, update

DEFAULT_MODEL = Path("runs/smollm2-135m-instruct")
ROLLOUT = "rollout (collector: sampling, V_old)"
OTHER = "rest of the iteration (untimed steps inside the rollout, scoring and update)"
REFERENCE = "reference forward + KL penalty"


class PhaseClock:
    """Exclusive wall time per phase name: while a nested phase runs, its parent's clock stops."""

    def __init__(self):
        self.totals: dict[str, float] = defaultdict(float)
        self._stack: list[list] = []  # [name, start of the running slice]

    @contextlib.contextmanager
    def phase(self, name: str):
        now = time.perf_counter()
        if self._stack:
            parent = self._stack[-1]
            self.totals[parent[0]] += now - parent[1]
        self._stack.append([name, now])
        try:
            yield
        finally:
            now = time.perf_counter()
            _, start = self._stack.pop()
            self.totals[name] += now - start
            if self._stack:
                self._stack[-1][1] = now

    def inside(self, name: str) -> bool:
        return any(entry[0] == name for entry in self._stack)

    def take(self) -> dict[str, float]:
        out, self.totals = dict(self.totals), defaultdict(float)
        return out


def _timed(clock: PhaseClock, name, fn):
    """``fn`` timed under ``name`` (a string, or a function of no argument giving it)."""
    def wrapper(*args, **kwargs):
        with clock.phase(name() if callable(name) else name):
            return fn(*args, **kwargs)
    return wrapper


def instrument(run, clock: PhaseClock) -> None:
    """Put the clock on every phase of the job's iteration (module functions, methods, this run's modules)."""
    tr = update.TrustRegionUpdate
    loop.collect_batch = _timed(clock, ROLLOUT, loop.collect_batch)
    loop.release_host_memory = _timed(clock, "host memory trim", loop.release_host_memory)
    loop.ppo_update = _timed(clock, "update: rest (minibatch slicing, diagnostics)", loop.ppo_update)
    loss_name = lambda: ("update: trust-region check forward" if clock.inside("check")  # noqa: E731
                         else "update: loss forward")
    tr.loss = _timed(clock, loss_name, tr.loss)
    tr.backward = _timed(clock, "update: backward + gradient clipping", tr.backward)
    tr.check_last_step = _timed(clock, "check", tr.check_last_step)
    update.snapshot = _timed(clock, "update: trust-region snapshot", update.snapshot)
    for opt, whose in zip(run.optimizers, ("actor", "critic")):
        opt.step = _timed(clock, f"update: AdamW steps ({whose})", opt.step)
    head = run.ac.critic_head  # the value head: inside the rollout's and the loss's forwards
    head.forward = _timed(clock, "value head (in the rollout and the loss forwards)", head.forward)
    if run.kl_transform is not None:  # no KL term: no reference, no transform
        run.kl_transform.forward = _timed(clock, REFERENCE, run.kl_transform.forward)
    run.gae.forward = _timed(clock, "GAE", run.gae.forward)


ROWS = {  # row -> the job's extra flags (and the plain loop's LoRA rank)
    "kl": [],
    "no-kl": ["--kl-reward-coeff", "0"],
    "lora-kl": ["--lora-rank", "16"],
    "lora-no-kl": ["--lora-rank", "16", "--kl-reward-coeff", "0"],
    "bf16-ref": ["--reference-dtype", "bfloat16"],  # not a default row: the reference's forward in bf16
    "micro2": ["--micro-batches", "2"],  # not default rows: each minibatch's gradient over two / four row slices
    "micro4": ["--micro-batches", "4"],
}
DEFAULT_ROWS = ("kl", "no-kl", "lora-kl", "lora-no-kl")
RESULTS = Path(__file__).resolve().parent / "results" / "split"


def _lora_rank(flags: list[str]) -> int:
    return int(flags[flags.index("--lora-rank") + 1]) if "--lora-rank" in flags else 0


def plain_model(model_dir: Path, rank: int):
    """The plain loop's model: the checkpoint, with LoRA adapters of ``rank`` on the projections the job's
    ``--lora-rank`` uses (0: full fine-tuning); its AdamW over the trainable parameters (the job's learning rates)."""
    from ppo_objectives.llm.lora import LORA_TARGETS
    from ppo_objectives.train.config import LORA_LR, RECIPES

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True, dtype=torch.float32)
    if rank:
        from peft import LoraConfig, inject_adapter_in_model

        model = inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(LORA_TARGETS)),
                                        model)
        for name, q in model.named_parameters():
            q.requires_grad_("lora_" in name)
    lr = LORA_LR if rank else RECIPES["pretrained"]["lr"]
    return model, torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=lr, weight_decay=0.0)


def measure_row(args, row: str) -> dict:
    """``{job: [phases per iteration], plain: [...]}`` of one row, warm-up iterations dropped."""
    with tempfile.TemporaryDirectory(prefix="bench_real_lm_split_") as out:  # the job's run_config.json
        flags = ["--model", str(args.model), "--task", args.task, "--seed", str(args.seed), "--out", out,
                 "--iterations", str(args.iterations + 1), "--no-progress", "--threads", str(args.threads),
                 "--save-every", "1000", "--no-plot", "--eval-every", "0", *ROWS[row]]
        cfg = T.TrainConfig(**vars(T.build_parser().parse_args(flags)))
        plain, opt = plain_model(args.model, _lora_rank(ROWS[row]))
        gen = torch.Generator().manual_seed(args.seed)
        clock = PhaseClock()
        job_rows, plain_rows = [], []

        def after_each_iteration(r: dict, run) -> None:
            """The job's callback: the phases of the iteration just run, then one iteration of the plain loop."""
            it = int(r["iteration"]) - 1
            if it == 0:  # the warm-up: the clock goes on the job's phases from the next iteration on
                instrument(run, clock)
            else:
                phases = clock.take()
                phases.pop("check", None)  # its forward is counted under its own name
                elapsed = r["rollout_s"] + r["reference_s"] + r["update_s"]  # the job's own clock
                phases[OTHER] = elapsed - sum(v for k, v in phases.items() if k != "host memory trim")
                phases["iteration"] = elapsed
                phases["response tokens"] = r["response_len"] * r["episodes"]
                phases["answers"] = r["episodes"]
                job_rows.append(phases)
            step = plain_pg_step(plain, opt, run.task, gen, micro_batches=PLAIN_MICRO_BATCHES.get(args.task, 1))
            done = dict(generate=step["generate_s"], update=step["update_s"],
                        iteration=step["generate_s"] + step["update_s"], answers=step["answers"],
                        **{"response tokens": step["response_tokens"]})
            print(f"{row} iteration {it}: job {r['rollout_s'] + r['reference_s'] + r['update_s']:.1f} s, plain "
                  f"{done['iteration']:.1f} s" + (" (warm-up, not counted)" if it == 0 else ""), file=sys.stderr,
                  flush=True)
            if it > 0:
                plain_rows.append(done)

        T.train(cfg, callbacks=[after_each_iteration])
    return dict(row=row, flags=ROWS[row], task=args.task, model=str(args.model), seed=args.seed,
                threads=torch.get_num_threads(), date=time.strftime("%Y-%m-%d %H:%M"), job=job_rows, plain=plain_rows)


def _med(rows: list[dict], k: str) -> float:
    return statistics.median(r.get(k, 0.0) for r in rows)


def phase_table(job_rows: list[dict], plain_rows: list[dict]) -> str:
    keys = sorted({k for r in job_rows for k in r} - {"iteration", "response tokens", "answers"},
                  key=lambda k: -_med(job_rows, k))
    job_it, plain_it = _med(job_rows, "iteration"), _med(plain_rows, "iteration")
    lines = ["| side | phase | s / iteration (median) | share of the side's iteration |", "|---|---|---|---|"]
    for k in keys:
        lines.append(f"| job | {k} | {_med(job_rows, k):.2f} | {_med(job_rows, k) / job_it:.0%} |")
    lines.append(f"| job | **iteration** | **{job_it:.2f}** | {_med(job_rows, 'answers'):.0f} answers, "
                 f"{_med(job_rows, 'response tokens'):.0f} response tokens |")
    for k in ("generate", "update"):
        lines.append(f"| plain | {k} | {_med(plain_rows, k):.2f} | {_med(plain_rows, k) / plain_it:.0%} |")
    lines.append(f"| plain | **iteration** | **{plain_it:.2f}** | {_med(plain_rows, 'answers'):.0f} answers, "
                 f"{_med(plain_rows, 'response tokens'):.0f} response tokens |")
    return "\n".join(lines)


def per_answer(rows: list[dict]) -> float | None:
    """Median seconds per answer (completion or conversation) of a side's iterations; ``None`` for rows written
    before the answers were counted."""
    if not all("answers" in r for r in rows):
        return None
    return statistics.median(r["iteration"] / max(r["answers"], 1) for r in rows)


def summary_table(results: list[dict]) -> str:
    """One line per row. A multi-turn job's batch holds the conversations its rows finish within their steps
    (``chat-calc``: 64 to 84, two or three a row), the plain loop's always 32: "job / plain" compares iterations,
    "per answer" the same work."""
    lines = ["| row | job flags | job s / iteration | plain s / iteration | job / plain | answers job / plain | job / "
             "plain per answer | job reference forward s | job update s | plain update s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        job, plain = res["job"], res["plain"]
        upd = sum(_med(job, k) for k in {k for r in job for k in r} if k.startswith("update"))
        ref = _med(job, REFERENCE) if any(REFERENCE in r for r in job) else 0.0
        job_a, plain_a = per_answer(job), per_answer(plain)
        answers = f"{_med(job, 'answers'):.0f} / {_med(plain, 'answers'):.0f}" if job_a and plain_a else "n/a"
        ratio = f"**{job_a / plain_a:.2f}x**" if job_a and plain_a else "n/a"
        lines.append(f"| {res['row']} | `{' '.join(res['flags']) or '(the recipe)'}` | {_med(job, 'iteration'):.2f} | "
                     f"{_med(plain, 'iteration'):.2f} | **{_med(job, 'iteration') / _med(plain, 'iteration'):.2f}x** | "
                     f"{answers} | {ratio} | {ref:.2f} | {upd:.2f} | {_med(plain, 'update'):.2f} |")
    return "\n".join(lines)


def report(results: list[dict]) -> None:
    res0 = results[0]
    print(f"\n## {res0['task']} on {res0['model']}: one PPO iteration of the job vs one of the plain loop (seed "
          f"{res0['seed']}, {len(res0['job'])} measured iterations a side, {res0['threads']} threads, "
          f"{res0['date']})\n")
    print(summary_table(results))
    for res in results:
        print(f"\n### row {res['row']}\n")
        print(phase_table(res["job"], res["plain"]))


def row_parser(description: str) -> argparse.ArgumentParser:
    """The arguments every per-row SmolLM2 benchmark takes: ``--model``, ``--task``, ``--rows`` (and the hidden
    ``--one-row`` its row processes get)."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL,
                   help="checkpoint directory (python -m ppo_objectives.pretrained --gguf smollm2 --out DIR)")
    p.add_argument("--task", default="chat-add1", choices=("chat-add1", "chat-add2", "chat-calc", "chat-calc-sum", "chat-word"))
    p.add_argument("--rows", nargs="+", default=list(DEFAULT_ROWS), choices=list(ROWS))
    p.add_argument("--one-row", help=argparse.SUPPRESS)
    return p


def main(argv=None) -> int:
    p = row_parser(__doc__.split("\n\n")[0])
    p.add_argument("--iterations", type=int, default=5, help="measured iterations per side (after one warm-up)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--summary-only", action="store_true", help="print the tables of the rows already written")
    p.add_argument("--force", action="store_true", help="measure rows already written again, replacing them")
    args = p.parse_args(argv)
    if args.iterations < 1:
        p.error(f"--iterations must be >= 1, got {args.iterations}")
    paths = {row: RESULTS / f"{args.task}-{row}.json" for row in args.rows}
    if args.summary_only:
        missing = [str(path) for path in paths.values() if not path.exists()]
        if missing:
            p.error(f"no results for {', '.join(missing)}; run without --summary-only first")
        report([json.loads(paths[row].read_text()) for row in args.rows])
        return 0
    written = [str(path) for path in paths.values() if path.exists()]
    if written and not (args.force or args.one_row):
        p.error(f"{', '.join(written)} already written; --force measures again and replaces them, "
                f"--summary-only prints them")
    if not (args.model / "config.json").is_file():
        p.error(f"--model {args.model} is not a checkpoint directory; write it with: python -m "
                f"ppo_objectives.pretrained --gguf smollm2 --out {args.model}")
    if args.one_row:  # one row in this process: the job and the plain loop
        res = measure_row(args, args.one_row)
        RESULTS.mkdir(parents=True, exist_ok=True)
        RESULTS.joinpath(f"{args.task}-{args.one_row}.json").write_text(json.dumps(res))
        return 0
    for row in args.rows:  # each row in a process of its own
        cmd = [sys.executable, __file__, "--one-row", row, "--model", str(args.model), "--task", args.task,
               "--iterations", str(args.iterations), "--seed", str(args.seed), "--threads", str(args.threads)]
        if subprocess.call(cmd):
            print(f"error: row {row} failed", file=sys.stderr)
            return 1
    report([json.loads(paths[row].read_text()) for row in args.rows])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

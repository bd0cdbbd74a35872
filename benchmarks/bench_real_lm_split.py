"""Where a PPO iteration of the job spends its time on SmolLM2, next to the plain loop's iteration, in one run.

``bench_real_lm.py`` shows that the job learns as much per iteration as the plain loop
(``plain_pg_loop.py``) but makes fewer iterations per minute. This benchmark says where the
difference goes. In one process, alternating iteration by iteration:

* **the job**: built as ``python -m ppo_objectives.train --model DIR --task TASK`` builds it
  (the ``pretrained`` recipe: 32 rows, a value head on the actor's trunk, one pass in two
  minibatch steps, the approx-KL trust region), run by ``train.train`` with a callback that takes the
  phases of each iteration (the job's own ``rollout_s + reference_s + update_s``) and then runs the plain
  loop's iteration;
* **the plain loop**: ``model.generate`` of 8 prompts x 4 samples of the same task at T = 1,
  one forward and backward of the model on them, one AdamW step (``plain_pg_loop.plain_pg_step``),
  on its own copy of the model.

Each phase of the job is timed on its own (a phase nested in another is not counted in its
parent): the rollout through the collector, the reference forward with the KL penalty, GAE, and
in the update the loss forwards, the backwards (with gradient clipping), the AdamW steps, the
trust region's snapshots and its check of the last step. Reported: the median seconds per
iteration of every phase over the measured iterations (the first of each side is a warm-up and
not counted), each side's response tokens, and the ratios.

    python benchmarks/bench_real_lm_split.py                       # chat-add1, 5 measured iterations a side
    python benchmarks/bench_real_lm_split.py --task chat-add2 --iterations 8
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]  # this checkout

from plain_pg_loop import plain_pg_step  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402


from ppo_objectives import train as T
from ppo_objectives.train import loop, update

DEFAULT_MODEL = Path("runs/smollm2-135m-instruct")
ROLLOUT = "rollout (collector: sampling, V_old)"
OTHER = "rest of the iteration (untimed steps inside the rollout, scoring and update)"


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
    for opt in run.optimizers:
        opt.step = _timed(clock, "update: AdamW steps", opt.step)
    run.kl_transform.forward = _timed(clock, "reference forward + KL penalty", run.kl_transform.forward)
    run.gae.forward = _timed(clock, "GAE", run.gae.forward)


def measure(args) -> tuple[list[dict], list[dict]]:
    """``(job phases per iteration, plain phases per iteration)``, warm-up iterations dropped."""
    with tempfile.TemporaryDirectory(prefix="bench_real_lm_split_") as out:  # the job's run_config.json
        return _measure(args, out)


def _measure(args, out: str) -> tuple[list[dict], list[dict]]:
    flags = ["--model", str(args.model), "--task", args.task, "--seed", str(args.seed), "--out", out,
             "--iterations", str(args.iterations + 1), "--no-progress", "--threads", str(args.threads),
             "--save-every", "1000", "--no-plot"]
    cfg = T.TrainConfig(**vars(T.build_parser().parse_args(flags)))
    plain = AutoModelForCausalLM.from_pretrained(str(args.model), local_files_only=True, dtype=torch.float32)
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-5, weight_decay=0.0)
    gen = torch.Generator().manual_seed(args.seed)
    clock = PhaseClock()
    job_rows, plain_rows = [], []

    def after_each_iteration(row: dict, run) -> None:
        """The job's callback: the phases of the iteration just run, then one iteration of the plain loop."""
        it = int(row["iteration"]) - 1
        if it == 0:  # the warm-up: the clock goes on the job's phases from the next iteration on
            instrument(run, clock)
        else:
            phases = clock.take()
            phases.pop("check", None)  # its forward is counted under its own name
            elapsed = row["rollout_s"] + row["reference_s"] + row["update_s"]  # the job's own clock of the iteration
            phases[OTHER] = elapsed - sum(v for k, v in phases.items() if k != "host memory trim")
            phases["iteration"] = elapsed
            phases["response tokens"] = row["response_len"] * row["episodes"]
            job_rows.append(phases)
        step = plain_pg_step(plain, opt, run.task, gen)
        done = dict(generate=step["generate_s"], update=step["update_s"],
                    iteration=step["generate_s"] + step["update_s"], **{"response tokens": step["response_tokens"]})
        print(f"iteration {it}: job {row['rollout_s'] + row['reference_s'] + row['update_s']:.1f} s, plain "
              f"{done['iteration']:.1f} s" + (" (warm-up, not counted)" if it == 0 else ""), file=sys.stderr, flush=True)
        if it > 0:
            plain_rows.append(done)

    T.train(cfg, callbacks=[after_each_iteration])
    return job_rows, plain_rows


def table(job_rows: list[dict], plain_rows: list[dict]) -> str:
    med = lambda rows, k: statistics.median(r.get(k, 0.0) for r in rows)  # noqa: E731
    keys = sorted({k for r in job_rows for k in r} - {"iteration", "response tokens"},
                  key=lambda k: -med(job_rows, k))
    job_it, plain_it = med(job_rows, "iteration"), med(plain_rows, "iteration")
    lines = ["| side | phase | s / iteration (median) | share of the side's iteration |", "|---|---|---|---|"]
    for k in keys:
        lines.append(f"| job | {k} | {med(job_rows, k):.2f} | {med(job_rows, k) / job_it:.0%} |")
    lines.append(f"| job | **iteration** | **{job_it:.2f}** | {med(job_rows, 'response tokens'):.0f} response "
                 "tokens |")
    for k in ("generate", "update"):
        lines.append(f"| plain | {k} | {med(plain_rows, k):.2f} | {med(plain_rows, k) / plain_it:.0%} |")
    lines.append(f"| plain | **iteration** | **{plain_it:.2f}** | {med(plain_rows, 'response tokens'):.0f} response "
                 "tokens |")
    upd = sum(med(job_rows, k) for k in keys if k.startswith("update"))
    lines += ["", f"job / plain: iteration {job_it / plain_it:.2f}x; job update (all its phases) / plain update "
              f"{upd / med(plain_rows, 'update'):.2f}x; job rollout / plain generate "
              f"{med(job_rows, ROLLOUT) / med(plain_rows, 'generate'):.2f}x"]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL,
                   help="checkpoint directory (python -m ppo_objectives.pretrained --gguf smollm2 --out DIR)")
    p.add_argument("--task", default="chat-add1", choices=("chat-add1", "chat-add2"))
    p.add_argument("--iterations", type=int, default=5, help="measured iterations per side (after one warm-up)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = p.parse_args(argv)
    if args.iterations < 1:
        p.error(f"--iterations must be >= 1, got {args.iterations}")
    if not (args.model / "config.json").is_file():
        p.error(f"--model {args.model} is not a checkpoint directory; write it with: python -m "
                f"ppo_objectives.pretrained --gguf smollm2 --out {args.model}")
    job_rows, plain_rows = measure(args)
    print(f"\n## {args.task}: one PPO iteration of the job vs one of the plain loop (seed {args.seed}, "
          f"{len(job_rows)} iterations each, {torch.get_num_threads()} threads)\n")
    print(table(job_rows, plain_rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

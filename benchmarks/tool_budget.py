"""A user's own lookup tool on SmolLM2: the response budget of ``--tool`` before and after its own default.

What it compares, on the same model, prompts, tool, reward and held-out problems, one process each:

- ``budget16``: ``--task jsonl --tool`` with ``--max-new-tokens 16``, the single-turn recipe's budget that a
  ``--tool`` run took before ``--tool`` had defaults of its own;
- ``default``: the same run with the defaults of ``--tool`` (``TOOL_DEFAULTS``: 80 tokens for the whole
  conversation, four minibatches).

The task, written into a temporary directory by this script: the codes of 400 made-up towns (``"Varnel"`` ->
``4817``), which the model cannot know; each prompt holds one worked exchange (a question, the call
``lookup(Arvel)``, the tool's ``lookup result: 2931``, the answer), then the question. The tool answers a
well-formed ``lookup(NAME)`` with the town's code and ends the episode on anything else; the reward is 1 when the
last assistant message holds the right code. 200 towns train, 200 are held out.

Each side runs ``--iterations 1`` with the held-out evaluation before and after it (greedy and sampled at
T = 1), one torch thread; the two sides run at the same time, each pinned to its own core when ``taskset``
exists. A side's row (its ``metrics.csv`` rows and the last samples) is written to
``benchmarks/results/tool_budget/SIDE.json`` as soon as it ends; a re-run skips the rows already there.
The summary prints, per side, the environment turns cut in the iteration (``env_turns_cut``) against the
conversations, the training reward, the held-out accuracy before the update, and the ratios of the two sides.

    python benchmarks/tool_budget.py --model runs/smollm2
    python benchmarks/tool_budget.py --summary
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve()
RESULTS = HERE.parent / "results" / "tool_budget"
SIDES = {"budget16": ["--max-new-tokens", "16"], "default": []}

TOOL = '''import re

CODES = {codes!r}


def lookup(messages, code):
    """The town's code for a well-formed lookup(NAME) in the last assistant turn; None ends the episode."""
    if sum(m["role"] == "assistant" for m in messages) > {shots} + 1:  # one call per question
        return None
    found = re.search(r"lookup\\((\\w+)\\)", messages[-1]["content"])
    return f"lookup result: {{CODES[found[1]]}}" if found and found[1] in CODES else None
'''

REWARD = '''def right_code(completion, code):
    """1 when the final answer holds the town's code."""
    return float(str(code) in completion)
'''


def _towns(n: int, seed: int = 0) -> dict[str, int]:
    """``n`` made-up town names with a 4-digit code each (seeded: the same task on every run)."""
    rng = random.Random(seed)
    syllables = ["var", "nel", "tor", "mi", "sa", "lun", "dre", "ko", "bas", "fen", "ri", "ost", "ma", "quel"]
    towns: dict[str, int] = {}
    while len(towns) < n:
        towns["".join(rng.sample(syllables, 3)).capitalize()] = rng.randint(1000, 9999)
    return towns


def write_task(where: Path) -> dict[str, str]:
    """The prompts, held-out prompts, tool and reward files in ``where``; returns the job's flags for them."""
    towns = _towns(401)
    shot_town, *names = list(towns)
    shot = [{"role": "user", "content": f"What is the code of {shot_town}? Call lookup(NAME) to find it."},
            {"role": "assistant", "content": f"lookup({shot_town})"},
            {"role": "user", "content": f"lookup result: {towns[shot_town]}"},
            {"role": "assistant", "content": f"The code of {shot_town} is {towns[shot_town]}."}]

    def line(name: str) -> str:
        question = {"role": "user", "content": f"What is the code of {name}? Call lookup(NAME) to find it."}
        return json.dumps({"prompt": [*shot, question], "code": towns[name]}) + "\n"

    (where / "train.jsonl").write_text("".join(line(n) for n in names[:200]))
    (where / "eval.jsonl").write_text("".join(line(n) for n in names[200:]))
    (where / "lookup.py").write_text(TOOL.format(codes=towns, shots=2))
    (where / "reward.py").write_text(REWARD)
    return {"--task": "jsonl", "--prompts": str(where / "train.jsonl"), "--eval-prompts": str(where / "eval.jsonl"),
            "--tool": f"{where / 'lookup.py'}:lookup", "--reward": f"{where / 'reward.py'}:right_code"}


def _command(model: Path, side: str, task: dict[str, str], out: Path, core: int | None) -> list[str]:
    pin = ["taskset", "-c", str(core)] if core is not None and shutil.which("taskset") else []
    flags = [x for kv in task.items() for x in kv]
    return [*pin, sys.executable, "-m", "ppo_objectives.train", "--model", str(model), *flags, "--iterations", "1",
            "--eval-every", "1", "--threads", "1", "--out", str(out), "--no-progress", "--no-plot", *SIDES[side]]


def run(model: Path, sides: list[str]) -> None:
    """Run the ``sides`` not yet written, at the same time (one core each), writing each row as it ends."""
    from ppo_objectives.train import read_metrics

    todo = [s for s in sides if not (RESULTS / f"{s}.json").exists()]
    if not todo:
        print("every row is written; --summary prints them")
        return
    RESULTS.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tool_budget_") as tmp:
        task = write_task(Path(tmp))
        procs = {s: subprocess.Popen(_command(model, s, task, Path(tmp) / s, core % 2), stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True) for core, s in enumerate(todo)}
        for side, proc in procs.items():
            stdout, stderr = proc.communicate()
            if proc.returncode:
                sys.exit(f"error: side {side} failed ({proc.returncode}):\n{stderr[-3000:]}")
            rows = read_metrics(Path(tmp) / side / "metrics.csv")
            samples = (Path(tmp) / side / "samples.txt").read_text().split("\n\n")[-2]
            (RESULTS / f"{side}.json").write_text(json.dumps(
                {"side": side, "flags": SIDES[side], "rows": rows, "summary": stdout.strip().splitlines()[-1],
                 "warnings": [x for x in stderr.splitlines() if x.startswith("WARNING ppo")], "samples": samples},
                indent=1))
            print(f"wrote {RESULTS / f'{side}.json'}")


def summary() -> None:
    """Per side: cut turns / conversations, training reward, held-out before the update; the ratios."""
    rows = {s: json.loads((RESULTS / f"{s}.json").read_text()) for s in SIDES if (RESULTS / f"{s}.json").exists()}
    if not rows:
        sys.exit("error: no rows yet in benchmarks/results/tool_budget; run with --model DIR first")
    print("side      env_turns_cut / conversations   reward   held-out greedy   sampled   (before the update)")
    got = {}
    for side, row in rows.items():
        start, it1 = row["rows"][0], row["rows"][1]
        got[side] = dict(cut=it1["env_turns_cut"] / it1["episodes"], reward=it1["reward"],
                         greedy=start["eval_greedy"], sampled=start["eval_sampled"])
        print(f"{side:9s} {it1['env_turns_cut']:4.0f} / {it1['episodes']:3.0f} ({got[side]['cut']:.2f})"
              f"{'':16s}{it1['reward']:.3f}    {start['eval_greedy']:.3f}             {start['eval_sampled']:.3f}")
    if len(got) == 2:
        a, b = got["default"], got["budget16"]
        print("default / budget16: " + ", ".join(
            f"{k} {a[k] / b[k]:.2f}x" if b[k] else f"{k} {a[k]:.3f} vs {b[k]:.3f}" for k in a))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, help="the SmolLM2 directory (python -m ppo_objectives.pretrained --gguf "
                   "smollm2 --out DIR)")
    p.add_argument("--sides", nargs="+", default=list(SIDES), choices=list(SIDES))
    p.add_argument("--summary", action="store_true", help="print the written rows")
    a = p.parse_args(argv)
    if a.summary:
        summary()
        return 0
    if a.model is None or not (a.model / "config.json").is_file():
        p.error(f"--model {a.model}: give the directory of a Hugging Face checkpoint (config.json)")
    run(a.model, a.sides)
    summary()
    return 0


if __name__ == "__main__":
    sys.exit(main())

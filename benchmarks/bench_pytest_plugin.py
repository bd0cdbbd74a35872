"""What the testing kit's pytest plugin costs a pytest session that uses none of its fixtures.

What it compares, in the same run: ``python -m pytest -q`` on a folder holding one trivial test (the plugin is
loaded through its ``pytest11`` entry point) against the same command with ``-p no:ppo_objectives`` (the
plugin switched off). The two commands alternate, ``--runs`` times each after one warm-up of each; printed: the
median wall time and CPU time (user + sys of the child) of each side, and the median of the run-by-run ratios
(plugin / no plugin), with their range.

    python benchmarks/bench_pytest_plugin.py --runs 20
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SIDES = {"plugin": [], "no plugin": ["-p", "no:ppo_objectives"]}


def _run(folder: Path, extra: list[str]) -> tuple[float, float]:
    """Wall and CPU seconds of one pytest process on ``folder``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *extra, str(folder)], check=True,
                   capture_output=True, cwd=folder, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=20, help="runs of each side (after one warm-up each)")
    a = p.parse_args(argv)
    if a.runs < 1:
        p.error(f"--runs {a.runs} must be >= 1")
    with tempfile.TemporaryDirectory(prefix="plugin_cost_") as tmp:
        folder = Path(tmp)
        (folder / "test_trivial.py").write_text("def test_trivial():\n    assert 1 + 1 == 2\n")
        for extra in SIDES.values():  # warm-up: the file system cache
            _run(folder, extra)
        times = {side: [] for side in SIDES}
        for _ in range(a.runs):
            for side, extra in SIDES.items():
                times[side].append(_run(folder, extra))
    print(f"python -m pytest -q on one trivial test, {a.runs} runs a side, alternating (medians):")
    for side, got in times.items():
        print(f"  {side:9s}  wall {statistics.median(w for w, _ in got):.2f} s   "
              f"cpu {statistics.median(c for _, c in got):.2f} s")
    for k, what in ((0, "wall"), (1, "cpu")):
        ratios = [p[k] / n[k] for p, n in zip(times["plugin"], times["no plugin"])]
        print(f"  plugin / no plugin, {what}: median {statistics.median(ratios):.2f}x "
              f"(min {min(ratios):.2f}, max {max(ratios):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

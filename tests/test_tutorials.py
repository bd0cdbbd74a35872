"""Every tutorial runs top to bottom (with a tiny budget) and exits cleanly."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TUTORIALS = sorted((ROOT / "tutorials").glob("[0-9][0-9]_*.py"))


def test_tutorials_exist():
    assert TUTORIALS, "no tutorials found"


@pytest.mark.parametrize("script", TUTORIALS, ids=[p.stem for p in TUTORIALS])
def test_tutorial_runs(script, tmp_path):
    env = dict(os.environ, PPO_TUTORIAL_SMOKE="1", MPLBACKEND="Agg", PYTHONWARNINGS="error::RuntimeWarning")
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"{script.name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert proc.stdout.strip(), f"{script.name} printed nothing"

"""Every tutorial runs top to bottom (with a tiny budget) and exits cleanly.

The tutorials run in one interpreter (``tests/run_tutorials.py``, started once per session for the
tutorials selected), except those that start processes of their own (``OWN_INTERPRETER``), which
run as a script each.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TUTORIALS = sorted((ROOT / "tutorials").glob("[0-9][0-9]_*.py"))
#: Tutorials that spawn ranks or call torchrun: each in its own interpreter, as a user runs it.
OWN_INTERPRETER = {"06_distributed"}
ENV = dict(os.environ, PPO_TUTORIAL_SMOKE="1", MPLBACKEND="Agg", PYTHONWARNINGS="error::RuntimeWarning")


def test_tutorials_exist():
    assert TUTORIALS, "no tutorials found"
    assert OWN_INTERPRETER <= {p.stem for p in TUTORIALS}


@pytest.fixture(scope="session")
def shared_interpreter_runs(request, tmp_path_factory) -> dict:
    """The selected tutorials that share one interpreter, run once: ``{name: {"ok", "stdout", "error"}}``."""
    selected = [item.callspec.params["script"] for item in request.session.items
                if getattr(item, "originalname", "") == "test_tutorial_runs"]
    scripts = [str(s) for s in selected if s.stem not in OWN_INTERPRETER]
    if not scripts:
        return {}
    report = tmp_path_factory.mktemp("tutorials") / "report.json"
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "run_tutorials.py"), str(report), *scripts],
                          env=ENV, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 and report.exists(), f"the tutorial runner failed:\n{proc.stderr[-3000:]}"
    return json.loads(report.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("script", TUTORIALS, ids=[p.stem for p in TUTORIALS])
def test_tutorial_runs(script, tmp_path, shared_interpreter_runs):
    if script.stem in OWN_INTERPRETER:
        proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=ENV, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, f"{script.name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        stdout = proc.stdout
    else:
        result = shared_interpreter_runs[script.stem]
        assert result["ok"], f"{script.name} failed:\n{result['stdout']}\n{result['error']}"
        stdout = result["stdout"]
    assert stdout.strip(), f"{script.name} printed nothing"

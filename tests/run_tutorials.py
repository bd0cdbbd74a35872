"""Run several tutorials in this one interpreter, each as ``__main__`` in a fresh directory, and write a JSON
report ``{name: {"ok": bool, "stdout": tail, "error": traceback}}``.

``tests/test_tutorials.py`` starts it once per session: one interpreter start (torch, torchrl,
transformers imports) instead of one per tutorial.

    python tests/run_tutorials.py REPORT.json tutorials/01_functional_core.py ...
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import runpy
import sys
import tempfile
import traceback
import warnings
from pathlib import Path


def run_one(script: Path) -> dict:
    out = io.StringIO()
    cwd = os.getcwd()
    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(out), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        os.chdir(tmp)
        try:
            runpy.run_path(str(script), run_name="__main__")
            error = ""
        except SystemExit as e:  # a tutorial that exits: 0 / None is a clean end
            error = "" if e.code in (0, None) else f"SystemExit({e.code!r})"
        except BaseException:  # noqa: BLE001 - reported to the test, which fails on it
            error = traceback.format_exc()
        finally:
            os.chdir(cwd)
    with contextlib.suppress(ImportError):
        import matplotlib.pyplot as plt

        plt.close("all")
    return {"ok": not error, "stdout": out.getvalue()[-3000:], "error": error[-3000:]}


def main(argv: list[str]) -> int:
    report, scripts = Path(argv[0]), [Path(a) for a in argv[1:]]
    results = {}
    for script in scripts:
        results[script.stem] = run_one(script)
        print(f"{script.stem}: {'ok' if results[script.stem]['ok'] else 'FAILED'}", file=sys.stderr, flush=True)
    report.write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

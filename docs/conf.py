"""Sphinx configuration: the API reference of ``ppo_objectives``, the design note and the tutorials.

Build: ``python -m sphinx -W --keep-going -b html docs docs/_build/html``.
"""

from __future__ import annotations

import ast
import dataclasses
import re
import sys
import typing
from pathlib import Path

from docutils.parsers.rst import Directive
from docutils.statemachine import StringList
from sphinx.util import inspect as sphinx_inspect

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))

project = "ppo_objectives"
author = "ppo_objectives contributors"
copyright = "ppo_objectives contributors"  # noqa: A001 (Sphinx's name)
release = version = "0.2.0"

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "myst_parser",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]
nitpicky = False  # type hints name torch / tensordict / torchrl objects that have no page here

# The public API only: each page lists its names explicitly (docs/api/*.rst), so autodoc never
# imports a private module such as _kernels.triton_gae (it needs triton and a GPU).
autodoc_default_options = {"member-order": "bysource"}
autodoc_inherit_docstrings = False  # an undocumented override does not pull in torch's / torchrl's docstring
autodoc_typehints = "signature"
autodoc_typehints_format = "short"
autosummary_generate = False
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

myst_heading_anchors = 3

html_theme = "furo"
html_title = "ppo_objectives"

# ppo_objectives.testing is documented when it exists (docs/api/testing.rst).
HAS_TESTING = (ROOT / "ppo_objectives" / "testing").is_dir()
if not HAS_TESTING:
    exclude_patterns.append("api/testing.rst")


class TutorialsDirective(Directive):
    """``.. tutorials::``: one section per ``tutorials/*.py``: its module docstring, then its source."""

    has_content = False

    def run(self):
        lines: list[str] = []
        for path in sorted(p for p in (ROOT / "tutorials").glob("*.py") if not p.name.startswith("_")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            doc = ast.get_docstring(tree) or path.stem
            head, _, body = doc.partition("\n")
            first = tree.body[0] if tree.body else None
            has_doc = isinstance(first, ast.Expr) and isinstance(getattr(first, "value", None), ast.Constant)
            code_from = first.end_lineno + 1 if has_doc else 1
            rel = f"../tutorials/{path.name}"
            title = head.strip().rstrip(".")
            lines += [title, "-" * len(title), "", *body.strip().splitlines(), "",
                      f"Source: :download:`tutorials/{path.name} <{rel}>`.", "",
                      f".. literalinclude:: {rel}", "   :language: python", f"   :lines: {code_from}-",
                      f"   :caption: tutorials/{path.name}", ""]
        self.state_machine.insert_input(StringList(lines, source=str(ROOT / "tutorials")), str(ROOT / "tutorials"))
        return []


# Shapes such as ``[*B, T]`` written bare in the cells of a simple table (MaskedGAE's and
# KLPenaltyTransform's key tables) read as the start of *emphasis* in RST. Escape a bare ``[*``
# in table rows only, taking the added backslash out of the gap after the cell so the columns
# stay aligned; the docstrings stay as they read in the source and in ``help()``.
_BORDER = re.compile(r"^\s*=+(\s+=+)+\s*$")


def _escape_row(line: str, last_column: int) -> str:
    out, pos = [], 0
    for i, part in enumerate(line.split("``")):
        if i % 2 == 0:  # outside inline literals
            start = 0
            while (at := part.find("[*", start)) >= 0:
                gap = part.find("  ", at)
                if pos + at >= last_column:  # the last column has no right edge
                    part = part[: at + 1] + "\\" + part[at + 1 :]
                elif gap >= 0:  # take the added character out of the gap after the cell
                    part = part[: at + 1] + "\\" + part[at + 1 : gap] + part[gap + 1 :]
                else:
                    break  # no slack in this cell: leave it as written
                start = at + 3
        out.append(part)
        pos += len(part) + 2
    return "``".join(out)


def _escape_table_shapes(app, what, name, obj, options, lines):
    last_column = None  # where the last column of the current table starts
    for k, line in enumerate(lines):
        if _BORDER.match(line):
            nxt = lines[k + 1] if k + 1 < len(lines) else ""
            if last_column is None:
                last_column = line.rstrip().rfind(" ") + 1
            elif not nxt.strip():
                last_column = None
        elif last_column is not None and "[*" in line:
            lines[k] = _escape_row(line, last_column)


# TorchRL's base classes (EnvBase, LossModule, ValueEstimatorBase, ...) define ``__new__(cls, *args,
# **kwargs)``, which autodoc reads as the class signature; show the class's own ``__init__`` instead.
# A dataclass's generated ``__init__`` keeps its annotations as strings (``from __future__ import
# annotations``): show the evaluated field types.
def _init_signature(app, what, name, obj, options, signature, return_annotation):
    if what != "class" or not signature:
        return None
    if signature == "(*args, **kwargs)" and "__init__" in vars(obj):
        sig = sphinx_inspect.signature(obj.__init__, bound_method=True, type_aliases=app.config.autodoc_type_aliases)
    elif dataclasses.is_dataclass(obj) and ": '" in signature:
        try:
            hints = typing.get_type_hints(obj)
        except Exception:  # an annotation that does not evaluate: keep autodoc's signature
            return None
        sig = sphinx_inspect.signature(obj.__init__, bound_method=True)
        sig = sig.replace(parameters=[p.replace(annotation=hints.get(p.name, p.annotation)) for p in sig.parameters.values()])
    else:
        return None
    return sphinx_inspect.stringify_signature(sig, show_return_annotation=False, unqualified_typehints=True), None


def _drop_missing_pages(app, docname, source):
    if docname == "api/index" and not HAS_TESTING:
        source[0] = source[0].replace("   testing\n", "")


def setup(app):
    app.add_directive("tutorials", TutorialsDirective)
    app.connect("source-read", _drop_missing_pages)
    app.connect("autodoc-process-docstring", _escape_table_shapes)
    app.connect("autodoc-process-signature", _init_signature)
    return {"parallel_read_safe": True}

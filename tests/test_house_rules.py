"""The package's structural rules, read from its own code and held against ``docs/design.md``.

- Every import of a package module (lazy ones inside functions included) is listed in the design
  note's import table, points down its layer diagram (or across one line of it), and the import
  graph has no cycle.
- No module imports a private name of another module or reads one as an attribute.
- No function is longer than 60 code lines and no class longer than 250 (blank lines, comments and
  docstrings not counted).

Each rule is also run on a small package written here that breaks it, so that none can pass by
reading nothing.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ppo_objectives"
DESIGN = ROOT / "docs" / "design.md"
MAX_FUNCTION_LINES, MAX_CLASS_LINES = 60, 250


# ----------------------------------------------------------------------------- reading the design note


def import_table(text: str) -> dict[str, set[str]]:
    """``module -> the package modules it may import``, from the table under "What each module may import"."""
    section = text.split("### What each module may import", 1)[1].split("\n## ", 1)[0]
    allowed: dict[str, set[str]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) < 2 or set(cells[0]) <= set("- ") or cells[0] == "module":
            continue
        targets = set(re.findall(r"`([\w.]+)`", cells[1]))
        if not targets and cells[1] != "nothing":
            raise AssertionError(f"design.md import table: {cells[1]!r} lists no module; write `name`s or nothing")
        for module in re.findall(r"`([\w.]+)`", cells[0]):
            allowed[module] = targets
    return allowed


def layer_ranks(text: str) -> dict[str, int]:
    """``module -> its line in the Layers diagram`` (0 at the top), from the first column of each line."""
    block = text.split("## Layers", 1)[1].split("```", 2)[1]
    ranks: dict[str, int] = {}
    for rank, line in enumerate(block.splitlines()):
        first_column = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0]
        for path in re.findall(r"(?<![\w*/])([\w/]+)\.py\b", first_column):
            parts = path.split("/")
            module = ".".join(parts[:-1]) or "__init__" if parts[-1] == "__init__" else ".".join(parts)
            ranks.setdefault(module, rank)
    return ranks


# ----------------------------------------------------------------------------- reading the package


def module_files(package: Path) -> dict[str, Path]:
    """``module -> file``; a module is its dotted path inside the package (``value.gae``), a subpackage's
    ``__init__.py`` is the subpackage (``value``), and the package's own is ``__init__``."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package).with_suffix("").parts
        found[".".join(parts[:-1]) or "__init__" if parts[-1] == "__init__" else ".".join(parts)] = path
    return found


def _targets(node: ast.AST, name: str, modules: set[str]) -> list[str]:
    """The package modules one AST node imports (or names, as a dotted string)."""
    if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == name:
        base = ".".join(node.module.split(".")[1:])
        # ``from pkg.sub import name``: the module ``sub.name`` when there is one, else ``sub`` (the package
        # face, ``__init__``, for ``from pkg import name``)
        return [f"{base}.{a.name}".strip(".") if f"{base}.{a.name}".strip(".") in modules else base or "__init__"
                for a in node.names]
    if isinstance(node, ast.Import):
        return [a.name.split(".", 1)[1] for a in node.names if a.name.startswith(f"{name}.")]
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        # a dotted module path held as a string (importlib.import_module, a table of lazy homes)
        match = re.fullmatch(rf"{name}\.([\w.]+)", node.value)
        return [match[1]] if match and match[1] in modules else []
    return []


def package_imports(package: Path) -> dict[str, dict[str, int]]:
    """``module -> {imported package module: first line}``: every ``import`` statement at any depth, and
    every string that is exactly a package module's dotted path."""
    files = module_files(package)
    graph: dict[str, dict[str, int]] = {}
    for module, path in files.items():
        arrows: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            for target in _targets(node, package.name, set(files)):
                if target != module:
                    arrows.setdefault(target, node.lineno)
        graph[module] = arrows
    return graph


def private_name_uses(package: Path) -> list[str]:
    """``from pkg.mod import _name`` and ``mod._name`` of another package module, as ``file:line text``."""
    files = module_files(package)
    found = []
    for module, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        where = path.relative_to(package).as_posix()
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == package.name:
                base = ".".join(node.module.split(".")[1:])
                for a in node.names:
                    sub = f"{base}.{a.name}".strip(".")
                    if sub in files:
                        aliases[a.asname or a.name] = sub
                    elif _private(a.name) and (base or "__init__") != module:
                        found.append(f"{where}:{node.lineno} from {node.module} import {a.name}")
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and aliases[node.value.id] != module and _private(node.attr)):
                found.append(f"{where}:{node.lineno} {node.value.id}.{node.attr}")
    return found


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def oversized(package: Path) -> list[str]:
    """Functions over ``MAX_FUNCTION_LINES`` and classes over ``MAX_CLASS_LINES`` code lines."""
    found = []
    for path in module_files(package).values():
        text = path.read_text(encoding="utf-8")
        lines, tree = text.splitlines(), ast.parse(text)
        docstrings = {i for node in ast.walk(tree) for i in _docstring_lines(node)}
        for node in ast.walk(tree):
            limit = {ast.ClassDef: MAX_CLASS_LINES, ast.FunctionDef: MAX_FUNCTION_LINES,
                     ast.AsyncFunctionDef: MAX_FUNCTION_LINES}.get(type(node))
            if limit is None:
                continue
            count = sum(1 for i in range(node.lineno, node.end_lineno + 1)
                        if i not in docstrings and lines[i - 1].strip() and not lines[i - 1].strip().startswith("#"))
            if count > limit:
                found.append(f"{path.relative_to(package).as_posix()}:{node.lineno} {node.name}: {count} code lines "
                             f"(limit {limit})")
    return found


def _docstring_lines(node: ast.AST) -> range:
    body = getattr(node, "body", None)
    if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
            and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)):
        return range(body[0].lineno, body[0].end_lineno + 1)
    return range(0)


def import_violations(graph: dict[str, dict[str, int]], allowed: dict[str, set[str]], ranks: dict[str, int]) -> list[str]:
    """Unlisted modules, unlisted arrows and arrows that run up the diagram."""
    found = [f"{m}.py is not in design.md's import table" for m in sorted(graph) if m not in allowed]
    found += [f"{m}.py is not in design.md's layer diagram" for m in sorted(graph) if m not in ranks]
    for source, arrows in sorted(graph.items()):
        for target, line in sorted(arrows.items()):
            if target not in allowed.get(source, set()):
                found.append(f"{source}.py:{line} imports {target}: not in its row of design.md's import table")
            elif source in ranks and target in ranks and ranks[target] < ranks[source]:
                found.append(f"{source}.py:{line} imports {target}, which design.md's diagram draws above it")
    return found


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Every cycle found by a depth-first walk, each as the path that closes it."""
    found, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for target in graph.get(node, {}):
            if state.get(target) == "open":
                found.append(path[path.index(target):] + [target] if target in path else [node, target])
            elif target not in state:
                visit(target, path + [target])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


# ----------------------------------------------------------------------------- the rules on this package


DESIGN_TEXT = DESIGN.read_text(encoding="utf-8")


def test_every_import_is_listed_and_points_down():
    graph = package_imports(PACKAGE)
    assert len(graph) > 20 and sum(len(a) for a in graph.values()) > 50  # it read the package
    assert import_violations(graph, import_table(DESIGN_TEXT), layer_ranks(DESIGN_TEXT)) == []


def test_the_import_graph_has_no_cycle():
    assert cycles(package_imports(PACKAGE)) == []


def test_no_private_name_crosses_a_module():
    assert private_name_uses(PACKAGE) == []


def test_functions_and_classes_keep_their_size_limits():
    assert oversized(PACKAGE) == []


def test_the_design_note_lists_only_modules_that_exist():
    modules = set(module_files(PACKAGE))
    table, ranks = import_table(DESIGN_TEXT), layer_ranks(DESIGN_TEXT)
    assert set(table) - modules == set() and set(ranks) - modules == set()
    assert {t for targets in table.values() for t in targets} - modules == set()


# ----------------------------------------------------------------------------- each rule can fail

BAD_DESIGN = """## Layers

```
top.py        the top
low.py        below it
```

### What each module may import

| module | may import from the package | why |
| --- | --- | --- |
| `top` | `low` | |
| `low` | nothing | |

## Next
"""


def _bad_package(tmp_path: Path, files: dict[str, str]) -> Path:
    package = tmp_path / "pkg"
    package.mkdir()
    for name, text in files.items():
        (package / name).write_text(text)
    return package


def test_an_upward_lazy_import_and_its_cycle_are_caught(tmp_path):
    package = _bad_package(tmp_path, {"top.py": "from pkg.low import f\n",
                                      "low.py": "def f():\n    from pkg import top\n    return top\n"})
    graph = package_imports(package)
    assert graph == {"low": {"top": 2}, "top": {"low": 1}}
    assert import_violations(graph, import_table(BAD_DESIGN), layer_ranks(BAD_DESIGN)) == [
        "low.py:2 imports top: not in its row of design.md's import table"]
    assert cycles(graph) == [["low", "top", "low"]]


def test_an_import_through_the_package_face_is_an_arrow_to_it(tmp_path):
    package = _bad_package(tmp_path, {"__init__.py": "from pkg.top import g\n", "top.py": "def g(): ...\n",
                                      "low.py": "from pkg import g\n"})
    assert package_imports(package) == {"__init__": {"top": 1}, "low": {"__init__": 1}, "top": {}}


def test_an_import_module_string_and_an_unlisted_module_are_caught(tmp_path):
    package = _bad_package(tmp_path, {"top.py": "", "low.py": "import importlib\nimportlib.import_module('pkg.top')\n",
                                      "side.py": ""})
    found = import_violations(package_imports(package), import_table(BAD_DESIGN), layer_ranks(BAD_DESIGN))
    assert found == ["side.py is not in design.md's import table", "side.py is not in design.md's layer diagram",
                     "low.py:2 imports top: not in its row of design.md's import table"]


def test_an_arrow_up_the_diagram_is_caught_even_when_listed():
    design = BAD_DESIGN.replace("| `low` | nothing |", "| `low` | `top` |")
    graph = {"top": {}, "low": {"top": 3}}
    assert import_violations(graph, import_table(design), layer_ranks(design)) == [
        "low.py:3 imports top, which design.md's diagram draws above it"]


def test_private_names_across_modules_are_caught(tmp_path):
    package = _bad_package(tmp_path, {"top.py": "from pkg.low import _hidden\nfrom pkg import low\nlow._other()\n",
                                      "low.py": "def _hidden(): ...\ndef _other(): ...\n_hidden()\n"})
    assert private_name_uses(package) == ["top.py:1 from pkg.low import _hidden", "top.py:3 low._other"]


def test_oversized_functions_and_classes_are_caught(tmp_path):
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))  # + the def line: one over
    doc = '    """' + "\n" * 100 + '    """\n'  # a docstring and comments do not count
    package = _bad_package(tmp_path, {"low.py": f"def long():\n{doc}{body}    # a comment\n\n"
                                                f"def fits():\n{doc}{body[:-len(body.splitlines(True)[-1])]}"})
    assert oversized(package) == [f"low.py:1 long: {MAX_FUNCTION_LINES + 1} code lines (limit {MAX_FUNCTION_LINES})"]


def test_a_table_row_without_modules_is_refused():
    with pytest.raises(AssertionError, match="lists no module; write `name`s or nothing"):
        import_table(BAD_DESIGN.replace("| `low` | nothing |", "| `low` | the layers below |"))


def test_modules_of_subpackages_are_named_by_their_dotted_path(tmp_path):
    package = _bad_package(tmp_path, {"__init__.py": "", "low.py": ""})
    (package / "sub").mkdir()
    (package / "sub" / "__init__.py").write_text("from pkg.sub.inner import f\n")
    (package / "sub" / "inner.py").write_text("from pkg import low\nfrom pkg.sub import other\nother._x()\n")
    (package / "sub" / "other.py").write_text("def _x(): ...\n")
    assert package_imports(package) == {"__init__": {}, "low": {}, "sub": {"sub.inner": 1},
                                        "sub.inner": {"low": 1, "sub.other": 2}, "sub.other": {}}
    assert private_name_uses(package) == ["sub/inner.py:3 other._x"]
    design = BAD_DESIGN.replace("top.py        the top", "sub/inner.py        the top")
    assert layer_ranks(design)["sub.inner"] < layer_ranks(design)["low"]

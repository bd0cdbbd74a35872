"""The package's structural rules.

- The import contracts of ``pyproject.toml`` (``[tool.importlinter]``: the layers, the testing kit that
  imports nothing else of the package, no import cycle) are kept: ``lint-imports`` passes. The same
  contracts, run on a skeleton package with one bad import, are broken, so they cannot pass by checking
  nothing.
- No module imports a private (``_``-prefixed) name of another module or reads one as an attribute.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from importlinter.api import read_configuration  # import-linter, in the test extra

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ppo_objectives"
CONFIG = read_configuration(str(ROOT / "pyproject.toml"))


def lint_imports(cwd: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` on the ``pyproject.toml`` of ``cwd`` (no cache written there)."""
    return subprocess.run([sys.executable, "-c", "from importlinter.cli import lint_imports_command as c; c()",
                           "--no-cache"], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_the_package_keeps_its_import_contracts():
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"Contracts: {len(CONFIG['contracts_options'])} kept, 0 broken." in result.stdout


# ----------------------------------------------------------------------------- the contracts can fail

# A skeleton of the package, named ``pkg``: one (empty) package per module the contracts name, with imports
# down the layers like the real ones, and the face importing the card.
SKELETON = {
    "__init__.py": "from pkg import functional, loss, transforms, value\n",
    "pretrained/__init__.py": "from pkg import train\n",
    "train/__init__.py": "from pkg import llm, loss, transforms, value\n",
    "llm/__init__.py": "from pkg import _td, functional\n",
    "loss/__init__.py": "from pkg import _kernels, functional, value\n",
    "value/__init__.py": "from pkg import _td, functional\n",
    "functional/__init__.py": "from pkg import _kernels, _validate\n",
    "_td/__init__.py": "from pkg import _validate\n",
    "_kernels/__init__.py": "from pkg import _validate\n",
}


def _skeleton(tmp_path: Path, extra: dict[str, str]) -> Path:
    """The skeleton in ``tmp_path``, with ``extra`` appended to its files, under this package's contracts."""
    modules = set(re.findall(r"ppo_objectives\.([\w.]+)", json.dumps(CONFIG["contracts_options"])))
    files = {f"{m.replace('.', '/')}/__init__.py": "" for m in modules} | {"__init__.py": ""}
    for name in {*SKELETON, *extra}:
        files[name] = SKELETON.get(name, "") + extra.get(name, "")
    for name, text in files.items():
        (tmp_path / "pkg" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "pkg" / name).write_text(text)
    toml = [("[tool.importlinter]", CONFIG["session_options"])]
    toml += [("\n[[tool.importlinter.contracts]]", contract) for contract in CONFIG["contracts_options"]]
    toml = [line for header, options in toml for line in [header] + [
        f"{key} = {json.dumps(value).replace('ppo_objectives', 'pkg')}" for key, value in options.items()]]
    (tmp_path / "pyproject.toml").write_text("\n".join(toml) + "\n")
    return tmp_path


def test_the_skeleton_keeps_the_contracts(tmp_path):
    result = lint_imports(_skeleton(tmp_path, {}))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("extra, broken, shown", [
    pytest.param({"value/__init__.py": "def f():\n    from pkg.llm import g\n"}, "layers",
                 "pkg.value -> pkg.llm (l.3)", id="a lazy import up the layers"),
    pytest.param({"value/__init__.py": "import pkg\n"}, "layers", "- pkg.value -> pkg (l.2)\n  pkg -> pkg.loss (l.1)",
                 id="up through the face"),
    pytest.param({"loss/__init__.py": "from pkg import transforms\n"}, "layers", "pkg.loss -> pkg.transforms",
                 id="between independent siblings"),
    pytest.param({"testing/__init__.py": "from pkg import functional\n"}, "testing-kit",
                 "pkg.testing -> pkg.functional", id="the testing kit imports the package"),
    pytest.param({"train/a.py": "from pkg.train import b\n", "train/b.py": "from pkg.train import a\n"},
                 "acyclic", "No cycles are allowed in pkg.train.", id="a cycle inside a layer"),
])
def test_a_bad_import_breaks_its_contract(tmp_path, extra, broken, shown):
    result = lint_imports(_skeleton(tmp_path, extra))
    assert result.returncode == 1, result.stdout + result.stderr
    names = {c["id"]: c["name"] for c in CONFIG["contracts_options"]}
    assert re.search(rf"{re.escape(names[broken])}\s+BROKEN", " ".join(result.stdout.split())), result.stdout
    assert f"Contracts: {len(names) - 1} kept, 1 broken." in result.stdout
    assert shown in result.stdout


# ----------------------------------------------------------------------------- private names


def _module_name(path: Path, package: Path) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(dotted: str, package: Path) -> bool:
    path = package.parent.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_name_uses(package: Path) -> list[str]:
    """``from pkg.mod import _name`` and ``mod._name`` of another package module, as ``file:line text``."""
    found = []
    for path in sorted(package.rglob("*.py")):
        tree, here = ast.parse(path.read_text(encoding="utf-8")), _module_name(path, package)
        where, aliases = path.relative_to(package).as_posix(), {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == package.name:
                for a in node.names:
                    if _is_module(f"{node.module}.{a.name}", package):
                        aliases[a.asname or a.name] = f"{node.module}.{a.name}"
                    elif _private(a.name) and node.module != here:
                        found.append(f"{where}:{node.lineno} from {node.module} import {a.name}")
        found += [f"{where}:{node.lineno} {node.value.id}.{node.attr}" for node in ast.walk(tree)
                  if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                  and aliases.get(node.value.id, here) != here and _private(node.attr)]
    return found


def test_no_private_name_crosses_a_module():
    assert private_name_uses(PACKAGE) == []


def test_private_names_across_modules_are_caught(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "low.py").write_text("def _hidden(): ...\ndef _other(): ...\n_hidden()\n")
    (package / "top.py").write_text("from pkg.low import _hidden\nfrom pkg import low\nlow._other()\n")
    (package / "sub" / "__init__.py").write_text("from pkg.sub.inner import _own\n")
    (package / "sub" / "inner.py").write_text("def _own(): ...\nfrom pkg.sub import inner\ninner._own()\n")
    assert private_name_uses(package) == ["sub/__init__.py:1 from pkg.sub.inner import _own",
                                          "top.py:1 from pkg.low import _hidden", "top.py:3 low._other"]

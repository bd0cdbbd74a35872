"""The API reference covers the public API: every name of every public module's ``__all__`` has an
entry in ``docs/api/*.rst`` (read as text; no Sphinx build here, CI builds the site with
``python -m sphinx -W --keep-going -b html docs docs/_build/html``)."""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

import pytest

import ppo_objectives

API = Path(__file__).resolve().parents[1] / "docs" / "api"

# Public modules without a page of their own, and the page that holds their automodule instead: the
# job's and the kit's inner modules (their names are documented on the subpackage's page).
INNER = {"train": ("config", "config_file", "launch", "build", "rollout", "update", "loop", "cli", "distributed", "checkpoints",
                   "loggers", "text_job"),
         "testing": ("batches", "references", "networks", "asserts")}
DOCUMENTED_ELSEWHERE = {f"{pkg}.{m}": pkg for pkg, ms in INNER.items() for m in ms}

_DIRECTIVE = re.compile(r"^\.\. (auto\w+|data|currentmodule|autosummary)::(.*)$")


def _public_modules() -> list[str]:
    """Every module of the package, as its dotted path inside it (``llm.env``), but the private ones."""
    names = [m.name.split(".", 1)[1] for m in pkgutil.walk_packages(ppo_objectives.__path__, "ppo_objectives.")]
    return sorted(n for n in names if not any(part.startswith("_") for part in n.split(".")))


def _read_page(path: Path) -> tuple[dict[str, str], dict[str, str]]:
    """(full name -> directive) of the objects a page documents, (full name -> shown name) of its summaries."""
    documented: dict[str, str] = {}
    summarised: dict[str, str] = {}
    current = None
    lines = path.read_text(encoding="utf-8").splitlines()
    for k, line in enumerate(lines):
        m = _DIRECTIVE.match(line)
        if not m:
            continue
        directive, arg = m.group(1), m.group(2).strip()
        if directive == "currentmodule":
            current = None if arg == "None" else arg
        elif directive == "automodule":
            current = arg
            documented[arg] = directive
        elif directive == "autosummary":
            for item in lines[k + 1 :]:
                if item and not item.startswith("   "):
                    break
                item = item.strip()
                if not item or item.startswith(":"):
                    continue
                shown = item.lstrip("~")
                full = shown if current is None or shown.startswith("ppo_objectives.") else f"{current}.{shown}"
                summarised[full] = shown.rsplit(".", 1)[-1]
        else:
            full = arg if "." in arg or current is None else f"{current}.{arg}"
            assert full not in documented, f"{path.name}: {full} is documented twice"
            documented[full] = directive
    return documented, summarised


def _resolve(full: str):
    module, _, name = full.rpartition(".")
    return getattr(importlib.import_module(module), name)


@pytest.fixture(scope="module")
def pages():
    return {p.relative_to(API).with_suffix("").as_posix().replace("/", "."): _read_page(p)
            for p in sorted(API.rglob("*.rst"))}


@pytest.fixture(scope="module")
def documented_everywhere(pages):
    everywhere: dict[str, str] = {}
    for page, (documented, _) in pages.items():
        for full in documented:
            assert full not in everywhere, f"{full} is documented on {everywhere[full]} and {page}: use a summary"
            everywhere[full] = page
    return everywhere


def test_every_public_module_has_a_page(pages):
    toctree = (API / "index.rst").read_text(encoding="utf-8")
    for name in _public_modules():
        page = DOCUMENTED_ELSEWHERE.get(name, name)
        assert page in pages, f"ppo_objectives.{name} has no page docs/api/{page.replace('.', '/')}.rst"
        assert f"ppo_objectives.{name}" in pages[page][0], f"docs/api/{page}.rst has no automodule for {name}"
        entry = page.replace(".", "/")
        assert re.search(rf"^   {entry}$", toctree, re.M), f"docs/api/index.rst does not list {entry}"
    assert "ppo_objectives" in pages["ppo_objectives"][0]
    assert "ppo_objectives_pytest" in pages["testing"][0]  # the kit's pytest plugin, beside the package


@pytest.mark.parametrize("module", ["", *_public_modules()])
def test_every_name_in_all_is_documented(module, pages, documented_everywhere):
    full_module = f"ppo_objectives.{module}" if module else "ppo_objectives"
    mod = importlib.import_module(full_module)
    names = getattr(mod, "__all__", None)
    if names is None:  # an inner module of the job or the kit: its names are documented on its package's page
        assert module in DOCUMENTED_ELSEWHERE
        return
    page = DOCUMENTED_ELSEWHERE.get(module, module) or "ppo_objectives"
    documented, summarised = pages[page]
    for name in names:
        obj = getattr(mod, name)
        here = f"{full_module}.{name}"
        if here in documented:
            continue
        # a re-export: summarised on this page under its own name, documented once in its home module
        homes = [full for full, shown in summarised.items() if shown == name]
        assert homes, f"{here} is neither documented nor summarised on docs/api/{page}.rst"
        (home,) = homes
        assert _resolve(home) is obj, f"docs/api/{page}.rst: {home} is not {here}"
        assert home in documented_everywhere, f"{home} (re-exported as {here}) is documented on no page"


def test_no_private_module_is_documented(documented_everywhere, pages):
    names = list(documented_everywhere)
    names += [full for _, summarised in pages.values() for full in summarised]
    private = [n for n in names if any(part.startswith("_") for part in n.split(".")[1:-1])]
    assert not private, private


def test_every_documented_name_exists(documented_everywhere):
    for full, page in documented_everywhere.items():
        if "." not in full or full.split(".", 1)[1] in _public_modules():  # the package, the pytest plugin beside it
            importlib.import_module(full)
        else:
            _resolve(full)  # raises on a stale entry

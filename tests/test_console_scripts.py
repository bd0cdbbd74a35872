"""The console scripts the installed package declares: each resolves to a callable, and ``ppo-export --help`` runs."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
from pathlib import Path

import ppo_objectives
from ppo_objectives.pretrained import main as export_main
from ppo_objectives.train.cli import main as train_main

SCRIPTS = {"ppo-train": train_main, "ppo-export": export_main}


def _declared() -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group="console_scripts")
            if ep.value.split(":")[0].split(".")[0] == "ppo_objectives"}


def test_the_installed_version_is_the_package_version():
    assert importlib.metadata.version("ppo_objectives") == ppo_objectives.__version__


def test_the_declared_console_scripts_resolve_to_their_mains():
    declared = _declared()
    assert sorted(declared) == sorted(SCRIPTS)
    for name, main in SCRIPTS.items():
        obj = declared[name].load()
        assert callable(obj) and obj is main, name


def test_ppo_export_help_runs():
    exe = shutil.which("ppo-export", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    assert exe, "ppo-export is not installed: pip install -e ."
    out = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "--gguf" in out.stdout and "--out" in out.stdout


def test_python_m_pretrained_is_the_export_command():
    out = subprocess.run([sys.executable, "-m", "ppo_objectives.pretrained", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: python -m ppo_objectives.pretrained")

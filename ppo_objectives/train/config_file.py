"""``--config FILE``: a recipe kept in a file, turned into the command line's own flags.

Two kinds of file are read:

* **TOML** (``FILE.toml``): its keys are the flags' names without ``--`` (``lr = 3e-5``,
  ``max-new-tokens = 80``; ``max_new_tokens`` is the same key), its values their values
  (``no-plot = true`` for a switch);
* **a run's own** ``run_config.json`` (written beside every checkpoint): the configuration
  that run trained with, every recipe default filled in, so that the run can be repeated
  (``--config runs/a/run_config.json --out runs/b``). How that process was launched
  (``resume``, ``overwrite``, ``allow_change``) is not repeated.

:func:`config_flags` returns the flags the file sets, to put before the command line's: argparse
keeps the last value of a flag, so a flag on the command line wins. A switch set in the file
(``no-plot = true``) stays on; a switch that defaults to on (``chat-template``, the recipe's
``shared-trunk``) is turned off by ``false``. An unknown key, a value of the wrong type, a table
or an array is an error naming the file, the key and the fix, and so is a file that does not parse.

Example:
    >>> import pathlib, tempfile
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "recipe.toml"
    >>> _ = path.write_text('task = "copy"\\nlr = 1e-4\\nmax_grad_norm = 0.5\\nno-plot = true\\n')
    >>> config_flags(str(path))
    ['--task', 'copy', '--lr', '0.0001', '--max-grad-norm', '0.5', '--no-plot']
"""

from __future__ import annotations

import difflib
import json
from dataclasses import MISSING, fields
from pathlib import Path

from ppo_objectives.train.config import TrainConfig

#: The keys of a ``run_config.json`` that describe how that process was launched, not the recipe: not repeated.
NOT_REPEATED = ("resume", "overwrite", "allow_change", "input_sha256")

_TYPES = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,)}


def config_flags(path: str) -> list[str]:
    """The command-line flags that the config file ``path`` sets (see the module docstring)."""
    values = _read(Path(path))
    by_name = {f.name: f for f in fields(TrainConfig)}
    flags: list[str] = []
    for key, value in values.items():
        name = key.replace("-", "_")
        if name not in by_name:
            near = difflib.get_close_matches(name, by_name, n=1)
            hint = f" (did you mean {near[0].replace('_', '-')}?)" if near else ""
            raise ValueError(f"--config {path}: unknown key {key!r}{hint}; the keys are the flags of python -m "
                             f"ppo_objectives.train without '--' (e.g. max-new-tokens = 80)")
        if value is not None:  # a run's unset option (None): left unset
            flags += _flag(path, key, value, by_name[name])
    return flags


def _read(path: Path) -> dict:
    """The key -> value table of a TOML file or of a run's ``run_config.json`` (its configuration)."""
    if not path.is_file():
        raise FileNotFoundError(f"--config {path}: no such file; give a TOML file of flags (lr = 3e-5) or a run's "
                                f"run_config.json")
    if path.suffix == ".json":
        try:
            saved = json.loads(path.read_text())
        except ValueError as err:
            raise ValueError(f"--config {path}: not valid JSON ({err}); give a run's run_config.json or a TOML "
                             f"file") from None
        if not isinstance(saved, dict) or not isinstance(saved.get("config"), dict):
            raise ValueError(f"--config {path}: not a run's run_config.json (no \"config\" object); give the "
                             f"run_config.json of a run's --out, or a TOML file of flags")
        return {k: v for k, v in saved["config"].items() if k not in NOT_REPEATED}
    try:
        import tomllib
    except ImportError:  # Python 3.10
        raise ImportError(f"--config {path}: reading TOML needs Python >= 3.11 (tomllib)") from None
    try:
        return tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"--config {path}: not valid TOML ({err})") from None


def _flag(path: str, key: str, value, field) -> list[str]:
    """The flags that set ``field`` to ``value``, checked against the field's type."""
    kind = field.type if isinstance(field.type, str) else field.type.__name__
    kind = {"int": "int", "float": "float", "bool": "bool"}.get(kind, "str")
    if isinstance(value, bool) != (kind == "bool") or not isinstance(value, _TYPES[kind]):
        raise ValueError(f"--config {path}: {key} = {value!r} must be {'a' if kind != 'int' else 'an'} {kind} "
                         f"(--{field.name.replace('_', '-')} takes one)")
    flag = "--" + field.name.replace("_", "-")
    if kind != "bool":
        return [flag, str(value)]
    switch_on_by_default = field.default is not MISSING and field.default is not False
    if value:
        return [flag]
    return [f"--no-{flag[2:]}"] if switch_on_by_default else []

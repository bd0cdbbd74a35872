"""The import paths a user already wrote keep working, and the package face holds only the card.

- Every earlier module path (``docs/design.md``, "Earlier import paths") re-exports the same objects as
  the module they moved to, and nothing else.
- ``from ppo_objectives import TokenLMEnv`` (and the other names the face held before) still works, with a
  ``DeprecationWarning`` that names the new home.
- The face's ``__all__`` is the objectives and the functional core.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

import ppo_objectives
from ppo_objectives import functional

DESIGN = (Path(__file__).resolve().parents[1] / "docs" / "design.md").read_text(encoding="utf-8")
EARLIER = ("envs", "models", "policy", "readouts", "layouts", "llm_interop", "pretrained", "text_tasks", "monitor",
           "critic_free")


@pytest.mark.parametrize("name", EARLIER)
def test_an_earlier_path_re_exports_the_objects_of_their_home(name):
    module = importlib.import_module(f"ppo_objectives.{name}")
    assert f"`ppo_objectives.{name}`" in DESIGN or f"`.{name}`" in DESIGN  # listed in the design note
    tree = ast.parse(Path(module.__file__).read_text(encoding="utf-8"))
    imported = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            assert node.module.split(".")[1] in ("llm", "train", "value"), f"{name} imports from {node.module}"
            imported.update({a.name: node.module for a in node.names})
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):  # models.py: an error for the names built on them
            assert (name, node.name) == ("models", "__getattr__"), f"ppo_objectives.{name} defines {node.name}"
    assert sorted(imported) == sorted(module.__all__)
    for attr, home in imported.items():
        assert getattr(module, attr) is getattr(importlib.import_module(home), attr), f"{name}.{attr}"


@pytest.mark.parametrize("name, home", sorted(ppo_objectives.MOVED.items()))
def test_an_earlier_face_name_warns_and_names_its_home(name, home):
    with pytest.warns(DeprecationWarning, match=rf"ppo_objectives\.{name} moved: use from {re.escape(home)} import {name}"):
        obj = getattr(ppo_objectives, name)
    assert obj is getattr(importlib.import_module(home), name)
    assert name not in ppo_objectives.__all__


def test_an_unknown_face_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="module 'ppo_objectives' has no attribute 'no_such_name'"):
        ppo_objectives.no_such_name  # noqa: B018


def test_the_face_holds_the_objectives_and_the_functional_core():
    objectives = {"MaskedGAE", "GroupAdvantage", "ReinforcePlusPlus", "TokenPPOLoss", "MINIMIND_PPO_DEFAULTS",
                  "KLPenaltyTransform", "FixedKLController", "AdaptiveKLController"}
    others = set(ppo_objectives.__all__) - objectives
    assert others and others <= set(functional.__all__)
    for name in others:
        assert getattr(ppo_objectives, name) is getattr(functional, name)


def test_python_m_on_an_earlier_path_runs_the_same_main():
    from ppo_objectives import pretrained
    from ppo_objectives.train import pretrained as home

    assert pretrained.main is home.main
    assert 'if __name__ == "__main__":' in Path(pretrained.__file__).read_text(encoding="utf-8")

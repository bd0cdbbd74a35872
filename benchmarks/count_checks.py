"""How many times one public call runs the package's input checks.

Counts every call of a ``_validate`` check and of ``_td.require`` while one call of each
component runs on the testing kit's batches (response layout, 6 rows of 7 tokens):
``TokenPPOLoss.forward`` (with its default ``MaskedGAE`` computing the advantages, and without:
advantages present), ``MaskedGAE`` alone and ``KLPenaltyTransform`` (reference log-probs present).
A count above one for a check of the same argument is a check repeated on the way down.

    python benchmarks/count_checks.py
"""

from __future__ import annotations

import collections
import contextlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout

from ppo_objectives import _td
from ppo_objectives import _validate
from ppo_objectives import testing
from ppo_objectives.loss import TokenPPOLoss  # noqa: E402
from ppo_objectives.transforms import KLPenaltyTransform  # noqa: E402
from ppo_objectives.value.gae import MaskedGAE

#: The checks counted: every public function of ``_validate`` that checks something, and ``_td.require``.
CHECKS = [(_validate, name) for name in dir(_validate)
          if name.startswith("check_") or name == "is_real"] + [(_td, "require")]


@contextlib.contextmanager
def counting():
    """Yield a ``Counter`` of check name -> calls while the block runs."""
    counts: collections.Counter = collections.Counter()
    saved = [(module, name, getattr(module, name)) for module, name in CHECKS]

    def wrap(name, fn):
        def counted(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return counted

    for module, name, fn in saved:
        setattr(module, name, wrap(name, fn))
    try:
        yield counts
    finally:
        for module, name, fn in saved:
            setattr(module, name, fn)


def calls() -> dict:
    """The public calls measured, each a zero-argument function on fresh inputs."""
    actor, critic = testing.tiny_actor_critic(seed=0)

    def batch(**kw):
        return testing.response_batch(batch_size=6, response_len=7, mask="mixed", seed=0, **kw)

    loss = TokenPPOLoss(actor, critic, kl_to_ref_coeff=0.1)
    return {
        "TokenPPOLoss.forward (advantages present)": lambda: loss(batch(with_advantage=True)),
        "TokenPPOLoss.forward (runs its MaskedGAE)": lambda: loss(batch()),
        "MaskedGAE": lambda: MaskedGAE(gamma=1.0, lmbda=0.95)(batch()),
        "KLPenaltyTransform": lambda: KLPenaltyTransform(coeff=0.05)(batch()),
    }


def main() -> int:
    print("| call | checks per call | by check |")
    print("|---|---|---|")
    for name, call in calls().items():
        call()  # first-call work (lazy estimators) out of the count
        with counting() as counts:
            call()
        by_check = ", ".join(f"{k} {v}" for k, v in counts.most_common())
        print(f"| {name} | {sum(counts.values())} | {by_check} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

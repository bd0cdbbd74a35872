"""The collapse guard and the metrics plot: an earlier import path, kept as a plain re-export of ``ppo_objectives.train.monitor``.

New code imports from there; ``docs/design.md`` lists the re-exports.
"""

from ppo_objectives.train.monitor import FLAGS, CollapseGuard, plot_metrics

__all__ = ["CollapseGuard", "FLAGS", "plot_metrics"]  # fmt: skip

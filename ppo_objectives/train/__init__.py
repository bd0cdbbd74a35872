"""Token-level PPO with a critic, end to end on TorchRL: ``python -m ppo_objectives.train``.

One iteration is MiniMind's PPO stage on TorchRL components: a collector drives
:class:`~ppo_objectives.llm.env.TokenLMEnv` with the actor, the critic writes ``V_old``,
:class:`~ppo_objectives.transforms.KLPenaltyTransform` puts the reference KL in the reward,
:class:`~ppo_objectives.value.gae.MaskedGAE` computes the advantages and
:class:`~ppo_objectives.loss.TokenPPOLoss` is minimised over epochs and minibatches.
``docs/job.md`` is the job's manual: the iteration, every column of ``metrics.csv``, the
loggers, the checkpoint's keys, callbacks and the order in which to read this package.
``python -m ppo_objectives.train --help`` documents every flag.
"""

from ppo_objectives.train.build import make_collector
from ppo_objectives.train.config import (
    ADVANTAGE_DEFAULTS,
    ADVANTAGE_MODES,
    RECIPES,
    RESUME_MAY_CHANGE,
    TrainConfig,
    build_parser,
)
from ppo_objectives.train.launch import check_launch
from ppo_objectives.train.loggers import METRICS, read_metrics
from ppo_objectives.train.cli import main
from ppo_objectives.train.loop import TrainingCollapseWarning, train
from ppo_objectives.train.monitor import plot_metrics
from ppo_objectives.train.rollout import (check_policy_version, collect_batch, response_layout, rollout_batch,
                                         score_batch)
from ppo_objectives.train.update import ppo_update

__all__ = [
    "ADVANTAGE_DEFAULTS", "ADVANTAGE_MODES", "METRICS", "RECIPES", "RESUME_MAY_CHANGE", "TrainConfig",
    "TrainingCollapseWarning", "build_parser", "check_launch", "check_policy_version", "collect_batch", "main",
    "make_collector", "plot_metrics", "ppo_update", "read_metrics", "response_layout", "rollout_batch", "score_batch",
    "train",
]  # fmt: skip

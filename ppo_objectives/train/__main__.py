"""``python -m ppo_objectives.train``: the training job's command line (see :mod:`ppo_objectives.train`)."""

import sys

from ppo_objectives.train.cli import main

sys.exit(main())

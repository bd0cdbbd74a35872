"""The training job's command-line flags for the job tests, written once.

The test files import them as ``from _flags import SMALL`` (pytest puts ``tests/train`` on ``sys.path``, as
for ``from test_loop import _pieces``). A test that needs other values extends a list: argparse keeps the
last value of a flag given twice, so ``[*SMALL, "--num-envs", "8"]`` runs 8 rows.
"""

#: A short job: the pico preset (ignored with --model), 16 rows, a 5-step warm start, no progress bar.
SMALL = ["--preset", "pico", "--num-envs", "16", "--warmup-steps", "5", "--no-progress"]

#: SMALL's twin for the torchrun jobs of ``conftest.py``: no trust region (--early-stop-kl 0), every step is taken.
TORCHRUN_SMALL = [*SMALL, "--early-stop-kl", "0"]

#: SMALL cut shorter, for tests that only need a job to run, stop and resume (the command line, pretrained
#: checkpoints): 8 rows, a 3-step warm start, one PPO epoch of two minibatches, no plot.
SHORT = [*SMALL, "--num-envs", "8", "--warmup-steps", "3", "--ppo-epochs", "1", "--minibatches", "2", "--no-plot"]

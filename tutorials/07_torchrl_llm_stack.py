"""Tutorial 7: PPO with a critic on TorchRL's own LLM stack (ChatEnv, TransformersWrapper, LLMCollector).

TorchRL's LLM tooling steps an environment once per *assistant turn* and ships
only critic-free losses (GRPO, DAPO, CISPO). Here we keep its environment,
wrapper and collector, and swap in token-level PPO with a value function:

    ChatEnv (+ reward, + a tool message after each reply)       one step = one assistant turn
      -> TransformersWrapper(generate=True) around a Llama      the policy
      -> LLMCollector(postproc=LLMToTokenBatch())               turns -> full-sequence layout, one row per dialog, [B, T]
      -> recompute sample log-probs, critic values              CausalLMTokenLogProbs / CausalLMCritic
      -> KLPenaltyTransform (reference = frozen initial policy) per-token KL in the reward
      -> MaskedGAE                                              skips prompt, tool tokens and padding
      -> TokenPPOLoss, Adam                                     a few PPO epochs per batch

The full-sequence layout (keys, shapes, what ``mask`` means, where rewards,
values and done flags live) is stated in ``ppo_objectives/llm/chat.py``.

Everything is local and tiny (no downloads): a character-level tokenizer built
with ``tokenizers`` and a randomly initialised one-layer Llama. The task: the
reward of a reply is the number of letters "e" in it (at most 6 per reply).

Run: ``python tutorials/07_torchrl_llm_stack.py`` (needs ``pip install -e ".[hf]"``).
With ``PPO_TUTORIAL_SMOKE=1`` it runs two iterations only.
"""

import copy
import importlib.util
import os
import string
import sys
import time
import warnings

import torch
from tensordict import lazy_stack

if importlib.util.find_spec("transformers") is None or importlib.util.find_spec("tokenizers") is None:
    print('This tutorial needs the optional Hugging Face extra: pip install -e ".[hf]"  (skipping)')
    sys.exit(0)

SMOKE = os.environ.get("PPO_TUTORIAL_SMOKE") == "1"
ITERATIONS = 2 if SMOKE else 40
PPO_EPOCHS = 1 if SMOKE else 4
TURNS = 2  # replies per dialog; a tool message comes after each
ENVS = 4  # dialogs collected in parallel
MAX_NEW_TOKENS = 6
torch.manual_seed(0)

# Plumbing: two warnings come from inside TorchRL 0.14.1's LLM code (a deprecated
# cross_entropy argument, and its nested tensors), not from this script.
warnings.filterwarnings("ignore", message="size_average and reduce args will be deprecated")
warnings.filterwarnings("ignore", message="The PyTorch API of nested tensors is in prototype stage")

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers  # noqa: E402
from torchrl.collectors.llm import LLMCollector  # noqa: E402
from torchrl.data import Unbounded  # noqa: E402
from torchrl.data.llm import History  # noqa: E402
from torchrl.data.llm.history import _CHAT_TEMPLATES  # noqa: E402
from torchrl.envs import InitTracker, Transform  # noqa: E402
from torchrl.envs.llm import ChatEnv  # noqa: E402
from torchrl.modules.llm import TransformersWrapper  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402

from ppo_objectives.llm.chat import CausalLMCritic, CausalLMTokenLogProbs, LLMToTokenBatch  # noqa: E402
from ppo_objectives.loss import TokenPPOLoss  # noqa: E402
from ppo_objectives.transforms import KLPenaltyTransform  # noqa: E402
from ppo_objectives.value.gae import MaskedGAE  # noqa: E402

# --------------------------------------------------------------------------- #
# 1. A tokenizer and a model, built locally
# --------------------------------------------------------------------------- #
# One token per character, plus the ChatML markers of TorchRL's "chatml_format" template.
# "<" and "|" are not characters of the vocabulary, so decoding and re-encoding a reply gives
# back exactly the sampled ids: the history can be re-tokenised turn after turn.
SPECIALS = ["<pad>", "<|im_start|>", "<|im_end|>"]
vocab = {t: i for i, t in enumerate(SPECIALS + list(string.ascii_lowercase + " .,?!\n0123456789"))}
core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
core.decoder = decoders.Fuse()
tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<|im_end|>")
tok.chat_template = _CHAT_TEMPLATES["chatml_format"]

config = LlamaConfig(
    vocab_size=len(tok),
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    max_position_embeddings=256,
    pad_token_id=tok.pad_token_id,
    eos_token_id=tok.eos_token_id,
    bos_token_id=None,
)
policy_lm = LlamaForCausalLM(config)
ref_lm = copy.deepcopy(policy_lm).eval().requires_grad_(False)  # the frozen reference: the initial policy
critic_lm = LlamaForCausalLM(config)  # the critic: its own trunk (no shared weights with the policy)

# --------------------------------------------------------------------------- #
# 2. TorchRL's environment, policy wrapper and collector, unchanged
# --------------------------------------------------------------------------- #
QUERIES = ["say something", "tell me more", "what next", "any news"]


class Queries:
    """The dataloader ChatEnv draws its user queries from."""

    batch_size = ENVS

    def __iter__(self):
        return self

    def __next__(self):
        return {"query": QUERIES[:ENVS]}


class CountTheEs(Transform):
    """Reward = letters "e" in the reply; then a tool message; the dialog ends after TURNS replies."""

    def _reset(self, tensordict, tensordict_reset):
        tensordict_reset.set("turn", torch.zeros(*tensordict_reset.batch_size, 1, dtype=torch.long))
        return tensordict_reset

    def _step(self, tensordict, next_tensordict):
        replies = tensordict.get(("text", "response")).tolist()
        next_tensordict.set("reward", torch.tensor([[float(r.count("e"))] for r in replies]))
        turn = tensordict.get("turn") + 1
        next_tensordict.set("turn", turn)
        next_tensordict.set("done", turn >= TURNS)
        next_tensordict.set("terminated", turn >= TURNS)
        prompt = next_tensordict.get(("history", "prompt"))
        tool = lazy_stack([History(role="tool", content="noted") for _ in range(prompt.shape[0])])
        next_tensordict.set(("history", "prompt"), prompt.extend(tool.unsqueeze(-1), inplace=False, dim=-1))
        return next_tensordict

    def transform_observation_spec(self, spec):
        spec["turn"] = Unbounded(shape=(*spec.shape, 1), dtype=torch.long)
        return spec

    def transform_reward_spec(self, spec):
        spec["reward"] = Unbounded(shape=(*spec.shape, 1))
        return spec


env = ChatEnv.from_dataloader(Queries(), batch_size=(ENVS,), tokenizer=tok)
env = env.append_transform(CountTheEs()).append_transform(InitTracker())
policy = TransformersWrapper(
    policy_lm,
    tokenizer=tok,
    input_mode="history",
    generate=True,
    return_log_probs=True,
    # Plumbing: TorchRL re-renders the history from text at every turn, and its History parsing
    # strips the whitespace around a reply and would split a reply that writes chat markup. Banning
    # those tokens keeps the tokens incremental, which the one-row-per-dialog layout needs (with
    # LLMToTokenBatch(layout="turn") any reply works). Log-probs are those of the model's raw
    # logits, for sampling and training alike.
    generate_kwargs={
        "max_new_tokens": MAX_NEW_TOKENS,
        "do_sample": True,
        "bad_words_ids": [[tok.convert_tokens_to_ids(t)] for t in ("<|im_start|>", "<pad>", " ", "\n")],
    },
)
collector = LLMCollector(
    env,
    policy=policy,
    dialog_turns_per_batch=ENVS * TURNS,  # [ENVS, TURNS] turns: ENVS whole dialogs per batch
    total_dialog_turns=ENVS * TURNS * ITERATIONS,
    postproc=LLMToTokenBatch(pad_token_id=tok.pad_token_id),  # our converter
)

# --------------------------------------------------------------------------- #
# 3. Our side: actor/critic read-outs, KL transform, GAE, loss
# --------------------------------------------------------------------------- #
actor = CausalLMTokenLogProbs(policy_lm)  # writes "log_prob", "entropy" for every token of a row
critic = CausalLMCritic(critic_lm)  # writes "state_value" (and ("next", "state_value"))
kl_transform = KLPenaltyTransform(CausalLMTokenLogProbs(ref_lm), coeff=0.05)  # k1 in the reward
gae = MaskedGAE(gamma=1.0, lmbda=0.95, average_gae=True)
loss_fn = TokenPPOLoss(actor, critic, clip_epsilon=0.2, critic_coeff=0.5, kl_to_ref_coeff=0.0, entropy_coeff=0.01)
optim = torch.optim.Adam(loss_fn.parameters(), lr=3e-3)

# --------------------------------------------------------------------------- #
# 4. What one converted row looks like
# --------------------------------------------------------------------------- #
# LLMToTokenBatch puts each dialog on one row: the last turn's ("tokens", "full") holds the
# whole conversation; `mask` marks the tokens the policy sampled (both replies, each with its
# closing <|im_end|> when it stopped early); user, tool and template tokens are holes.
with torch.no_grad():
    peek = LLMToTokenBatch(pad_token_id=tok.pad_token_id)(
        lazy_stack([env.rollout(TURNS, policy, break_when_any_done=False)[0]])
    )
ids = peek["tokens"][0][peek["attention_mask"][0]].tolist()
pieces = [tok.convert_ids_to_tokens(i) for i in ids]
print("one dialog, token by token ([x] = sampled by the policy, mask True):")
print("".join(f"[{p}]" if m else p for p, m in zip(pieces, peek["mask"][0].tolist())).replace("\n", "\\n"))
last_of_turn = [int((peek["turn"][0] == k).nonzero().max()) for k in range(TURNS)]
print(
    f"row shape {tuple(peek.batch_size)}, sampled tokens {int(peek['mask'].sum())}, each turn's reward "
    f"on its last sampled token: {[(t, peek['next', 'reward'][0, t, 0].item()) for t in last_of_turn]}"
)
print()

# --------------------------------------------------------------------------- #
# 5. The PPO loop
# --------------------------------------------------------------------------- #
# reward/dialog: environment reward (letters "e") summed over a dialog's turns, before the KL
# penalty; kl/token: mean k1 estimate log p - log p_ref over sampled tokens; loss_pi, loss_v, clip:
# TokenPPOLoss's loss_objective, loss_critic and clip_fraction of the last PPO epoch.
print(f"{'iter':>4} {'reward/dialog':>13} {'kl/token':>9} {'loss_pi':>8} {'loss_v':>8} {'clip':>5} {'sec':>5}")
start = t0 = time.time()
for it, batch in enumerate(collector):  # the collector samples with the current weights of policy_lm
    with torch.no_grad():
        # TorchRL 0.14's generate path stores 0 as the log-prob of each turn's first sampled
        # token; recompute the sampling log-probs with the same weights (as OpenRLHF/verl do).
        CausalLMTokenLogProbs(policy_lm, out_key="sample_log_prob", entropy_key=None)(batch)
        critic(batch)  # rollout values V_old, and the bootstrap values of unfinished dialogs
    score = batch["next", "reward"].sum() / batch.batch_size[0]  # before the KL penalty
    batch = kl_transform(batch)  # writes ref_log_prob, kl_penalty; reward -= 0.05 * kl
    batch = gae(batch)  # advantage (whitened over sampled tokens), value_target
    for _ in range(PPO_EPOCHS):
        terms = loss_fn(batch)
        loss = terms["loss_objective"] + terms["loss_critic"] + terms["loss_entropy"]
        optim.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(loss_fn.parameters(), 1.0)
        optim.step()
    kl = batch["kl_penalty"][batch["mask"]].mean()
    print(
        f"{it:>4} {score.item():>13.2f} {kl.item():>9.4f} {terms['loss_objective'].item():>8.3f} "
        f"{terms['loss_critic'].item():>8.3f} {terms['clip_fraction'].item():>5.2f} {time.time() - t0:>5.1f}"
    )
    t0 = time.time()
collector.shutdown()
print(f"done in {time.time() - start:.1f}s; the best a dialog can score is {TURNS * MAX_NEW_TOKENS}")

"""TorchRL LLM stack -> token-level PPO: LLMToTokenBatch, CausalLMCritic, CausalLMTokenLogProbs.

Everything runs on CPU without downloads: a character-level tokenizer built with
``tokenizers`` (wrapped in ``PreTrainedTokenizerFast`` with TorchRL's ChatML
template) and a randomly initialised one-layer Llama.
"""

from __future__ import annotations

import string

import pytest
import torch
from tensordict import TensorDict, lazy_stack

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from torchrl.collectors.llm import LLMCollector  # noqa: E402
from torchrl.data import LazyTensorStorage, ReplayBuffer, SamplerWithoutReplacement, Unbounded  # noqa: E402
from torchrl.data.llm import History  # noqa: E402
from torchrl.envs import InitTracker, Transform  # noqa: E402
from torchrl.envs.llm import ChatEnv  # noqa: E402
from torchrl.envs.llm.transforms import RetrieveKL  # noqa: E402
from torchrl.modules.llm import TransformersWrapper  # noqa: E402

from ppo_objectives.llm.chat import (  # noqa: E402
    CausalLMCritic,
    CausalLMTokenLogProbs,
    LLMToTokenBatch,
    bootstrap_from_next_turn,
)
from ppo_objectives.loss import TokenPPOLoss  # noqa: E402
from ppo_objectives.testing import reference_log_probs
from ppo_objectives.value.gae import MaskedGAE

# The suite turns warnings into errors; two come from inside TorchRL 0.14.1's LLM code, not ours:
# TransformersWrapper calls F.cross_entropy(..., reduce=False) (deprecated by torch), and
# RetrieveKL / KLComputation build strided nested tensors (a torch prototype warning).
pytestmark = [
    pytest.mark.filterwarnings("ignore:size_average and reduce args will be deprecated:UserWarning"),
    pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage:UserWarning"),
]

SPECIALS = ["<pad>", "<|im_start|>", "<|im_end|>"]
CHARS = list(string.ascii_lowercase + " .,?!\n0123456789")


# --------------------------------------------------------------------------- #
# Local tokenizer, tiny model, environment pieces
# --------------------------------------------------------------------------- #
@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def make_tokenizer():
    """One token per character; the ChatML markers and <pad> are special tokens.

    '<' and '|' are not in the character vocabulary, so decoding then re-encoding a
    generated text gives back exactly the generated ids (the tokenisation is incremental).
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from torchrl.data.llm.history import _CHAT_TEMPLATES
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + CHARS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<|im_end|>")
    tokenizer.chat_template = _CHAT_TEMPLATES["chatml_format"]  # marks assistant tokens with {% generation %}
    return tokenizer


def make_lm(tok, seed=0, eos_bias=0.0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
    )
    lm = LlamaForCausalLM(cfg).eval()
    if eos_bias:
        # part of the model (sampling and scoring both see it): many replies end with <|im_end|>
        bias = torch.zeros(len(tok))
        bias[tok.eos_token_id] = eos_bias

        def add_bias(module, args, kwargs, output):
            output["logits"] = output["logits"] + bias
            return output

        lm.register_forward_hook(add_bias, with_kwargs=True)
    return lm


class Queries:
    """A dataloader of fixed user queries (two per batch)."""

    batch_size = 2

    def __iter__(self):
        return self

    def __next__(self):
        return {"query": ["add two and two", "what is one"]}


class ToolTurns(Transform):
    """Reward = number of vowels in the reply; after each reply a tool message; done after `turns` replies."""

    def __init__(self, turns: int = 1):
        super().__init__()
        self.turns = turns

    def _reset(self, tensordict, tensordict_reset):
        tensordict_reset.set("turn", torch.zeros(*tensordict_reset.batch_size, 1, dtype=torch.long))
        return tensordict_reset

    def _step(self, tensordict, next_tensordict):
        text = tensordict.get(("text", "response"))
        text = text.tolist() if hasattr(text, "tolist") else list(text)
        reward = torch.tensor([[float(sum(c in "aeiou" for c in t))] for t in text])
        next_tensordict.set("reward", reward)
        turn = tensordict.get("turn") + 1
        next_tensordict.set("turn", turn)
        done = turn >= self.turns
        next_tensordict.set("done", done)
        next_tensordict.set("terminated", done)
        prompt = next_tensordict.get(("history", "prompt"))
        tool = lazy_stack([History(role="tool", content="ok " * (i + 1)) for i in range(prompt.shape[0])])
        next_tensordict.set(("history", "prompt"), prompt.extend(tool.unsqueeze(-1), inplace=False, dim=-1))
        return next_tensordict

    def transform_observation_spec(self, spec):
        spec["turn"] = Unbounded(shape=(*spec.shape, 1), dtype=torch.long)
        return spec

    def transform_reward_spec(self, spec):
        spec["reward"] = Unbounded(shape=(*spec.shape, 1))
        return spec


def make_policy(lm, tok, max_new_tokens=4):
    return TransformersWrapper(
        lm,
        tokenizer=tok,
        input_mode="history",
        generate=True,
        return_log_probs=True,
        # no chat markup inside a reply (it would be parsed as extra messages)
        generate_kwargs={
            "max_new_tokens": max_new_tokens,
            "do_sample": True,
            "bad_words_ids": [[tok.convert_tokens_to_ids("<|im_start|>")], [tok.pad_token_id]],
        },
    )


def make_env(tok, turns):
    env = ChatEnv.from_dataloader(Queries(), batch_size=(2,), tokenizer=tok)
    return env.append_transform(ToolTurns(turns)).append_transform(InitTracker())


def collect(lm, tok, *, turns, postproc=None, seed=0):
    """One LLMCollector batch of 2 envs x `turns` dialog turns ([2, turns] lazy stack)."""
    torch.manual_seed(seed)
    policy = make_policy(lm, tok)
    collector = LLMCollector(make_env(tok, turns), policy=policy, dialog_turns_per_batch=2 * turns, postproc=postproc)
    try:
        return next(iter(collector))
    finally:
        collector.shutdown()


def turn_td(prompt, full, logp=None, reward=None, done=False, terminated=None, **extra):
    """A single synthetic turn in TorchRL's layout (ragged 1-D entries)."""
    d = {("tokens", "prompt"): torch.tensor(prompt), ("tokens", "full"): torch.tensor(full)}
    if logp is not None:
        d[("log_probs", "response")] = torch.tensor(logp)
    if reward is not None:
        d[("next", "reward")] = torch.as_tensor(reward, dtype=torch.float32).reshape(-1, 1)
        if d[("next", "reward")].numel() == 1:
            d[("next", "reward")] = d[("next", "reward")].reshape(1)
    d[("next", "done")] = torch.tensor([done])
    d[("next", "terminated")] = torch.tensor([done if terminated is None else terminated])
    for k, v in extra.items():
        d[("next",) + tuple(k.split("__"))] = torch.as_tensor(v)
    return TensorDict(d)


def rows(*dialogs):
    """[N, S] lazy stack of turn TensorDicts (one list per env row)."""
    return lazy_stack([lazy_stack(list(d)) for d in dialogs])


# --------------------------------------------------------------------------- #
# The conversion itself: golden cases
# --------------------------------------------------------------------------- #
def test_single_turn_rows_are_right_padded_with_mask_on_generated_tokens():
    # env 0: prompt [5, 6], generated [7, 8, 9]; env 1: prompt [5], generated [4]
    batch = rows(
        [turn_td([5, 6], [5, 6, 7, 8, 9], logp=[-0.1, -0.2, -0.3], reward=2.0, done=True)],
        [turn_td([5], [5, 4], logp=[-0.5], reward=-1.0, done=True)],
    )
    out = LLMToTokenBatch(pad_token_id=0)(batch)
    assert out.batch_size == torch.Size([2, 5])
    assert out["tokens"].tolist() == [[5, 6, 7, 8, 9], [5, 4, 0, 0, 0]]
    assert out["attention_mask"].tolist() == [[True] * 5, [True, True, False, False, False]]
    assert out["mask"].tolist() == [[False, False, True, True, True], [False, True, False, False, False]]
    torch.testing.assert_close(
        out["sample_log_prob"], torch.tensor([[0, 0, -0.1, -0.2, -0.3], [0, -0.5, 0, 0, 0]])
    )
    # the turn reward sits on the last generated token only (never broadcast over the turn)
    assert out["next", "reward"].squeeze(-1).tolist() == [[0, 0, 0, 0, 2.0], [0, -1.0, 0, 0, 0]]
    assert out["next", "done"].squeeze(-1).tolist() == [[False] * 4 + [True], [False, True, False, False, False]]
    assert out["next", "terminated"].squeeze(-1).tolist() == out["next", "done"].squeeze(-1).tolist()
    assert not out["next", "truncated"].any()
    assert out["turn"].tolist() == [[-1, -1, 0, 0, 0], [-1, 0, -1, -1, -1]]


def test_multi_turn_dialog_is_one_row_with_user_and_tool_tokens_as_holes():
    # turn 0: prompt [1, 2] -> generates [3, 4]; the env appends a tool message [9, 9]
    # turn 1: prompt [1, 2, 3, 4, 9, 9] -> generates [5, 6], done
    batch = rows(
        [
            turn_td([1, 2], [1, 2, 3, 4], logp=[-0.1, -0.2], reward=1.0),
            turn_td([1, 2, 3, 4, 9, 9], [1, 2, 3, 4, 9, 9, 5, 6], logp=[-0.3, -0.4], reward=10.0, done=True),
        ]
    )
    out = LLMToTokenBatch()(batch)
    assert out.batch_size == torch.Size([1, 8])
    assert out["tokens"].tolist() == [[1, 2, 3, 4, 9, 9, 5, 6]]
    assert out["mask"].int().tolist() == [[0, 0, 1, 1, 0, 0, 1, 1]]  # tool tokens 9, 9 are a hole
    assert out["turn"].tolist() == [[-1, -1, 0, 0, -1, -1, 1, 1]]
    torch.testing.assert_close(out["sample_log_prob"], torch.tensor([[0, 0, -0.1, -0.2, 0, 0, -0.3, -0.4]]))
    # each turn's reward on its own last generated token: 1 at position 3, 10 at position 7
    assert out["next", "reward"].squeeze(-1).tolist() == [[0, 0, 0, 1.0, 0, 0, 0, 10.0]]
    assert out["next", "done"].squeeze(-1).tolist() == [[False] * 7 + [True]]


def test_masked_gae_on_a_converted_dialog_skips_the_tool_tokens():
    batch = rows(
        [
            turn_td([1, 2], [1, 2, 3, 4], logp=[0.0, 0.0], reward=1.0),
            turn_td([1, 2, 3, 4, 9, 9], [1, 2, 3, 4, 9, 9, 5, 6], logp=[0.0, 0.0], reward=10.0, done=True),
        ]
    )
    out = LLMToTokenBatch()(batch)
    out["state_value"] = torch.zeros(1, 8, 1)
    out["next", "state_value"] = torch.zeros(1, 8, 1)
    MaskedGAE(gamma=1.0, lmbda=1.0)(out)
    # gamma = lmbda = 1, V = 0: advantage = reward-to-go over the valid tokens 2, 3, 6, 7:
    # 1 + 10 = 11 at tokens 2 and 3, then 10 at tokens 6 and 7; holes and prompt are 0
    assert out["advantage"].squeeze(-1).tolist() == [[0, 0, 11, 11, 0, 0, 10, 10]]


def test_a_done_turn_ends_the_dialog_and_the_next_turn_starts_a_new_row():
    batch = rows(
        [
            turn_td([1], [1, 2], logp=[-1.0], reward=1.0, done=True),
            turn_td([7, 7], [7, 7, 8, 8], logp=[-2.0, -3.0], reward=2.0, done=True),
        ]
    )
    out = LLMToTokenBatch()(batch)
    assert out["tokens"].tolist() == [[1, 2, 0, 0], [7, 7, 8, 8]]
    assert out["mask"].int().tolist() == [[0, 1, 0, 0], [0, 0, 1, 1]]
    assert out["next", "reward"].squeeze(-1).tolist() == [[0, 1.0, 0, 0], [0, 0, 0, 2.0]]


def test_a_dialog_cut_by_the_batch_boundary_has_no_end_flags():
    # not done: MaskedGAE must bootstrap from ("next", "state_value") rather than treat it as terminal
    out = LLMToTokenBatch()(rows([turn_td([1], [1, 2, 3], logp=[-1.0, -1.0], reward=0.5)]))
    for flag in ("done", "terminated", "truncated"):
        assert not out["next", flag].any()


def test_truncated_dialog_flags_truncated_not_terminated():
    t = turn_td([1], [1, 2], logp=[-1.0], reward=0.0, done=True, terminated=False)
    out = LLMToTokenBatch()(rows([t]))
    assert out["next", "truncated"].squeeze(-1).tolist() == [[False, True]]
    assert not out["next", "terminated"].any()


def test_flat_batch_starts_a_new_row_when_a_turn_does_not_continue_the_previous_one():
    # [N * S] layout (flatten_data=True): env 0's unfinished turn, then env 1's first turn
    flat = lazy_stack([turn_td([1], [1, 2], logp=[-1.0], reward=1.0), turn_td([5], [5, 6], logp=[-2.0], reward=2.0)])
    out = LLMToTokenBatch()(flat)
    assert out["tokens"].tolist() == [[1, 2], [5, 6]]
    assert out["sample_log_prob"].tolist() == [[0, -1.0], [0, -2.0]]


def test_flat_batch_keeps_consecutive_turns_of_one_dialog_together():
    flat = lazy_stack(
        [turn_td([1], [1, 2], logp=[-1.0], reward=1.0), turn_td([1, 2, 9], [1, 2, 9, 3], logp=[-2.0], reward=2.0)]
    )
    out = LLMToTokenBatch()(flat)
    assert out["mask"].int().tolist() == [[0, 1, 0, 1]]


def test_torchrl_kl_outputs_are_read_on_each_turns_own_tokens():
    # TorchRL's RetrieveKL / KLComputation write, at every turn, one value per token of the
    # full sequence and score *every* assistant message of the history: turn 1 re-scores turn 0's
    # tokens 2, 3 (here with 99s). Only each turn's own generated tokens are read, so nothing is
    # counted twice. The template rendering may be longer than ("tokens", "full"): extra entries drop.
    t0 = turn_td(
        [1, 2],
        [1, 2, 3, 4],
        logp=[-0.1, -0.2],
        reward=[0.0, 0.0, -0.5, -0.25, 7.0],  # per-token (KL-shaped) reward over the rendering
        ref_log_probs__full=[0.0, 0.0, -0.3, -0.4, 0.0],
        kl_penalty=[0.0, 0.0, 0.2, 0.2, 0.0],
    )
    t1 = turn_td(
        [1, 2, 3, 4, 9],
        [1, 2, 3, 4, 9, 5],
        logp=[-0.6],
        reward=[0, 0, 99, 99, 0, -1.0],
        ref_log_probs__full=[0, 0, 99, 99, 0, -0.7],
        kl_penalty=[0, 0, 99, 99, 0, 0.1],
        done=True,
    )
    out = LLMToTokenBatch()(rows([t0, t1]))
    assert out["next", "reward"].squeeze(-1).tolist() == [[0, 0, -0.5, -0.25, 0, -1.0]]
    torch.testing.assert_close(out["ref_log_prob"], torch.tensor([[0, 0, -0.3, -0.4, 0, -0.7]]))
    torch.testing.assert_close(out["torchrl", "kl_penalty"], torch.tensor([[0, 0, 0.2, 0.2, 0, 0.1]]))
    assert "kl_penalty" not in out.keys()  # so that our KLPenaltyTransform still applies


def test_kl_reward_transform_layout_is_read_too():
    # KLRewardTransform writes ("next", "reward"), ("next", "kl_penalty") and ("next", "ref_log_probs")
    # (a tensor, not a ("ref_log_probs", "full") container), all [L, 1]
    t = turn_td([1], [1, 2, 3], logp=[-0.5, -0.6], reward=[0.0, -0.1, 0.9], done=True)
    t["next", "kl_penalty"] = torch.tensor([[0.0], [0.1], [0.1]])
    t["next", "ref_log_probs"] = torch.tensor([[0.0], [-0.6], [-0.7]])
    out = LLMToTokenBatch()(rows([t]))
    torch.testing.assert_close(out["ref_log_prob"], torch.tensor([[0.0, -0.6, -0.7]]))
    torch.testing.assert_close(out["next", "reward"].squeeze(-1), torch.tensor([[0.0, -0.1, 0.9]]))
    torch.testing.assert_close(out["torchrl", "kl_penalty"], torch.tensor([[0.0, 0.1, 0.1]]))


def test_our_kl_penalty_transform_on_a_converted_dialog_penalises_generated_tokens_only():
    from ppo_objectives.transforms import KLPenaltyTransform

    out = LLMToTokenBatch()(
        rows(
            [
                turn_td([1, 2], [1, 2, 3, 4], logp=[-1.0, -1.0], reward=1.0),
                turn_td([1, 2, 3, 4, 9, 9], [1, 2, 3, 4, 9, 9, 5, 6], logp=[-1.0, -1.0], reward=10.0, done=True),
            ]
        )
    )
    out["ref_log_prob"] = torch.where(out["mask"], torch.tensor(-1.5), torch.tensor(float("nan")))
    out = KLPenaltyTransform(coeff=0.5)(out)
    # k1 = logp - ref = -1 + 1.5 = 0.5 on the 4 generated tokens; reward -= 0.5 * 0.5 there only;
    # the turn rewards 1 and 10 stay on their last generated tokens; NaN at holes never leaks
    torch.testing.assert_close(out["kl_penalty"], torch.tensor([[0, 0, 0.5, 0.5, 0, 0, 0.5, 0.5]]))
    torch.testing.assert_close(
        out["next", "reward"].squeeze(-1), torch.tensor([[0, 0, -0.25, 0.75, 0, 0, -0.25, 9.75]])
    )


def test_full_log_prob_key_is_sliced_to_the_generated_tokens():
    t = turn_td([1, 2], [1, 2, 3], reward=1.0, done=True)
    t["log_probs", "full"] = torch.tensor([9.0, 9.0, -0.5, 9.0])  # one longer: template rendering
    out = LLMToTokenBatch(log_prob_key=("log_probs", "full"))(rows([t]))
    assert out["sample_log_prob"].tolist() == [[0, 0, -0.5]]


def _non_incremental_dialog():
    # turn 1's prompt re-renders turn 0's reply [3, 4] as [3] (e.g. a stripped trailing newline)
    return rows(
        [
            turn_td([1, 2], [1, 2, 3, 4], logp=[-0.1, -0.2], reward=1.0),
            turn_td([1, 2, 3, 9], [1, 2, 3, 9, 5, 6], logp=[-0.3, -0.4], reward=10.0, done=True),
        ]
    )


def test_turn_layout_gives_one_row_per_turn_linked_to_the_next_turn():
    out = LLMToTokenBatch(layout="turn")(_non_incremental_dialog())
    assert out["tokens"].tolist() == [[1, 2, 3, 4, 0, 0], [1, 2, 3, 9, 5, 6]]
    assert out["mask"].int().tolist() == [[0, 0, 1, 1, 0, 0], [0, 0, 0, 0, 1, 1]]
    assert out["next_turn_row"][:, 0].tolist() == [1, -1]
    assert out["next", "reward"].squeeze(-1).tolist() == [[0, 0, 0, 1.0, 0, 0], [0, 0, 0, 0, 0, 10.0]]
    # only the dialog's last turn carries its end flags; turn 0 is bootstrapped
    assert out["next", "done"].squeeze(-1).int().tolist() == [[0] * 6, [0] * 5 + [1]]


def test_turn_layout_gae_bootstraps_from_the_value_of_the_next_turns_prompt():
    out = LLMToTokenBatch(layout="turn")(_non_incremental_dialog())
    m = out["mask"].unsqueeze(-1)
    out["state_value"] = torch.where(m, torch.tensor(0.5), torch.tensor(0.0)).expand(2, 6, 1).clone()
    out["state_value"][1, 4, 0] = 4.0  # V(next turn's prompt [1, 2, 3, 9])
    out["next", "state_value"] = torch.zeros(2, 6, 1)
    bootstrap_from_next_turn(out)
    assert out["next", "state_value"][0, 3, 0] == 4.0  # last token of turn 0 <- V(next prompt)
    MaskedGAE(gamma=1.0, lmbda=1.0)(out)
    # turn 0 (gamma = lmbda = 1): A = r + V_boot - V at its end: 1 + 4 - 0.5 = 4.5 at token 3,
    # and token 2: 0 + (V_3 - V_2) + A_3 = 0 + 0 + 4.5 = 4.5
    torch.testing.assert_close(out["advantage"][0].squeeze(-1), torch.tensor([0, 0, 4.5, 4.5, 0, 0]))
    # turn 1 terminal: reward-to-go 10 minus V: token 4: 10 - 4 = 6; token 5: 10 - 0.5 = 9.5
    torch.testing.assert_close(out["advantage"][1].squeeze(-1), torch.tensor([0, 0, 0, 0, 6.0, 9.5]))


def test_turn_layout_in_a_flat_batch_links_only_turns_of_the_same_dialog():
    flat = lazy_stack(
        [
            turn_td([1], [1, 2], logp=[-1.0], reward=0.0),
            turn_td([1, 7], [1, 7, 3], logp=[-1.0], reward=0.0),  # same dialog: starts with prompt [1]
            turn_td([5], [5, 6], logp=[-1.0], reward=0.0),  # another env
        ]
    )
    out = LLMToTokenBatch(layout="turn")(flat)
    assert out["next_turn_row"][:, 0].tolist() == [1, -1, -1]


def test_error_for_an_unknown_layout():
    with pytest.raises(ValueError, match="layout='token' must be 'dialog'"):
        LLMToTokenBatch(layout="token")


def test_error_when_bootstrapping_without_turn_links():
    out = LLMToTokenBatch()(rows([turn_td([1], [1, 2], logp=[-1.0], reward=1.0, done=True)]))
    with pytest.raises(KeyError, match="layout='turn'"):
        bootstrap_from_next_turn(out)


def test_zero_reward_when_reward_key_is_none():
    t = turn_td([1], [1, 2], logp=[-1.0], done=True)
    out = LLMToTokenBatch(reward_key=None)(rows([t]))
    assert not out["next", "reward"].any()


def test_set_out_keys_renames_entries():
    t = turn_td([1], [1, 2], logp=[-1.0], reward=1.0, done=True)
    out = LLMToTokenBatch().set_out_keys(mask="response_mask", sample_log_prob="old_lp")(rows([t]))
    assert "response_mask" in out.keys() and "old_lp" in out.keys() and "mask" not in out.keys()


def test_converted_batch_passes_through_forward_unchanged():
    t = LLMToTokenBatch()
    out = t(rows([turn_td([1], [1, 2], logp=[-1.0], reward=1.0, done=True)]))
    assert t(out) is out


def test_replay_buffer_stores_token_rows_on_extend():
    rb = ReplayBuffer(
        storage=LazyTensorStorage(10), sampler=SamplerWithoutReplacement(), transform=LLMToTokenBatch(), batch_size=2
    )
    rb.extend(
        rows(
            [turn_td([1], [1, 2, 3], logp=[-1.0, -1.0], reward=1.0, done=True)],
            [turn_td([4], [4, 5, 6], logp=[-2.0, -2.0], reward=2.0, done=True)],
        )
    )
    assert len(rb) == 2
    sample = rb.sample()
    assert sample.batch_size == torch.Size([2, 3])
    assert sorted(sample["tokens"][:, 0].tolist()) == [1, 4]


# --------------------------------------------------------------------------- #
# Bad input
# --------------------------------------------------------------------------- #
def test_error_when_a_row_re_tokenises_the_history():
    bad = rows([turn_td([1], [1, 2], logp=[-1.0], reward=0.0), turn_td([1, 3, 9], [1, 3, 9, 4], logp=[-1.0], reward=0.0)])
    with pytest.raises(ValueError, match="does not continue .* re-tokenised differently.*layout='turn'"):
        LLMToTokenBatch()(bad)


def test_error_when_the_prompt_is_not_a_prefix_of_the_full_tokens():
    with pytest.raises(ValueError, match="is not a prefix of"):
        LLMToTokenBatch()(rows([turn_td([1, 2], [1, 3, 4], logp=[-1.0], reward=0.0)]))


def test_error_when_the_reward_is_missing():
    with pytest.raises(KeyError, match="reward_key=None"):
        LLMToTokenBatch()(rows([turn_td([1], [1, 2], logp=[-1.0])]))


def test_error_when_the_response_log_probs_do_not_match_the_generated_tokens():
    with pytest.raises(ValueError, match="the turn generated 2 tokens"):
        LLMToTokenBatch()(rows([turn_td([1], [1, 2, 3], logp=[-1.0], reward=0.0)]))


def test_error_when_a_per_token_reward_is_shorter_than_the_tokens():
    with pytest.raises(ValueError, match=r"expected one turn-level value \(\[1\]\) or one per token"):
        LLMToTokenBatch()(rows([turn_td([1], [1, 2, 3], logp=[-1.0, -1.0], reward=[0.0, 1.0])]))


def test_error_when_torchrl_kl_entries_are_shorter_than_the_tokens():
    t = turn_td([1], [1, 2, 3], logp=[-1.0, -1.0], reward=0.0, kl_penalty=[0.0, 0.1])
    with pytest.raises(ValueError, match="one value per token of the full sequence"):
        LLMToTokenBatch()(rows([t]))


def test_error_when_the_batch_has_no_batch_dimension():
    with pytest.raises(ValueError, match="batch_size=\\[\\]"):
        LLMToTokenBatch()(turn_td([1], [1, 2], logp=[-1.0], reward=0.0))


def test_error_when_the_tokens_are_missing():
    with pytest.raises(KeyError, match="turn tokens"):
        LLMToTokenBatch()(TensorDict({"x": torch.zeros(2)}, batch_size=[2]))


def test_error_when_the_prompt_tokens_are_missing():
    t = turn_td([1], [1, 2], logp=[-1.0], reward=0.0)
    del t["tokens", "prompt"]
    with pytest.raises(KeyError, match="locate the generated tokens"):
        LLMToTokenBatch()(rows([t]))


def test_error_when_tokens_are_padded():
    t = turn_td([1], [1, 2], logp=[-1.0], reward=0.0)
    t["tokens", "padded"] = torch.tensor(True)
    with pytest.raises(ValueError, match="pad_output=False"):
        LLMToTokenBatch()(rows([t]))


def test_error_when_an_empty_turn_carries_a_reward():
    with pytest.raises(ValueError, match=r"turn \[0, 0\] generated no token but has reward 1\.0: there is no token to carry "
                                         r"it; give the policy max_new_tokens >= 1"):
        LLMToTokenBatch()(rows([turn_td([1, 2], [1, 2], logp=[], reward=1.0, done=True)]))


def test_error_for_a_bad_pad_token_id():
    with pytest.raises(ValueError, match=r"pad_token_id=-1 must be a non-negative int \(the tokenizer's pad id\)"):
        LLMToTokenBatch(pad_token_id=-1)


def test_error_for_an_unknown_out_key():
    with pytest.raises(ValueError, match="unknown out key 'maks'"):
        LLMToTokenBatch().set_out_keys(maks="m")


def test_error_when_used_inside_an_environment(tok):
    env = ChatEnv(batch_size=(1,), tokenizer=tok).append_transform(LLMToTokenBatch())
    with pytest.raises(RuntimeError, match="cannot run inside an environment"):
        env.transform._step(TensorDict(batch_size=[1]), TensorDict(batch_size=[1]))


# --------------------------------------------------------------------------- #
# Critic and log-prob read-outs
# --------------------------------------------------------------------------- #
@pytest.fixture(scope="module")
def lm(tok):
    return make_lm(tok, seed=0)


def _row_batch():
    tokens = torch.tensor([[4, 5, 6, 7, 8], [4, 9, 10, 0, 0]])
    attention = tokens != 0
    attention[0] = True
    mask = torch.tensor([[False, False, True, False, True], [False, True, True, False, False]])
    return TensorDict({"tokens": tokens, "attention_mask": attention, "mask": mask}, batch_size=[2, 5])


def test_critic_value_of_token_t_is_the_head_on_the_hidden_state_before_it(lm):
    torch.manual_seed(1)
    critic = CausalLMCritic(make_lm_like(lm))
    td = critic(_row_batch())
    h = critic.backbone(input_ids=td["tokens"], attention_mask=td["attention_mask"].long()).last_hidden_state
    head = critic.head(h).squeeze(-1)  # value after token t
    v, nv = td["state_value"].squeeze(-1), td["next", "state_value"].squeeze(-1)
    m = td["mask"]
    # state_value[t] = head(h[t - 1]); ("next", "state_value")[t] = head(h[t])
    torch.testing.assert_close(v[m], torch.cat([torch.zeros(2, 1), head[:, :-1]], 1)[m])
    torch.testing.assert_close(nv[m], head[m])
    assert (v[~m] == 0).all() and (nv[~m] == 0).all()
    assert td["state_value"].shape == (2, 5, 1)


def make_lm_like(lm):
    return type(lm)(lm.config).eval()


def test_critic_runs_one_forward_pass_and_skips_the_lm_head(lm):
    critic = CausalLMCritic(make_lm_like(lm))
    calls = []
    critic.backbone.register_forward_hook(lambda *a: calls.append(1))
    critic(_row_batch())
    assert calls == [1]
    assert critic.backbone is not None and not hasattr(critic.backbone, "lm_head")


def test_critic_values_ignore_padding_token_content(lm):
    critic = CausalLMCritic(make_lm_like(lm))
    td = _row_batch()
    a = critic(td.clone())["state_value"]
    td2 = td.clone()
    td2["tokens"][1, 3:] = 17  # garbage at padding positions (attention_mask False)
    b = critic(td2)["state_value"]
    torch.testing.assert_close(a[td["mask"]], b[td["mask"]])


def test_token_log_probs_equal_a_direct_log_softmax(lm):
    td = _row_batch()
    CausalLMTokenLogProbs(lm)(td)
    logits = lm(input_ids=td["tokens"], attention_mask=td["attention_mask"].long()).logits
    ref = torch.cat([torch.zeros(2, 1), reference_log_probs(logits[:, :-1], td["tokens"][:, 1:]).float()], 1)
    m = td["mask"]
    torch.testing.assert_close(td["log_prob"][m], ref[m], rtol=1e-5, atol=1e-5)
    assert (td["log_prob"][~m] == 0).all() and (td["entropy"][~m] == 0).all()
    assert (td["entropy"][m] > 0).all()


def test_read_outs_reject_bad_inputs(lm):
    critic, actor = CausalLMCritic(make_lm_like(lm)), CausalLMTokenLogProbs(lm)
    with pytest.raises(ValueError, match=r"CausalLMCritic: tokens must be a \[B, T\] tensor of token ids, got \(3,\); "
                                         r"convert TorchRL turn batches with LLMToTokenBatch first"):
        critic.values(torch.tensor([1, 2, 3]))
    with pytest.raises(TypeError, match=r"CausalLMTokenLogProbs: tokens must hold integer token ids, got dtype torch\.float32"):
        actor.log_probs(torch.zeros(1, 3))
    with pytest.raises(ValueError, match=r"\bmask\b"):
        critic.values(torch.tensor([[1, 2, 3]]), mask=torch.tensor([[0.0, 0.5, 1.0]]))
    with pytest.raises(ValueError, match="pass hidden_size="):
        CausalLMCritic(torch.nn.Linear(2, 2))


def test_critic_head_is_the_documented_normal_init(lm):
    critic = CausalLMCritic(make_lm_like(lm))
    assert isinstance(critic.head, torch.nn.Linear) and critic.head.weight.shape == (1, lm.config.hidden_size)
    assert (critic.head.bias == 0).all() and (critic.head.weight != 0).all()


def test_token_log_probs_error_names_a_model_without_logits(lm):
    with pytest.raises(TypeError, match="LlamaModel returned no logits; pass a Hugging Face causal LM"):
        CausalLMTokenLogProbs(lm.model).log_probs(_row_batch()["tokens"])


def test_turn_layout_links_each_turn_to_the_next_one_and_flags_only_the_last():
    batch = rows(
        [
            turn_td([1], [1, 2], logp=[-1.0], reward=1.0),
            turn_td([1, 2, 9], [1, 2, 9, 3, 4], logp=[-2.0, -3.0], reward=2.0, done=True),
        ]
    )
    out = LLMToTokenBatch(layout="turn")(batch)
    assert out.batch_size == torch.Size([2, 5])
    assert out["next_turn_row"][:, 0].tolist() == [1, -1]
    assert out["mask"].int().tolist() == [[0, 1, 0, 0, 0], [0, 0, 0, 1, 1]]
    assert out["turn"].tolist() == [[-1, 0, -1, -1, -1], [-1, -1, -1, 0, 0]]
    assert out["next", "done"].squeeze(-1).tolist() == [[False] * 5, [False] * 4 + [True]]
    assert out["next", "reward"].squeeze(-1).tolist() == [[0, 1.0, 0, 0, 0], [0, 0, 0, 0, 2.0]]


# --------------------------------------------------------------------------- #
# With TorchRL's ChatEnv, TransformersWrapper and LLMCollector
# --------------------------------------------------------------------------- #
def test_collector_batch_converts_with_postproc_and_matches_the_wrappers_tokens(lm, tok):
    data = collect(lm, tok, turns=1)
    out = LLMToTokenBatch(pad_token_id=tok.pad_token_id)(data)
    assert out.batch_size[0] == 2
    for b in range(2):
        turn = data[b, 0]
        full, p = turn["tokens", "full"], turn["tokens", "prompt"].numel()
        assert out["tokens"][b, : full.numel()].tolist() == full.tolist()
        assert out["mask"][b].nonzero().squeeze(-1).tolist() == list(range(p, full.numel()))
        assert out["next", "reward"][b, full.numel() - 1, 0] == turn["next", "reward"].squeeze()
    # as collector postproc the collector yields the converted batch directly
    conv = collect(lm, tok, turns=1, postproc=LLMToTokenBatch(pad_token_id=tok.pad_token_id))
    assert set(conv.keys()) >= {"tokens", "mask", "sample_log_prob", "next"}
    assert conv["tokens"].tolist() == out["tokens"].tolist()


def test_wrapper_sample_log_probs_equal_recomputed_ones_except_each_turns_first_token(lm, tok):
    # Pins TorchRL 0.14's generate path: the log-prob of the first generated token of each turn
    # is stored as 0; all others equal a forward pass of the same model (why we recompute).
    out = LLMToTokenBatch(pad_token_id=tok.pad_token_id)(collect(lm, tok, turns=2))
    with torch.no_grad():
        CausalLMTokenLogProbs(lm, out_key="recomputed")(out)
    m = out["mask"]
    first = m & (out["turn"] != torch.nn.functional.pad(out["turn"], (1, 0), value=-1)[:, :-1])
    assert (out["sample_log_prob"][first] == 0).all() and (out["recomputed"][first] < 0).all()
    rest = m & ~first
    torch.testing.assert_close(out["sample_log_prob"][rest], out["recomputed"][rest], rtol=1e-4, atol=1e-4)


def test_multi_turn_collector_batch_masks_only_assistant_tokens(lm_eos, tok):
    data = collect(lm_eos, tok, turns=2)
    out = LLMToTokenBatch(pad_token_id=tok.pad_token_id)(data)
    assert out.batch_size[0] == 2  # one row per dialog of 2 turns
    for b in range(2):
        last = data[b, 1]
        n_generated = sum(data[b, s]["tokens", "response"].numel() for s in range(2))
        assert int(out["mask"][b].sum()) == n_generated
        text_of_mask = tok.decode(out["tokens"][b][out["mask"][b]])
        assert "tool" not in text_of_mask and "ok" not in text_of_mask.replace("<|im_end|>", "")
        assert out["next", "done"][b].sum() == 1 and last["next", "done"].all()
        # rewards of both turns, each on its turn's last generated token
        assert torch.isclose(out["next", "reward"][b].sum(), sum(data[b, s]["next", "reward"].sum() for s in range(2)))


@pytest.fixture(scope="module")
def lm_eos(tok):
    """A tiny LM biased towards <|im_end|>, so that some replies end their turn before max_new_tokens."""
    return make_lm(tok, seed=0, eos_bias=1.5)


@pytest.mark.parametrize("assistant_only", [False, True])
def test_retrieve_kl_outputs_match_our_reference_log_probs(lm_eos, tok, assistant_only):
    lm = lm_eos
    ref_lm = make_lm(tok, seed=1)
    gen = TransformersWrapper(lm, tokenizer=tok, input_mode="history", generate=False, return_log_probs=True)
    ref = TransformersWrapper(
        ref_lm, tokenizer=tok, input_mode="history", generate=False, return_log_probs=True, log_probs_key="ref_log_probs"
    )
    retrieve = RetrieveKL(gen_model=gen, ref_model=ref, assistant_only=assistant_only, add_to_reward=False)
    data = collect(lm, tok, turns=2)
    # RetrieveKL takes one row of turns at a time (a 2-D lazy stack gives it nested lists)
    data = lazy_stack([retrieve(row) for row in data.unbind(0)])
    out = LLMToTokenBatch(pad_token_id=tok.pad_token_id)(data)
    with torch.no_grad():
        CausalLMTokenLogProbs(ref_lm, out_key="ours")(out)
    m = out["mask"]
    end_of_turn = m & (out["tokens"] == tok.eos_token_id)
    assert end_of_turn.any()  # some replies ended with <|im_end|>, which is a generated token
    # TorchRL leaves the end-of-turn token unscored with assistant_only=True (its chat-template
    # mask stops before <|im_end|>); everywhere else both reference log-probs agree
    if assistant_only:
        assert (out["ref_log_prob"][end_of_turn] == 0).all() and (out["ours"][end_of_turn] < 0).all()
    scored = m & ~end_of_turn if assistant_only else m
    torch.testing.assert_close(out["ref_log_prob"][scored], out["ours"][scored], rtol=1e-4, atol=1e-4)
    # TorchRL's KL is gen - ref with the same (recomputed, so exact) gen log-probs
    with torch.no_grad():
        CausalLMTokenLogProbs(lm, out_key="gen")(out)
    torch.testing.assert_close(
        out["torchrl", "kl_penalty"][scored], (out["gen"] - out["ours"])[scored], rtol=1e-4, atol=1e-4
    )


def test_whitespace_stripping_history_needs_the_turn_layout_which_trains(tok):
    # A model that mostly writes newlines: TorchRL's History parsing strips them from the reply,
    # so the next prompt no longer starts with the sampled tokens.
    lm = make_lm(tok, seed=0)
    bias = torch.zeros(len(tok))
    bias[tok.convert_tokens_to_ids("\n")] = 4.0
    lm.register_forward_hook(lambda m, a, k, o: o.__setitem__("logits", o["logits"] + bias) or o, with_kwargs=True)
    data = collect(lm, tok, turns=2)
    with pytest.raises(ValueError, match="layout='turn'"):
        LLMToTokenBatch(pad_token_id=tok.pad_token_id)(data)
    out = LLMToTokenBatch(pad_token_id=tok.pad_token_id, layout="turn")(data)
    assert out.batch_size[0] == 4 and out["next_turn_row"][:, 0].tolist() == [1, -1, 3, -1]
    critic = CausalLMCritic(make_lm(tok, seed=2))
    with torch.no_grad():
        CausalLMTokenLogProbs(lm, out_key="sample_log_prob", entropy_key=None)(out)
        critic(out)
    bootstrap_from_next_turn(out)
    MaskedGAE(gamma=1.0, lmbda=0.95, average_gae=True)(out)
    loss = TokenPPOLoss(CausalLMTokenLogProbs(lm), critic, kl_to_ref_coeff=0.0)
    terms = loss(out)
    total = terms["loss_objective"] + terms["loss_critic"] + terms["loss_entropy"]
    assert torch.isfinite(total)
    total.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in lm.parameters())


def _ppo_step(out, lm, critic, *, kl_transform=None):
    """Recompute log-probs, critic values, (KL), GAE, loss, one optimizer step. Returns the loss terms."""
    actor = CausalLMTokenLogProbs(lm)
    with torch.no_grad():
        CausalLMTokenLogProbs(lm, out_key="sample_log_prob", entropy_key=None)(out)
        critic(out)
    if kl_transform is not None:
        out = kl_transform(out)
    MaskedGAE(gamma=1.0, lmbda=0.95, average_gae=True)(out)
    loss = TokenPPOLoss(actor, critic, kl_to_ref_coeff=0.0 if "ref_log_prob" not in out.keys() else 0.02)
    terms = loss(out)
    return loss, terms, out


def test_end_to_end_one_optimizer_step_on_a_chat_env_batch(lm, tok):
    from ppo_objectives.transforms import KLPenaltyTransform

    policy_lm = make_lm(tok, seed=0)
    ref_lm = make_lm(tok, seed=0)  # frozen copy of the initial policy
    critic = CausalLMCritic(make_lm(tok, seed=2))
    batch = collect(policy_lm, tok, turns=2, postproc=LLMToTokenBatch(pad_token_id=tok.pad_token_id))
    raw = batch.clone()
    kl = KLPenaltyTransform(CausalLMTokenLogProbs(ref_lm), coeff=0.05)
    loss, terms, out = _ppo_step(batch, policy_lm, critic, kl_transform=kl)
    assert out["kl_penalty"].abs().max() < 1e-5  # policy == reference before the first step
    assert set(terms.keys()) >= {"loss_objective", "loss_critic", "loss_kl_ref", "loss_entropy"}
    total = sum(v for k, v in terms.items() if k.startswith("loss_"))
    assert torch.isfinite(total)
    opt = torch.optim.Adam(loss.parameters(), lr=1e-2)
    before = [p.detach().clone() for p in policy_lm.parameters()]
    before_critic = [p.detach().clone() for p in critic.parameters()]
    total.backward()
    opt.step()
    assert any(not torch.equal(a, p) for a, p in zip(before, policy_lm.parameters()))
    assert any(not torch.equal(a, p) for a, p in zip(before_critic, critic.parameters()))
    # the policy moved away from the reference: on the same batch the KL transform now sees it
    with torch.no_grad():
        CausalLMTokenLogProbs(policy_lm, out_key="sample_log_prob", entropy_key=None)(raw)
    assert kl(raw)["kl_penalty"][raw["mask"]].abs().max() > 0


def test_multi_turn_garbage_at_tool_tokens_changes_nothing(lm_eos, tok):
    lm = lm_eos
    critic = CausalLMCritic(make_lm(tok, seed=2))
    batch = LLMToTokenBatch(pad_token_id=tok.pad_token_id)(collect(lm, tok, turns=2))
    with torch.no_grad():
        CausalLMTokenLogProbs(lm, out_key="sample_log_prob", entropy_key=None)(batch)
        critic(batch)
    batch["ref_log_prob"] = batch["sample_log_prob"] - 0.1 * batch["mask"]
    holes = ~batch["mask"]
    assert (holes & batch["attention_mask"]).any()  # the dialog has prompt and tool tokens
    dirty = batch.clone()
    for key in ("sample_log_prob", "ref_log_prob"):
        dirty[key] = torch.where(holes, torch.full_like(dirty[key], float("nan")), dirty[key])
    for key in ("state_value", ("next", "state_value"), ("next", "reward")):
        dirty[key] = torch.where(holes.unsqueeze(-1), torch.full_like(dirty[key], 1e6), dirty[key])

    def run(td):
        td = MaskedGAE(gamma=1.0, lmbda=0.95, average_gae=True)(td.clone())
        terms = TokenPPOLoss(CausalLMTokenLogProbs(lm), critic)(td)
        return td, terms

    clean_td, clean = run(batch)
    dirty_td, dirty_terms = run(dirty)
    for key in ("advantage", "value_target"):
        torch.testing.assert_close(clean_td[key], dirty_td[key])
    for key in ("loss_objective", "loss_critic", "loss_kl_ref", "clip_fraction", "explained_variance"):
        torch.testing.assert_close(clean[key], dirty_terms[key])


# --------------------------------------------------------------------------- #
# TorchRL's tool transform, conversations of different lengths (tutorial 13)
# --------------------------------------------------------------------------- #
PLANNED_TURNS = (1, 3, 2)  # the conversations' lengths, in the order the dataloader serves them


class Planned:
    """One problem at a time, as a TensorDict holding a two-message ``History`` and the conversation's length."""

    batch_size = 1

    def __init__(self):
        self.served = 0

    def __iter__(self):
        return self

    def __next__(self):
        turns = PLANNED_TURNS[self.served % len(PLANNED_TURNS)]
        self.served += 1
        query = History.from_chats([[{"role": "system", "content": "be brief"}, {"role": "user", "content": "go"}]])
        return TensorDict({"query": query, "plan": torch.tensor([[turns]])}, batch_size=[1])


class EndAsPlanned(Transform):
    """Reward 1 at the last turn; the conversation ends after its planned number of turns."""

    def _reset(self, tensordict, tensordict_reset):
        tensordict_reset.set("turn", torch.zeros(*tensordict_reset.batch_size, 1, dtype=torch.long))
        return tensordict_reset

    def _step(self, tensordict, next_tensordict):
        turn = tensordict["turn"] + 1
        done = turn >= tensordict["plan"]
        next_tensordict.update({"turn": turn, "done": done, "terminated": done, "reward": done.float(),
                                "plan": tensordict["plan"]})
        return next_tensordict

    def transform_observation_spec(self, spec):
        spec["turn"] = Unbounded(shape=(*spec.shape, 1), dtype=torch.long)
        return spec

    def transform_reward_spec(self, spec):
        spec["reward"] = Unbounded(shape=(*spec.shape, 1))
        return spec


def tool_env(tok, batch_size=1):
    from torchrl.envs.llm.transforms.tools import ToolTransformBase

    class Echo(ToolTransformBase):
        tool_role = "user"

        def _process_batch_item(self, content, index):
            return ["got it"]

    env = ChatEnv.from_dataloader(Planned(), batch_size=(batch_size,), tokenizer=tok)
    return env.append_transform(EndAsPlanned()).append_transform(Echo()).append_transform(InitTracker())


def test_tool_transform_conversations_of_different_lengths_become_linked_turn_rows(lm, tok):
    torch.manual_seed(0)
    turns = sum(PLANNED_TURNS)
    collector = LLMCollector(tool_env(tok), policy=make_policy(lm, tok), dialog_turns_per_batch=turns,
                             total_dialog_turns=turns, postproc=LLMToTokenBatch(pad_token_id=tok.pad_token_id,
                                                                                  layout="turn"))
    try:
        out = next(iter(collector))
    finally:
        collector.shutdown()
    assert out.batch_size[0] == turns
    link, done = out["next_turn_row"][:, 0].tolist(), out["next", "done"].any(1).view(-1).tolist()
    starts = [b for b in range(turns) if b not in link]
    lengths = []
    for b in starts:  # follow each conversation's chain of rows
        n = 1
        while link[b] >= 0:
            assert not done[b], "only a conversation's last turn carries its flags"
            assert link[b] == b + 1  # one env row: a conversation's turns are consecutive
            nxt = out[link[b]]
            held = nxt["tokens"][nxt["attention_mask"] & ~nxt["mask"]]
            assert tok.decode(held.tolist()).endswith("<|im_start|>user\ngot it<|im_end|>\n<|im_start|>assistant\n"), \
                "the tool's reply is part of the next turn's prompt, a hole"
            b, n = link[b], n + 1
        assert done[b]
        lengths.append(n)
    assert sorted(lengths) == sorted(PLANNED_TURNS)  # (TorchRL's primer draws one problem for its specs first)
    assert out["next", "reward"].sum().item() == len(PLANNED_TURNS)


def test_torchrl_refuses_top_k_zero(lm, tok):
    # Pins TorchRL 0.14.1: sampling from the whole vocabulary has to be written top_k=len(tokenizer) (tutorial 13).
    with pytest.raises(ValueError, match="top_k must be positive"):
        TransformersWrapper(lm, tokenizer=tok, input_mode="history", generate=True,
                            generate_kwargs={"max_new_tokens": 2, "do_sample": True, "top_k": 0})


def test_torchrl_wrapper_fails_on_rows_whose_histories_differ_in_length(lm, tok):
    # Pins TorchRL 0.14.1: with two env rows, the first conversation ends and restarts while the second goes on, and
    # TransformersWrapper cannot extend the two histories of different lengths (why tutorial 13 runs one row per env).
    torch.manual_seed(0)
    collector = LLMCollector(tool_env(tok, batch_size=2), policy=make_policy(lm, tok), dialog_turns_per_batch=6,
                             total_dialog_turns=6)
    try:
        with pytest.raises(ValueError, match="zip"):
            next(iter(collector))
    finally:
        collector.shutdown()

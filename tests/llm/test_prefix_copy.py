"""The env policy's KV cache copies the context columns that repeat the last filled row's (a shared system
prompt): the logits stay those of a full forward, and the model is fed fewer tokens."""

import pytest
import torch

from ppo_objectives.llm.env import TokenLMEnv
from ppo_objectives.llm.hf import HFCausalLMAdapter
from ppo_objectives.llm.models import TinyCausalLM, TinyLMConfig
from ppo_objectives.llm.policy import NextTokenLogits
from ppo_objectives.train.digit import DigitTask

transformers = pytest.importorskip("transformers")

SHARED = [5, 6, 7, 8, 9, 10, 11, 12]  # every prompt opens with these eight tokens
TAILS = [[3], [4, 3], [13, 14, 3], [3, 4], [14]]  # then one to three of its own (left padding of 0 to 2)


def _env(num_envs=4, shared=SHARED, seed=0):
    prompts = [shared + tail for tail in TAILS]
    reward = DigitTask("copy", 3).reward
    return TokenLMEnv(prompts, reward, num_envs=num_envs, prompt_len=len(shared) + 3, max_new_tokens=4,
                      vocab_size=16, eos_id=1, seed=seed)  # fmt: skip


def _tiny(block):
    torch.manual_seed(0)
    return TinyCausalLM(TinyLMConfig.preset("pico", vocab_size=16, block_size=block)).eval()


def _llama():
    cfg = transformers.LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    return HFCausalLMAdapter.from_config(cfg).eval()


class _Counted(torch.nn.Module):
    """The model, counting the tokens (attended or not) fed to it."""

    def __init__(self, model):
        super().__init__()
        self.model, self.fed = model, 0

    def forward(self, input_ids, *args, **kwargs):
        self.fed += input_ids.numel()
        return self.model(input_ids, *args, **kwargs)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.model, name)


def _drive(head, env, steps, seed=0, full=None):
    """Sample ``steps`` tokens through partial resets; check every step's logits against ``full``'s."""
    g = torch.Generator().manual_seed(seed)
    td, resets = env.reset(), 0
    for _ in range(steps):
        with torch.no_grad():
            logits = head(td["tokens"], td["attention_mask"], td["position"])
            if full is not None:
                ref = full(td["tokens"], td["attention_mask"], td["position"])
                torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-5)
        resets += int((td["position"] == env.prompt_len).sum())
        td["action"] = torch.multinomial(logits.softmax(-1), 1, generator=g).squeeze(-1)
        _, td = env.step_and_maybe_reset(td)
    return resets


@pytest.mark.parametrize("kind", ["tiny", "llama"])
def test_copied_prefix_gives_the_full_forwards_logits_through_partial_resets(kind):
    env = _env()
    lm = _tiny(env.seq_len) if kind == "tiny" else _llama()
    resets = _drive(NextTokenLogits(lm), env, steps=24, full=NextTokenLogits(lm, use_kv_cache=False))
    assert resets > 8  # rows reset at different steps: filled one or two at a time, copying the prefix


def test_copying_feeds_the_model_fewer_tokens_than_computing_every_column():
    env = _env()
    fed = {}
    for copy in (True, False):
        lm = _Counted(_tiny(env.seq_len))
        head = NextTokenLogits(lm)
        head.copy_prefix = copy
        _drive(head, env, steps=24)
        fed[copy] = lm.fed
    # without copying every reset row feeds its whole prompt of 9 to 11 tokens; with it, mostly its tail
    assert fed[True] < 0.6 * fed[False], fed


def test_the_first_call_fills_one_row_and_copies_it_into_the_others():
    env = _env(num_envs=4)
    lm = _Counted(_tiny(env.seq_len))
    head = NextTokenLogits(lm)
    td = env.reset()
    with torch.no_grad():
        logits = head(td["tokens"], td["attention_mask"], td["position"])
        ref = NextTokenLogits(lm.model, use_kv_cache=False)(td["tokens"], td["attention_mask"], td["position"])
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-5)
    # one window would feed 4 rows x 12 columns; one row alone (at most 10 context columns), then a window of at
    # most 2 uncopied columns for the other three, then the step of 4 rows
    assert lm.fed <= 10 + 3 * 2 + 4 < 4 * 12


def test_a_prompt_shorter_than_the_stored_prefix_copies_only_its_own_context():
    env = _env(num_envs=2)
    lm = _tiny(env.seq_len)
    head, full = NextTokenLogits(lm), NextTokenLogits(lm, use_kv_cache=False)
    td = env.reset()
    with torch.no_grad():
        head(td["tokens"], td["attention_mask"], td["position"])  # the prefix now holds a 9-to-11-token prompt
        short = td.clone()
        short["tokens"][1] = 0
        short["attention_mask"][1] = False
        P = env.prompt_len
        short["tokens"][1, P - 4:P] = torch.tensor(SHARED[:4])  # row 1: a fresh prompt, the prefix's first 4
        short["attention_mask"][1, P - 4:P] = True
        torch.testing.assert_close(head(short["tokens"], short["attention_mask"], short["position"]),
                                   full(short["tokens"], short["attention_mask"], short["position"]))


def test_the_prefix_is_dropped_with_the_weights_that_made_it():
    env = _env(num_envs=3)
    lm = _tiny(env.seq_len)
    head = NextTokenLogits(lm)
    _drive(head, env, steps=6)
    assert head._prefix is not None
    with torch.no_grad():
        for p in lm.parameters():
            p.mul_(1.5)  # new weights: the stored keys and values are those of the old ones
    _drive(head, env, steps=12, seed=1, full=NextTokenLogits(lm, use_kv_cache=False))


def test_prompts_that_share_nothing_take_one_window_as_before():
    env = TokenLMEnv.from_task(DigitTask("reverse", 3, min_digits=3), num_envs=4, seed=0)
    lm = _Counted(_tiny(env.seq_len))
    head = NextTokenLogits(lm)
    td = env.reset()
    with torch.no_grad():
        head(td["tokens"], td["attention_mask"], td["position"])
    assert lm.fed == 4 * env.prompt_len  # one forward of the last P columns of every row
    assert head._prefix is not None  # kept from the window, for the rows filled later

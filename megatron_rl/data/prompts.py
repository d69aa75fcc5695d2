"""JSONL prompt datasets and the resumable iterator that batches them into rollout steps.

``--prompt-data FILE`` holds one JSON object per line. ``--input-key`` names
the prompt, which may be text, a list of chat messages (``[{"role", "content"}]``,
needs ``--apply-chat-template``) or a list of token ids (used as is, no
tokenizer needed). ``--label-key`` names the ground truth handed to the reward
(an empty key means the data has no labels). As in slime, ``--metadata-key``
names a JSON object whose keys join each request's (and so each sample's)
metadata, and ``--tool-key`` a list of tool schemas that the chat template gets
as ``tools=`` and the metadata keeps as ``"tools"``; a line without either key
has none. The whole file is read and
tokenized up front, so every bad line is reported before the first rollout.

A ``.parquet`` file is read in verl's schema instead (``data.verl_parquet``: chat-message prompts, the label
from ``reward_model.ground_truth``, ``data_source`` / ``extra_info`` / ``ability`` as metadata); its rows turn
into the records a JSONL line gives, so every rule below applies to them too (errors name a "row").

Reading is streamed, one line at a time (``read_prompt_records``), and each line may be
at most ``max_line_bytes`` long: a line over the limit is refused by its number as soon as
the reader passes the limit, without reading the rest of it (a 50 MB line otherwise costs
minutes and gigabytes before any check sees it). Bytes that are not UTF-8, a line that is
not one JSON object (a JSON array file, CSV, plain text) and a missing ``--input-key`` are
named by file and line. ``scan_prompt_file`` applies every rule that needs no tokenizer
without keeping the records: the driver runs it before the workers start
(``megatron_rl.runner.preflight``), with the run's ``--max-prompt-line-mib``.

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
from typing import Any, Iterator, Optional, Sequence

from megatron_rl.config.paths import PROMPTS_READ_TWICE, file_problem
from megatron_rl.data.images import ImageProcessor, VisionInputs, image_list, with_image_slots
from megatron_rl.data.types import ENGINE_METADATA_KEYS, GenerateRequest
from megatron_rl.data.verl_parquet import is_parquet, read_verl_records
from megatron_rl.errors import ConfigError

MIB = 1 << 20  # --max-prompt-line-mib counts these
_BOM = b"\xef\xbb\xbf"  # a UTF-8 byte-order mark some editors write at the start of the file
_CONVERT_ARRAY = "jq -c '.[]' FILE > FILE.jsonl"


def read_prompt_records(path: str | os.PathLike, *, input_key: str = "prompt", label_key: Optional[str] = "label",
                        max_line_bytes: Optional[int] = None,
                        flag: str = "--prompt-data") -> Iterator[tuple[int, dict]]:
    """``(line number, JSON object)`` for each non-blank line of a JSONL prompt file, read one line at a time.

    Raises ``ConfigError`` naming ``flag``, the file and the line for: a missing file, a line longer than
    ``max_line_bytes`` (None: no limit), bytes that are not UTF-8, a line that is not a JSON object, a
    missing ``input_key`` or ``label_key`` (None: no labels). An empty file is the caller's to refuse
    (it yields nothing)."""
    path = str(path)
    why = file_problem(path, PROMPTS_READ_TWICE)
    if why == "no such file":
        raise ConfigError(f"{flag} {path}: no such file; give a JSONL file with one JSON object per line")
    if why is not None:
        raise ConfigError(f"{flag} {path}: {why}")
    try:
        f = open(path, "rb")
    except OSError as exc:
        raise ConfigError(f"{flag} {path}: cannot be read ({type(exc).__name__}: {exc.strerror}); check its "
                          "permissions") from None
    with f:
        line_no = 0
        while True:
            raw = f.readline(max_line_bytes + 1) if max_line_bytes is not None else f.readline()
            if not raw:
                return
            line_no += 1
            where = f"{flag} {path} line {line_no}"
            if max_line_bytes is not None and len(raw) > max_line_bytes and not raw.endswith(b"\n"):
                raise ConfigError(
                    f"{where} is longer than the {_size(max_line_bytes)} a prompt line may hold "
                    f"(--max-prompt-line-mib {max_line_bytes / MIB:g}); reading stopped there. Shorten the line "
                    "(a prompt over --rollout-max-prompt-len tokens is refused anyway; keep large fields out of "
                    "the prompt file), or raise --max-prompt-line-mib if the line is meant to be this long")
            if line_no == 1 and raw.startswith(_BOM):
                raw = raw[len(_BOM):]
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ConfigError(
                    f"{where}: byte {exc.start + 1} of the line (0x{raw[exc.start]:02x}) is not UTF-8; prompt "
                    f"files are read as UTF-8: convert the file (e.g. iconv -f latin1 -t utf-8 {path} > "
                    f"{path}.utf8) and pass the converted one") from None
            if line.strip():
                yield line_no, _parse_record(line, where, input_key, label_key, first=line_no == 1)


@dataclass(frozen=True)
class _Keys:
    """Where a record keeps its prompt, label, metadata and tools: the flags' keys for JSONL, verl's for parquet."""

    input_key: str
    label_key: Optional[str]
    metadata_key: Optional[str]
    tool_key: Optional[str]
    unit: str  # how errors name a record's place: "line" (JSONL) or "row" (parquet)
    image_key: Optional[str] = None  # --multimodal-keys' image column (verl's data.image_key); None: no images


def _keys(path: str | os.PathLike, input_key: str, label_key: Optional[str], metadata_key: Optional[str],
          tool_key: Optional[str], image_key: Optional[str] = None) -> _Keys:
    if is_parquet(path):  # verl's schema (data/verl_parquet.py): the reader puts label and metadata here
        return _Keys(input_key, "label", "metadata", None, "row", image_key)
    return _Keys(input_key, label_key or None, metadata_key or None, tool_key or None, "line", image_key)


def _records(path: str | os.PathLike, keys: _Keys, max_line_bytes: Optional[int],
             flag: str) -> Iterator[tuple[int, dict]]:
    if keys.unit == "row":
        return read_verl_records(path, input_key=keys.input_key, flag=flag, image_column=keys.image_key)
    return read_prompt_records(path, input_key=keys.input_key, label_key=keys.label_key,
                               max_line_bytes=max_line_bytes, flag=flag)


def _size(n: int) -> str:
    return f"{n / MIB:g} MiB" if n >= MIB else f"{n} bytes"


def _parse_record(line: str, where: str, input_key: str, label_key: Optional[str], *, first: bool) -> dict:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        if first and line.lstrip().startswith("["):
            raise ConfigError(f"{where} starts a JSON array; prompt files are JSON lines (one JSON object per "
                              f"line): convert it with {_CONVERT_ARRAY}") from None
        raise ConfigError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno}; the line starts "
                          f"{line[:60]!r}); each line must be one JSON object (JSON lines)") from None
    if isinstance(record, list) and first:
        raise ConfigError(f"{where} is a JSON array; prompt files are JSON lines (one JSON object per line): "
                          f"convert it with {_CONVERT_ARRAY}")
    if not isinstance(record, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if input_key not in record:
        raise ConfigError(f"{where}: no key {input_key!r} (--input-key); keys there: "
                          f"{', '.join(map(repr, record))}; pass --input-key with one of them")
    if label_key is not None and label_key not in record:
        raise ConfigError(f"{where}: no key {label_key!r} (--label-key); keys there: "
                          f"{', '.join(map(repr, record))}; pass --label-key with one of them, or "
                          "--label-key '' for data without labels")
    return record


def prompt_kind(value: Any, where: str, input_key: str) -> str:
    """What ``--input-key`` holds: "ids" (token ids, no tokenizer needed), "chat" (messages) or "text"."""
    if isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return "ids"
    if isinstance(value, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in value):
        return "chat"
    if isinstance(value, str):
        return "text"
    raise ConfigError(f"{where}: --input-key {input_key!r} holds a {type(value).__name__}; expected "
                      "text, chat messages [{\"role\", \"content\"}] or token ids")


def prompt_metadata(record: dict, where: str, metadata_key: Optional[str] = "metadata",
                    tool_key: Optional[str] = "tools") -> tuple[dict, Optional[list]]:
    """``(metadata, tools)`` of one prompt record (slime's ``--metadata-key`` / ``--tool-key``): the metadata
    object (``{}`` without the key or for null) with ``"tools"`` added when the record has tools; the tools, a
    list (a JSON string holding one is parsed, as slime does), or None. Raises ``ConfigError`` naming ``where``
    for metadata that is not an object or holds a key the engine sets, and tools that are not a list."""
    metadata: dict = {}
    if metadata_key and record.get(metadata_key) is not None:
        metadata = record[metadata_key]
        if not isinstance(metadata, dict):
            raise ConfigError(f"{where}: --metadata-key {metadata_key!r} holds a {type(metadata).__name__}; "
                              "expected a JSON object (or pass --metadata-key '' to read none)")
        taken = sorted(set(metadata) & set(ENGINE_METADATA_KEYS))
        if taken:
            raise ConfigError(f"{where}: --metadata-key {metadata_key!r} holds {', '.join(map(repr, taken))}, "
                              "which the engine sets in every sample's metadata itself; rename them in the data")
        metadata = dict(metadata)
    tools = None
    if tool_key and record.get(tool_key) is not None:
        tools = record[tool_key]
        if isinstance(tools, str):
            try:
                tools = json.loads(tools)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{where}: --tool-key {tool_key!r} holds a string that is not JSON "
                                  f"({exc.msg}); store the tool schemas as a list") from None
        if not isinstance(tools, list):
            raise ConfigError(f"{where}: --tool-key {tool_key!r} holds a {type(tools).__name__}; expected a list "
                              "of tool schemas (or pass --tool-key '' to read none)")
        metadata["tools"] = tools
    return metadata, tools


@dataclass(frozen=True)
class PromptFileScan:
    """What ``scan_prompt_file`` found: the prompt count and the first line that needs a tokenizer."""

    path: str
    prompts: int
    first_text_line: Optional[int]  # a text or chat prompt (None: token ids only, no tokenizer needed)
    first_chat_line: Optional[int]
    unit: str = "line"  # how the numbers above count: "line" (JSONL) or "row" (verl parquet)


def scan_prompt_file(path: str | os.PathLike, *, input_key: str = "prompt", label_key: Optional[str] = "label",
                     metadata_key: Optional[str] = "metadata", tool_key: Optional[str] = "tools",
                     max_line_bytes: Optional[int], max_prompt_len: Optional[int] = None,
                     flag: str = "--prompt-data") -> PromptFileScan:
    """Every check of ``PromptDataset`` that needs no tokenizer, streamed: memory is one line at most.

    Raises ``ConfigError`` at the first bad line (``read_prompt_records``), at a prompt of the wrong type,
    at a token-id prompt that is empty or longer than ``max_prompt_len``, and for a file without prompts."""
    prompts, first_text, first_chat = 0, None, None
    keys = _keys(path, input_key, label_key, metadata_key, tool_key)
    for line_no, record in _records(path, keys, max_line_bytes, flag):
        where = f"{flag} {path} {keys.unit} {line_no}"
        value = record[input_key]
        kind = prompt_kind(value, where, input_key)
        prompt_metadata(record, where, keys.metadata_key, keys.tool_key)
        if kind == "ids" or value == "":
            _check_prompt_len(len(value), where, max_prompt_len)
        elif first_text is None:
            first_text = line_no
        if kind == "chat" and first_chat is None:
            first_chat = line_no
        prompts += 1
    if not prompts:
        raise ConfigError(_empty_message(flag, str(path)))
    return PromptFileScan(str(path), prompts, first_text, first_chat, keys.unit)


def _check_prompt_len(tokens: int, where: str, max_prompt_len: Optional[int]) -> None:
    if not tokens:
        raise ConfigError(f"{where}: the prompt is empty after tokenization")
    if max_prompt_len is not None and tokens > max_prompt_len:
        raise ConfigError(f"{where}: prompt has {tokens} tokens, more than --rollout-max-prompt-len "
                          f"{max_prompt_len}; raise the limit or remove the prompt")


def _empty_message(flag: str, path: str) -> str:
    return (f"{flag} {path}: the file has no prompts (it is empty or holds only blank lines); give a JSONL file "
            "with one JSON object per line")


@dataclass(frozen=True)
class Prompt:
    """One dataset entry, tokenized; ``line`` is its 1-based line number in the file."""

    prompt_ids: list[int]
    prompt_text: str | None
    label: Any
    line: int
    metadata: dict = field(default_factory=dict)  # --metadata-key's object (+ "tools"), joins the request's
    multimodal_inputs: Optional[VisionInputs] = None  # its images' pixel patches and grids (--multimodal-keys)


@dataclass
class PromptBatch:
    """The prompts of one rollout step; sample each ``n_samples_per_prompt`` times (one GRPO group each)."""

    rollout_id: int
    epoch: int
    requests: list[GenerateRequest]
    n_samples_per_prompt: int = 1


class PromptDataset:
    """All prompts of a JSONL (or verl parquet) file, or of several files in order, tokenized and validated at
    construction. ``Prompt.line`` counts within its own file; errors name the file."""

    def __init__(self, path: "str | os.PathLike | Sequence[str | os.PathLike]", *, tokenizer: Any = None,
                 input_key: str = "prompt", label_key: str | None = "label", metadata_key: str | None = "metadata",
                 tool_key: str | None = "tools", apply_chat_template: bool = False,
                 max_prompt_len: int | None = None, max_line_bytes: int | None = None,
                 flag: str = "--prompt-data", multimodal_keys: Optional[dict] = None,
                 image_processor: Optional[ImageProcessor] = None):
        """``max_line_bytes``: the longest line read (None: no limit). A run passes ``--max-prompt-line-mib``
        (``rollout.build``), which ``runner.preflight`` already applied before the workers started: here it
        only catches a file that changed since. ``multimodal_keys``: ``--multimodal-keys``' map (parsed:
        ``data.images.parse_multimodal_keys``); its image column's images go through ``image_processor`` (the
        model's own, data/images.py) into each prompt's ``multimodal_inputs``, and the prompt's image-pad tokens
        are expanded to each image's feature count before the prompt length is checked."""
        self.paths = [str(path)] if isinstance(path, (str, os.PathLike)) else [str(p) for p in path]
        self.path = " ".join(self.paths)
        self.flag = flag
        self.input_key = input_key
        self.apply_chat_template = apply_chat_template
        self.tokenizer = tokenizer
        self.image_key = (multimodal_keys or {}).get("image")
        self.image_processor = image_processor
        if self.image_key and image_processor is None:
            raise ConfigError(f"--multimodal-keys names the image column {self.image_key!r} but no image processor "
                              "was given (a vision-language --hf-checkpoint's preprocessor_config.json)")
        if apply_chat_template:
            if tokenizer is None:
                raise ConfigError("--apply-chat-template needs a tokenizer; pass an --hf-checkpoint with tokenizer "
                                  "files or drop --apply-chat-template")
            if not getattr(tokenizer, "chat_template", None):
                raise ConfigError(f"--apply-chat-template was given but the tokenizer "
                                  f"({getattr(tokenizer, 'name_or_path', type(tokenizer).__name__)}) has no chat "
                                  "template; drop --apply-chat-template or use an instruct/chat tokenizer")
        self.prompts: list[Prompt] = []
        for one in self.paths:
            keys = _keys(one, input_key, label_key, metadata_key, tool_key, self.image_key)  # parquet: verl's schema
            count = len(self.prompts)
            for line_no, record in _records(one, keys, max_line_bytes, flag):
                self.prompts.append(self._parse(record, line_no, max_prompt_len, one, keys))
            if len(self.prompts) == count:
                raise ConfigError(_empty_message(flag, one))

    def _parse(self, record: dict, line_no: int, max_prompt_len: int | None, path: str, keys: _Keys) -> Prompt:
        where = f"{self.flag} {path} {keys.unit} {line_no}"
        label = record[keys.label_key] if keys.label_key is not None else None
        metadata, tools = prompt_metadata(record, where, keys.metadata_key, keys.tool_key)
        value = record[self.input_key]
        slot = self.image_processor.image_slot(self.tokenizer) if self.image_key and self.image_processor else None
        if slot is not None:  # verl's "<image>" markers become the model's image slot before tokenization
            value = with_image_slots(value, slot)
        prompt_ids, prompt_text = self._tokenize(value, where, tools)
        vision = None
        if self.image_key and self.image_processor is not None:
            column = f"{where} column {self.image_key!r} (--multimodal-keys)"
            vision = self.image_processor.process(image_list(record.get(self.image_key)), column,
                                                  os.path.dirname(os.path.abspath(path)))
            prompt_ids = self.image_processor.expand(prompt_ids, vision, column)
        _check_prompt_len(len(prompt_ids), where, max_prompt_len)
        return Prompt(prompt_ids=prompt_ids, prompt_text=prompt_text, label=label, line=line_no, metadata=metadata,
                      multimodal_inputs=vision)

    def _tokenize(self, value: Any, where: str, tools: Optional[list] = None) -> tuple[list[int], str | None]:
        kind = prompt_kind(value, where, self.input_key)
        if kind == "ids":
            if self.apply_chat_template:
                raise ConfigError(f"{where}: --input-key {self.input_key!r} holds token ids, which cannot take a "
                                  "chat template; drop --apply-chat-template or store text")
            return list(value), None
        is_chat = kind == "chat"
        if self.tokenizer is None:
            raise ConfigError(f"{where}: a text prompt needs a tokenizer; pass an --hf-checkpoint with tokenizer "
                              "files")
        if is_chat and not self.apply_chat_template:
            raise ConfigError(f"{where}: --input-key {self.input_key!r} holds chat messages; pass "
                              "--apply-chat-template")
        if self.apply_chat_template:
            messages = value if is_chat else [{"role": "user", "content": value}]
            extra = {"tools": tools} if tools is not None else {}  # slime's --tool-key
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)
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
        return self.take(self.rollout_batch_size)

    def take(self, count: int) -> PromptBatch:
        """The next ``count`` prompts as one batch (``__next__`` takes ``--rollout-batch-size``; dynamic
        sampling takes ``--over-sampling-batch-size`` at a time). Same stream, same position rules."""
        if count < 1:
            raise ConfigError(f"a prompt batch holds at least one prompt; asked for {count}")
        start_epoch = self.epoch
        requests = []
        for group_index in range(count):
            index = self.epoch_order(self.epoch)[self.offset]
            prompt = self.dataset[index]
            requests.append(GenerateRequest(
                prompt_ids=list(prompt.prompt_ids), group_index=group_index, label=prompt.label,
                prompt_text=prompt.prompt_text, multimodal_inputs=prompt.multimodal_inputs,
                metadata={**prompt.metadata, "prompt_index": index, "line": prompt.line, "epoch": self.epoch}))
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

"""verl's prompt data: a ``.parquet`` ``--prompt-data`` / ``--eval-prompt-data`` file in verl's schema.

verl's preprocessing scripts (its ``examples/data_preprocess/gsm8k.py`` and kin) write one row per prompt:

* ``prompt`` (the column ``--input-key`` names, verl's ``data.prompt_key``): the chat messages, a list of
  ``{"role", "content"}``, rendered through the tokenizer's chat template (``--apply-chat-template``, which
  verl always applies);
* ``data_source``: the dataset's name, which picks verl's default scorer and is passed to a reward function;
* ``reward_model``: ``{"style": ..., "ground_truth": ...}``; ``ground_truth`` is the sample's label;
* ``extra_info`` (optional): a dict handed to the reward function as it is;
* ``ability`` (optional): a tag verl keeps and never reads.

Each row becomes the record a JSONL line would give (``{input_key: prompt, "label": ground_truth, "metadata":
{"data_source", "extra_info", "ability"}}``), so everything after the reader (chat template, prompt length,
metadata in every sample, the reward's ``sample.label``) is the JSONL path's. Rows are counted from 1, as lines
are. A column verl's reward contract never sees is refused by name (its content would be silently dropped).
verl's image column (``images``, its ``data.image_key``) is read when ``--multimodal-keys`` names it (its
images go to ``data/images.py``, as a JSONL record's do) and refused otherwise; ``videos`` is refused. Why refuse rather than
skip: a user who put the label in another column would otherwise train on rewards of ``None``.

pyarrow is imported only when a parquet file is read; it is a core dependency (setup.py), and its absence is one
error line naming the fix.
"""

from __future__ import annotations

import os
from typing import Any, Iterator

from megatron_rl.config.paths import PROMPTS_READ_TWICE, file_problem
from megatron_rl.errors import ConfigError

PARQUET_SUFFIX = ".parquet"
#: the columns of verl's schema besides the prompt's: the ones a reward function gets, and verl's ``ability`` tag
VERL_COLUMNS = ("data_source", "reward_model", "extra_info", "ability")
REQUIRED_COLUMNS = ("data_source", "reward_model")
#: columns refused for what they ask of the run, with the reason
REFUSED_COLUMNS = {
    "images": "images (verl's data.image_key) are read only for a vision-language model: pass --multimodal-keys "
              "'{\"image\": \"images\"}' with a vision-language --hf-checkpoint (docs/vlm.md)",
    "videos": "video prompts (verl's data.video_key) are not built here (the vision-language models take images)",
}
_ROWS_PER_BATCH = 1024  # rows converted to Python at a time: memory stays one batch, not the whole file


def is_parquet(path: str | os.PathLike) -> bool:
    return str(path).endswith(PARQUET_SUFFIX)


def _pyarrow_parquet(flag: str, path: str) -> Any:
    try:
        import pyarrow.parquet as pq  # lazy: only a parquet prompt file needs it
    except ImportError:
        raise ConfigError(f"{flag} {path}: reading parquet needs pyarrow, which is not installed here; "
                          "pip install 'pyarrow>=14' (a dependency of this package: pip install -e . installs it)"
                          ) from None
    return pq


def read_verl_records(path: str | os.PathLike, *, input_key: str = "prompt", flag: str = "--prompt-data",
                      image_column: str | None = None) -> Iterator[tuple[int, dict]]:
    """``(row number, record)`` per row of a verl-format parquet file, one batch of rows in memory at a time.

    The record is ``{input_key: chat messages, "label": reward_model.ground_truth, "metadata": {...}}`` (module
    docstring), plus ``{image_column: the row's images}`` when ``image_column`` (--multimodal-keys' image column)
    is given; the file need not have that column (then no row has images). Raises ``ConfigError`` naming ``flag``, the file, and the row and column where one is at fault."""
    path = str(path)
    why = file_problem(path, PROMPTS_READ_TWICE)
    if why == "no such file":
        raise ConfigError(f"{flag} {path}: no such file; give a parquet file in verl's schema (prompt, data_source, "
                          "reward_model.ground_truth, extra_info)")
    if why is not None:
        raise ConfigError(f"{flag} {path}: {why}")
    pq = _pyarrow_parquet(flag, path)
    try:
        reader = pq.ParquetFile(path)
    except Exception as exc:  # noqa: BLE001 - pyarrow's errors differ by version; any of them means "not parquet"
        raise ConfigError(f"{flag} {path}: not a readable parquet file ({type(exc).__name__}: "
                          f"{str(exc).splitlines()[0] if str(exc) else ''}); write it with pandas' to_parquet or "
                          "datasets' to_parquet, as verl's preprocessing scripts do") from None
    columns = list(reader.schema_arrow.names)
    _check_columns(columns, input_key, flag, path, image_column)
    row = 0
    for batch in reader.iter_batches(batch_size=_ROWS_PER_BATCH):
        for values in batch.to_pylist():
            row += 1
            record = _record(values, input_key, f"{flag} {path} row {row}")
            if image_column is not None:
                record[image_column] = values.get(image_column)
            yield row, record


def _check_columns(columns: list[str], input_key: str, flag: str, path: str, image_column: str | None) -> None:
    where = f"{flag} {path}"
    missing = [c for c in (input_key, *REQUIRED_COLUMNS) if c not in columns]
    if missing:
        fix = (" (--input-key, verl's data.prompt_key, names the prompt column)" if input_key in missing else "")
        raise ConfigError(f"{where}: no column {', '.join(map(repr, missing))}{fix}; columns there: "
                          f"{', '.join(map(repr, columns)) or 'none'}. verl's schema: prompt (chat messages), "
                          "data_source, reward_model {ground_truth}, extra_info")
    for column in columns:
        if column == image_column:
            continue
        if column in REFUSED_COLUMNS:
            raise ConfigError(f"{where}: column {column!r}: {REFUSED_COLUMNS[column]}; drop the column")
        if column != input_key and column not in VERL_COLUMNS:
            raise ConfigError(f"{where}: column {column!r} is not one of verl's schema ({input_key}, "
                              f"{', '.join(VERL_COLUMNS)}); a reward function gets data_source, the ground truth and "
                              "extra_info only, so its values would be dropped: move them into extra_info, or drop "
                              "the column")


def _record(values: dict, input_key: str, where: str) -> dict:
    prompt = values[input_key]
    if not (isinstance(prompt, list) and prompt and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in prompt)):
        raise ConfigError(f"{where} column {input_key!r}: expected chat messages, a non-empty list of "
                          f"{{'role': str, 'content': str}}; got {_shown(prompt)}")
    messages = [{"role": m["role"], "content": m["content"]} for m in prompt]  # pyarrow fills absent struct keys
    data_source = values["data_source"]
    if not isinstance(data_source, str) or not data_source:
        raise ConfigError(f"{where} column 'data_source': expected the dataset's name (a non-empty string), got "
                          f"{_shown(data_source)}")
    reward_model = values["reward_model"]
    if not isinstance(reward_model, dict) or reward_model.get("ground_truth") is None:
        raise ConfigError(f"{where} column 'reward_model': expected {{'ground_truth': ..., 'style': ...}} with a "
                          f"ground truth, got {_shown(reward_model)}")
    extra_info = values.get("extra_info")
    if extra_info is not None and not isinstance(extra_info, dict):
        raise ConfigError(f"{where} column 'extra_info': expected a dict (or null), got {_shown(extra_info)}")
    metadata: dict[str, Any] = {"data_source": data_source, "extra_info": dict(extra_info or {})}
    if values.get("ability") is not None:
        metadata["ability"] = values["ability"]
    return {input_key: messages, "label": reward_model["ground_truth"], "metadata": metadata}


def _shown(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 80 else text[:77] + '...'}"


__all__ = ["PARQUET_SUFFIX", "REFUSED_COLUMNS", "VERL_COLUMNS", "is_parquet", "read_verl_records"]

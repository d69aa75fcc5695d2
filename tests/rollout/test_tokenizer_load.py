"""The tokenizer beside an HF checkpoint is the one that was saved, or a warning says by name why not.

Was: transformers 5 loaded a tokenizer saved beside a ``qwen2`` config.json as ``Qwen2Tokenizer`` (another
pre-tokenizer and decoder: other ids for the same text, and here another decoding), silently; a tokenizer
with more tokens than the model's vocabulary trained on without a word. In-process, real transformers.
"""

from __future__ import annotations

import json
import logging

from megatron_rl.data import synthetic
from megatron_rl.rollout.base import load_tokenizer


def _beside_qwen2(path, vocab_size: int) -> str:
    synthetic.build_tokenizer(str(path))  # a word-level tokenizer saved with save_pretrained
    (path / "config.json").write_text(json.dumps({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"],
                                                  "vocab_size": vocab_size}))
    return str(path)


def test_a_tokenizer_saved_beside_a_qwen2_config_loads_as_saved_and_the_swap_is_named(tmp_path, caplog):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    path = _beside_qwen2(tmp_path / "model", synthetic.VOCAB_SIZE)
    saved_class = json.loads((tmp_path / "model" / "tokenizer_config.json").read_text())["tokenizer_class"]
    auto = AutoTokenizer.from_pretrained(path)
    assert type(auto).__name__ != saved_class  # transformers' swap, which this guards against
    with caplog.at_level(logging.WARNING, logger="megatron_rl"):
        tok = load_tokenizer(path)
    assert type(tok).__name__ == saved_class
    assert f"AutoTokenizer loads it as {type(auto).__name__}, but its tokenizer_config.json names {saved_class}" \
        in caplog.text and "the tokenizer as saved" in caplog.text
    raw = Tokenizer.from_file(str(tmp_path / "model" / "tokenizer.json"))  # what was saved, by tokenizers itself
    assert tok("3 1 4 =")["input_ids"] == raw.encode("3 1 4 =").ids
    assert tok.decode(raw.encode("4 2 5").ids) == raw.decode(raw.encode("4 2 5").ids) == "4 2 5"
    assert auto.decode(raw.encode("4 2 5").ids) != "4 2 5"  # the swapped class decoded other text


def test_a_tokenizer_larger_than_the_vocabulary_or_of_an_unknown_class_is_warned_by_name(tmp_path, caplog):
    path = _beside_qwen2(tmp_path / "model", 12)  # 14 tokens, 12 embedding rows
    with caplog.at_level(logging.WARNING, logger="megatron_rl"):
        load_tokenizer(path)
    assert "has 14 tokens, more than the model's vocabulary (config.json vocab_size 12): ids {12: '8', 13: '9'}" \
        in caplog.text, caplog.text
    caplog.clear()
    config = tmp_path / "model" / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "tokenizer_class": "NoSuchTokenizer"}))
    with caplog.at_level(logging.WARNING, logger="megatron_rl"):
        load_tokenizer(path)
    assert "names NoSuchTokenizer, which this transformers" in caplog.text, caplog.text

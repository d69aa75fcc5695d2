"""verl's parquet schema as --prompt-data (data/verl_parquet.py): rows as verl's gsm8k preprocessing writes them become
prompts rendered through the chat template, the ground truth as label, data_source / extra_info / ability as
metadata; a malformed row or an unknown column is refused naming the file, the row and the column."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from _tokenizer import build_char_tokenizer  # tests/ is on sys.path (conftest)

from megatron_rl.config import parse_config
from megatron_rl.data.prompts import PromptDataset, PromptIterator, scan_prompt_file
from megatron_rl.errors import ConfigError


def gsm8k_row(i, **changes):
    """A row in the shape of verl's examples/data_preprocess/gsm8k.py."""
    row = {"data_source": "openai/gsm8k",
           "prompt": [{"role": "user", "content": f"What is {i} + 1? Let's think step by step and output the final "
                                                  "answer after \"####\"."}],
           "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
           "extra_info": {"split": "train", "index": i, "answer": f"#### {i + 1}", "question": f"What is {i} + 1?"}}
    row.update(changes)
    return row


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), str(path))
    return str(path)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_char_tokenizer(tmp_path_factory.mktemp("tok"))


def test_verl_rows_become_chat_prompts_with_label_and_metadata(tmp_path, tokenizer):
    path = write_parquet(tmp_path / "train.parquet", [gsm8k_row(i) for i in range(3)])
    ds = PromptDataset(path, tokenizer=tokenizer, apply_chat_template=True)
    assert len(ds) == 3
    text = tokenizer.apply_chat_template(gsm8k_row(1)["prompt"], tokenize=False, add_generation_prompt=True)
    assert ds[1].prompt_text == text and ds[1].prompt_ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert (ds[1].label, ds[1].line) == ("2", 2)
    assert ds[1].metadata == {"data_source": "openai/gsm8k", "ability": "math", "extra_info": gsm8k_row(1)["extra_info"]}
    batch = next(PromptIterator(ds, rollout_batch_size=2))
    assert batch.requests[0].metadata["data_source"] == "openai/gsm8k" and batch.requests[1].label == "2"
    scan = scan_prompt_file(path, max_line_bytes=None)
    assert (scan.prompts, scan.first_chat_line) == (3, 1)


@pytest.mark.parametrize("row, says", [
    (gsm8k_row(0, prompt=[]), r"row 2 column 'prompt': expected chat messages, a non-empty list"),
    (gsm8k_row(0, data_source=""), r"row 2 column 'data_source': expected the dataset's name"),
    (gsm8k_row(0, reward_model={"style": "rule", "ground_truth": None}),
     r"row 2 column 'reward_model': expected \{'ground_truth': \.\.\., 'style': \.\.\.\} with a ground truth"),
])
def test_a_malformed_row_is_refused_naming_file_row_and_column(tmp_path, tokenizer, row, says):
    path = write_parquet(tmp_path / "bad.parquet", [gsm8k_row(0), row])
    with pytest.raises(ConfigError, match=rf"^--prompt-data {tmp_path}/bad.parquet {says}"):
        scan_prompt_file(path, max_line_bytes=None)


@pytest.mark.parametrize("changes, says", [
    ({"answer": "2"}, r"column 'answer' is not one of verl's schema .*move them into extra_info, or drop the column"),
    ({"images": ["a.png"]}, r"column 'images': images .* are read only for a vision-language model: pass "
                            r"--multimodal-keys"),
])
def test_an_unknown_or_multimodal_column_is_refused_by_name(tmp_path, changes, says):
    path = write_parquet(tmp_path / "cols.parquet", [gsm8k_row(0, **changes)])
    with pytest.raises(ConfigError, match=rf"^--prompt-data {tmp_path}/cols.parquet: {says}"):
        scan_prompt_file(path, max_line_bytes=None)


def test_missing_columns_and_a_file_that_is_not_parquet_are_refused(tmp_path):
    path = write_parquet(tmp_path / "nolabel.parquet", [{"prompt": gsm8k_row(0)["prompt"], "data_source": "x"}])
    with pytest.raises(ConfigError, match=r"nolabel.parquet: no column 'reward_model'; columns there: 'prompt', "
                                          r"'data_source'"):
        scan_prompt_file(path, max_line_bytes=None)
    fake = tmp_path / "fake.parquet"
    fake.write_text('{"prompt": "hi"}\n')
    with pytest.raises(ConfigError, match=r"fake.parquet: not a readable parquet file \(.*\); write it with pandas"):
        scan_prompt_file(str(fake), max_line_bytes=None)


def test_parquet_needs_the_chat_template_and_takes_no_jsonl_key_flags(tmp_path, tiny_hf_models):
    path = write_parquet(tmp_path / "train.parquet", [gsm8k_row(0)])
    base = ["--hf-checkpoint", tiny_hf_models("qwen2"), "--prompt-data", path, "--rm-type", "gsm8k"]
    with pytest.raises(ConfigError, match=r"is verl's parquet schema, whose prompts are chat messages: pass "
                                          r"--apply-chat-template"):
        parse_config(base)
    with pytest.raises(ConfigError, match=r"--label-key 'answer' does not apply to --prompt-data .*train.parquet"):
        parse_config([*base, "--apply-chat-template", "--label-key", "answer"])
    assert parse_config([*base, "--apply-chat-template"]).data.prompt_data == path


def test_several_files_are_one_dataset_in_order(tmp_path, tokenizer, tiny_hf_models):
    """verl's data.train_files list: --prompt-data FILE FILE (parquet and JSONL may mix)."""
    first = write_parquet(tmp_path / "gsm8k.parquet", [gsm8k_row(0), gsm8k_row(1)])
    second = tmp_path / "more.jsonl"
    second.write_text('{"prompt": "hi", "label": "x"}\n')
    ds = PromptDataset([first, str(second)], tokenizer=tokenizer, apply_chat_template=True)
    assert [(p.label, p.line) for p in ds] == [("1", 1), ("2", 2), ("x", 1)]
    assert ds[2].metadata == {} and ds[0].metadata["data_source"] == "openai/gsm8k"
    cfg = parse_config(["--hf-checkpoint", tiny_hf_models("qwen2"), "--prompt-data", first, str(second),
                        "--apply-chat-template", "--rm-type", "gsm8k"])
    assert cfg.data.prompt_files == (first, str(second)) and cfg.data.prompt_data == [first, str(second)]
    assert parse_config(["--hf-checkpoint", tiny_hf_models("qwen2"), "--prompt-data", first, "--apply-chat-template",
                         "--rm-type", "gsm8k"]).data.prompt_data == first  # one file stays a string
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ConfigError, match=rf"^--prompt-data {empty}: the file has no prompts"):
        PromptDataset([first, str(empty)], tokenizer=tokenizer, apply_chat_template=True)


def test_without_pyarrow_the_refusal_names_the_fix(tmp_path, monkeypatch):
    path = write_parquet(tmp_path / "train.parquet", [gsm8k_row(0)])
    monkeypatch.setitem(__import__("sys").modules, "pyarrow.parquet", None)  # import pyarrow.parquet fails
    with pytest.raises(ConfigError, match=r"train.parquet: reading parquet needs pyarrow, which is not installed here; "
                                          r"pip install 'pyarrow>=14'"):
        scan_prompt_file(path, max_line_bytes=None)

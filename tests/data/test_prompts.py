"""JSONL prompt datasets, chat templates, shuffling and exact resume of the prompt iterator."""

import json

import pytest
from _tokenizer import SPECIAL, build_char_tokenizer  # tests/ is on sys.path (conftest)

from megatron_rl.data.prompts import MIB, PromptDataset, PromptIterator, scan_prompt_file
from megatron_rl.errors import ConfigError

def write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_char_tokenizer(tmp_path_factory.mktemp("tok"))


def test_text_prompts_and_labels(tmp_path, tokenizer):
    data = write_jsonl(tmp_path / "p.jsonl", [{"question": "1+1=", "answer": 2}, "", {"question": "hi", "answer": "x"}])
    ds = PromptDataset(data, tokenizer=tokenizer, input_key="question", label_key="answer")
    assert len(ds) == 2
    assert ds[0].prompt_ids == tokenizer("1+1=")["input_ids"] and tokenizer.decode(ds[0].prompt_ids) == "1+1="
    assert (ds[0].label, ds[0].prompt_text, ds[0].line) == (2, "1+1=", 1)
    assert ds[1].line == 3  # blank lines are skipped but line numbers stay true


def test_chat_template(tmp_path, tokenizer):
    data = write_jsonl(tmp_path / "p.jsonl", [
        {"prompt": "What is 2+2?", "label": "4"},
        {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], "label": "x"},
    ])
    ds = PromptDataset(data, tokenizer=tokenizer, apply_chat_template=True)
    assert ds[0].prompt_text == "<|user|>What is 2+2?\n<|assistant|>"
    assert ds[0].prompt_ids[0] == SPECIAL.index("<|user|>") and ds[0].prompt_ids[-1] == SPECIAL.index("<|assistant|>")
    assert tokenizer.decode(ds[0].prompt_ids) == ds[0].prompt_text
    assert ds[1].prompt_text == "<|system|>Be brief.\n<|user|>Hi\n<|assistant|>"


def test_chat_template_errors(tmp_path, tokenizer):
    data = write_jsonl(tmp_path / "p.jsonl", [{"prompt": [{"role": "user", "content": "Hi"}], "label": 1}])
    with pytest.raises(ConfigError, match="line 1: --input-key 'prompt' holds chat messages; pass --apply-chat-templ"):
        PromptDataset(data, tokenizer=tokenizer)
    plain = build_char_tokenizer(tmp_path / "plain", chat_template=None)
    with pytest.raises(ConfigError, match="--apply-chat-template was given but the tokenizer .* has no chat template; "
                                          "drop --apply-chat-template"):
        PromptDataset(data, tokenizer=plain, apply_chat_template=True)
    with pytest.raises(ConfigError, match="--apply-chat-template needs a tokenizer"):
        PromptDataset(data, apply_chat_template=True)


def test_token_id_prompts_need_no_tokenizer(tmp_path):
    data = write_jsonl(tmp_path / "p.jsonl", [{"prompt": [5, 6, 7], "label": [1]}])
    ds = PromptDataset(data)
    assert ds[0].prompt_ids == [5, 6, 7] and ds[0].prompt_text is None and ds[0].label == [1]


@pytest.mark.parametrize("lines,kwargs,message", [
    (['{"prompt": "a", "label": 1}', '{"prompt": "b", "label": 2'], {},
     r"--prompt-data .*p.jsonl line 2: not valid JSON .*; each line must be one JSON object"),
    (['["a"]'], {}, "line 1 is a JSON array; prompt files are JSON lines .*: convert it with jq -c"),
    (['{"prompt": [1], "label": 1}', '["a"]'], {}, "line 2: expected a JSON object, got list"),
    (['{"prompt": "a", "label": 1}', '{"text": "b", "label": 2}'], {},
     "line 2: no key 'prompt' \\(--input-key\\); keys there: 'text', 'label'; pass --input-key with one of them"),
    (['{"prompt": "a"}'], {}, "line 1: no key 'label' \\(--label-key\\).*--label-key '' for data without labels"),
    (['{"prompt": 3, "label": 1}'], {}, "line 1: --input-key 'prompt' holds a int"),
    (['{"prompt": "", "label": 1}'], {}, "line 1: the prompt is empty"),
    (['{"prompt": "abcdef", "label": 1}'], {"max_prompt_len": 4},
     "line 1: prompt has 6 tokens, more than --rollout-max-prompt-len 4"),
    ([], {}, "the file has no prompts"),
])
def test_bad_files_name_flag_line_and_fix(tmp_path, tokenizer, lines, kwargs, message):
    data = write_jsonl(tmp_path / "p.jsonl", lines)
    with pytest.raises(ConfigError, match=message):
        PromptDataset(data, tokenizer=tokenizer, **kwargs)


def test_missing_file_and_missing_tokenizer(tmp_path):
    with pytest.raises(ConfigError, match="--prompt-data /no/such.jsonl: no such file"):
        PromptDataset("/no/such.jsonl")
    data = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "text", "label": 1}])
    with pytest.raises(ConfigError, match="line 1: a text prompt needs a tokenizer"):
        PromptDataset(data)
    unlabeled = write_jsonl(tmp_path / "u.jsonl", [{"prompt": [3, 4]}])
    assert PromptDataset(unlabeled, label_key="")[0].label is None  # --label-key '': data without labels


def _read_with_dataset(path, **kwargs):
    PromptDataset(path, **kwargs)


def _read_with_scan(path, **kwargs):
    scan_prompt_file(path, max_line_bytes=kwargs.pop("max_line_bytes", None), **kwargs)


READERS = pytest.mark.parametrize("read", [_read_with_dataset, _read_with_scan], ids=["dataset", "scan"])


def _labelled(n_bytes):
    """One JSON line of exactly ``n_bytes`` bytes (without its newline): a token-id prompt and a long label."""
    head = '{"prompt": [1], "label": "'
    return head + "x" * (n_bytes - len(head) - 2) + '"}'


@READERS
@pytest.mark.parametrize("content,message", [
    (b'{"prompt": [1], "label": 1}\n{"prompt": [2], "label": "caf\xe9"}\n',
     r" line 2: byte 30 of the line \(0xe9\) is not UTF-8; prompt files are read as UTF-8: convert the file "
     r"\(e.g. iconv -f latin1 -t utf-8"),
    (b'[\n  {"prompt": [1], "label": 1}\n]\n', r" line 1 starts a JSON array; prompt files are JSON lines \(one "
     r"JSON object per line\): convert it with jq -c '\.\[\]' FILE > FILE\.jsonl"),
    (b"prompt,label\n1+1,2\n", r" line 1: not valid JSON \(Expecting value at column 1; the line starts "
     r"'prompt,label\\n'\); each line must be one JSON object \(JSON lines\)"),
    (b'{"prompt": [1], "label": 1}\n{"question": [2], "label": 2}\n',
     r" line 2: no key 'prompt' \(--input-key\); keys there: 'question', 'label'"),
    (b"\n  \n", r": the file has no prompts \(it is empty or holds only blank lines\)"),
])
def test_malformed_files_are_named_by_line_in_both_readers(tmp_path, read, content, message):
    """The dataset (built after start-up) and the driver's pre-flight scan refuse with the same words."""
    path = tmp_path / "p.jsonl"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=f"--prompt-data {path}" + message):
        read(path)


@READERS
def test_a_utf8_byte_order_mark_is_not_a_json_error(tmp_path, read):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": [1, 2], "label": 1}\n')
    read(path)


@READERS
def test_a_line_over_the_limit_is_refused_by_number_without_reading_it_whole(tmp_path, read):
    """An 8 MiB line under a 1 MiB limit: refused at line 2 after reading about the limit, not the line (the
    issue's 50 MB line was refused after 144 s at 16.6 GB); a line of exactly the limit is read."""
    import tracemalloc

    path = tmp_path / "big.jsonl"
    path.write_text('{"prompt": [1], "label": 1}\n' + _labelled(8 * MIB) + "\n")
    tracemalloc.start()
    try:
        with pytest.raises(ConfigError) as exc:
            read(path, max_line_bytes=MIB)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert str(exc.value).startswith(f"--prompt-data {path} line 2 is longer than the 1 MiB a prompt line may hold "
                                     "(--max-prompt-line-mib 1); reading stopped there"), exc.value
    assert "raise --max-prompt-line-mib" in str(exc.value)
    assert peak < 3 * MIB, peak  # the limit's worth of line 2 and the reader's buffer, never its 8 MiB
    path.write_text(_labelled(MIB) + "\n" + _labelled(MIB))  # exactly the limit, with and without a newline
    read(path, max_line_bytes=MIB)


def test_an_unreadable_file_is_named(tmp_path, monkeypatch):
    """What open() raises for a file without read permission (played: the tests may run as root, who reads it)."""
    import megatron_rl.data.prompts as prompts

    def refuse(path, mode="r", *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": [1], "label": 0}])
    monkeypatch.setattr(prompts, "open", refuse, raising=False)
    with pytest.raises(ConfigError, match=f"^--prompt-data {path}: cannot be read \\(PermissionError: Permission "
                                          "denied\\); check its permissions$"):
        scan_prompt_file(path, max_line_bytes=MIB)


def test_scan_counts_prompts_and_finds_what_needs_a_tokenizer(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": [1], "label": 0}, "", {"prompt": "hi", "label": 1},
                                             {"prompt": [{"role": "user", "content": "x"}], "label": 2}])
    scan = scan_prompt_file(path, max_line_bytes=MIB)
    assert (scan.prompts, scan.first_text_line, scan.first_chat_line) == (3, 3, 4)
    ids_only = write_jsonl(tmp_path / "ids.jsonl", [{"prompt": [1, 2, 3], "label": 0}])
    assert scan_prompt_file(ids_only, max_line_bytes=MIB).first_text_line is None
    with pytest.raises(ConfigError, match="line 1: prompt has 3 tokens, more than --rollout-max-prompt-len 2"):
        scan_prompt_file(ids_only, max_line_bytes=MIB, max_prompt_len=2)
    with pytest.raises(ConfigError, match=r"--eval-prompt-data aime .*ids.jsonl line 1: no key 'q' \(--input-key\)"):
        scan_prompt_file(ids_only, input_key="q", max_line_bytes=MIB, flag="--eval-prompt-data aime")


def numbered_dataset(tmp_path, n=7):
    return PromptDataset(write_jsonl(tmp_path / "p.jsonl", [{"prompt": [i + 1], "label": i} for i in range(n)]))


def labels(batch):
    return [r.label for r in batch.requests]


def test_batches_cross_epochs_without_dropping(tmp_path):
    it = PromptIterator(numbered_dataset(tmp_path), rollout_batch_size=3, n_samples_per_prompt=4)
    batches = [next(it) for _ in range(3)]
    assert [labels(b) for b in batches] == [[0, 1, 2], [3, 4, 5], [6, 0, 1]]
    assert [b.epoch for b in batches] == [0, 0, 0] and batches[2].requests[1].metadata["epoch"] == 1
    assert [r.group_index for r in batches[2].requests] == [0, 1, 2]
    assert batches[2].rollout_id == 2 and batches[2].n_samples_per_prompt == 4
    assert batches[0].requests[2].metadata == {"prompt_index": 2, "line": 3, "epoch": 0}


def test_shuffle_is_a_seeded_permutation_per_epoch(tmp_path):
    ds = numbered_dataset(tmp_path)
    it = PromptIterator(ds, rollout_batch_size=7, shuffle=True, seed=5)
    e0, e1 = labels(next(it)), labels(next(it))
    assert sorted(e0) == sorted(e1) == list(range(7)) and e0 != e1
    again = PromptIterator(ds, rollout_batch_size=7, shuffle=True, seed=5)
    assert labels(next(again)) == e0
    assert labels(next(PromptIterator(ds, rollout_batch_size=7, shuffle=True, seed=6))) != e0


def test_state_dict_resumes_exactly(tmp_path):
    ds = numbered_dataset(tmp_path)
    straight = PromptIterator(ds, rollout_batch_size=3, shuffle=True, seed=1)
    expected = [labels(next(straight)) for _ in range(8)]
    first = PromptIterator(ds, rollout_batch_size=3, shuffle=True, seed=1)
    head = [labels(next(first)) for _ in range(3)]
    state = json.loads(json.dumps(first.state_dict()))  # survives a JSON round trip (resume_state.json)
    resumed = PromptIterator(numbered_dataset(tmp_path), rollout_batch_size=3, shuffle=True, seed=1)
    resumed.load_state_dict(state)
    tail = [next(resumed) for _ in range(5)]
    assert head + [labels(b) for b in tail] == expected
    assert tail[0].rollout_id == 3
    with pytest.raises(ConfigError, match="seed was 1 when saved and is 2 now \\(--rollout-seed changed\\)"):
        PromptIterator(ds, rollout_batch_size=3, shuffle=True, seed=2).load_state_dict(state)
    with pytest.raises(ConfigError, match="num_prompts was 7 when saved and is 5 now \\(--prompt-data changed\\)"):
        PromptIterator(numbered_dataset(tmp_path, 5), rollout_batch_size=3, shuffle=True, seed=1).load_state_dict(state)


def test_iterator_flags_are_checked(tmp_path):
    ds = numbered_dataset(tmp_path)
    with pytest.raises(ConfigError, match="--rollout-batch-size=0 is invalid"):
        PromptIterator(ds, rollout_batch_size=0)
    with pytest.raises(ConfigError, match="--n-samples-per-prompt=0 is invalid"):
        PromptIterator(ds, rollout_batch_size=2, n_samples_per_prompt=0)


def test_take_draws_from_the_same_stream_as_next(tmp_path):
    """Dynamic sampling draws --over-sampling-batch-size prompts at a time from the rollout's stream."""
    whole = PromptIterator(numbered_dataset(tmp_path, 5), rollout_batch_size=4, shuffle=True, seed=3)
    parts = PromptIterator(numbered_dataset(tmp_path, 5), rollout_batch_size=4, shuffle=True, seed=3)
    expected = [r.metadata["prompt_index"] for _ in range(3) for r in next(whole).requests]
    drawn = [r.metadata["prompt_index"] for k in (3, 2, 4, 3) for r in parts.take(k).requests]
    assert drawn == expected and parts.state_dict()["offset"] == whole.state_dict()["offset"]
    assert [r.group_index for r in parts.take(3).requests] == [0, 1, 2]
    with pytest.raises(ConfigError, match="at least one prompt; asked for 0"):
        parts.take(0)


def test_a_prompt_path_that_is_not_a_regular_file_is_named_for_what_it_is(tmp_path):
    """Was: a FIFO (mkfifo, or --prompt-data <(...)) read "no such file"; the prompts are read more than once, so
    a pipe is refused saying so, before anything opens it (opening a FIFO waits for a writer: no hang here).
    Every reader of a prompt path: the flag validation and the dataset's reader (eval sets too)."""
    import os

    from megatron_rl.config import parse_config
    from megatron_rl.models.hf_tiny import build_tiny_hf_model

    fifo = tmp_path / "prompts.fifo"
    os.mkfifo(fifo)
    link = tmp_path / "gone.jsonl"
    link.symlink_to(tmp_path / "nowhere.jsonl")
    cases = {str(fifo): r"is a FIFO \(named pipe\), not a regular file: the prompts are read more than once .*"
                        r"which a pipe cannot give; write its content to a file first",
             str(tmp_path): "is a directory, not a file",
             str(link): r"is a dangling symlink \(to .*nowhere.jsonl\)"}
    hf = build_tiny_hf_model("qwen2", tmp_path / "hf")
    for path, message in cases.items():
        with pytest.raises(ConfigError, match=rf"--prompt-data {path}: {message}"):
            PromptDataset(path)
        with pytest.raises(ConfigError, match=rf"--prompt-data {path}: {message}"):
            parse_config(["--hf-checkpoint", hf, "--prompt-data", path])
        with pytest.raises(ConfigError, match=rf"--eval-prompt-data {path}: {message}"):
            parse_config(["--hf-checkpoint", hf, "--prompt-data", str(write_jsonl(tmp_path / "p.jsonl", [
                {"prompt": [3], "label": 1}])), "--eval-prompt-data", path])


TOOLS_TEMPLATE = ("{% if tools %}<|system|>tools:{% for t in tools %} {{ t['name'] }}{% endfor %}{{ '\\n' }}{% endif %}"
                  "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                  "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def test_metadata_and_tools_keys_as_slime_reads_them(tmp_path):
    """slime's --metadata-key / --tool-key: the metadata object joins each request's metadata beside the place
    keys (so every sample and the reward see it); tools (a list, or a JSON string of one) reach the chat
    template as tools= and the metadata as 'tools'; lines without the keys have neither; '' reads none."""
    tok = build_char_tokenizer(tmp_path / "tok", chat_template=TOOLS_TEMPLATE)
    calc = [{"name": "calc", "parameters": {}}]
    data = write_jsonl(tmp_path / "p.jsonl", [
        {"prompt": "2+2?", "label": "4", "metadata": {"task_id": 7, "lang": "en"}, "tools": calc},
        {"prompt": "hi", "label": "x", "tools": json.dumps(calc)},
        {"prompt": "yo", "label": "y", "metadata": None},
    ])
    ds = PromptDataset(data, tokenizer=tok, apply_chat_template=True)
    assert ds[0].prompt_text == "<|system|>tools: calc\n<|user|>2+2?\n<|assistant|>"
    assert ds[0].metadata == {"task_id": 7, "lang": "en", "tools": calc}
    assert ds[1].metadata == {"tools": calc} and ds[1].prompt_text.startswith("<|system|>tools: calc\n")
    assert ds[2].metadata == {} and ds[2].prompt_text == "<|user|>yo\n<|assistant|>"
    request = next(PromptIterator(ds, rollout_batch_size=1)).requests[0]
    assert request.metadata == {"task_id": 7, "lang": "en", "tools": calc, "prompt_index": 0, "line": 1, "epoch": 0}
    off = PromptDataset(data, tokenizer=tok, apply_chat_template=True, metadata_key="", tool_key="")
    assert off[0].metadata == {} and off[0].prompt_text == "<|user|>2+2?\n<|assistant|>"
    plain = PromptDataset(data, tokenizer=tok)  # no chat template: the tools are kept in the metadata only
    assert plain[0].prompt_text == "2+2?" and plain[0].metadata["tools"] == calc


@pytest.mark.parametrize("record, message", [
    ({"metadata": "task 7"}, "line 1: --metadata-key 'metadata' holds a str; expected a JSON object"),
    ({"metadata": {"line": 3, "turns": 1}}, "holds 'line', 'turns', which the engine sets in every sample's metadata"),
    ({"tools": {"name": "calc"}}, "line 1: --tool-key 'tools' holds a dict; expected a list of tool schemas"),
    ({"tools": "[{oops"}, "line 1: --tool-key 'tools' holds a string that is not JSON"),
])
def test_bad_metadata_and_tools_are_named_by_line_in_both_readers(tmp_path, tokenizer, record, message):
    data = write_jsonl(tmp_path / "p.jsonl", [{"prompt": [5, 6], "label": 1, **record}])
    with pytest.raises(ConfigError, match=message):
        PromptDataset(data, tokenizer=tokenizer)
    with pytest.raises(ConfigError, match=message):
        scan_prompt_file(data, max_line_bytes=MIB)

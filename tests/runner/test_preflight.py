"""The driver's pre-flight (``runner.preflight``): every input a run can be refused for before its workers start.

The issue's class: each of these was refused only after the workers had started (18-28 s in, with rank 1's
gloo traceback above the error line), or not at all (non-UTF-8 data: a raw ``UnicodeDecodeError``, exit 1).
Here each case goes through ``preflight(cfg)``, the function ``train.main`` calls on rank 0 before ``run``,
with a config parsed from flags as a launch parses it; the servers are real sockets on 127.0.0.1. That
``main`` calls it before ``run`` and exits 2 with one line: the last test. What can only fail after the
workers started ends the other ranks quietly: tests/config/test_train_startup_errors.py.
"""

from __future__ import annotations

import http.server
import json
import os
import re
import shutil
import socket
import sys
import threading

import pytest
from _tokenizer import build_char_tokenizer  # tests/ is on sys.path (conftest)

from megatron_rl.config import parse_config
from megatron_rl.data.prompts import MIB
from megatron_rl.errors import ConfigError, EngineError
from megatron_rl.infra.ports import free_port
from megatron_rl.runner.preflight import preflight

PROBE_TIMEOUT_S = 0.5  # the configured bound of one request to a server that never answers


@pytest.fixture(scope="module")
def hf_without_tokenizer(tiny_hf_models):
    return tiny_hf_models("qwen2")  # config.json and weights only


@pytest.fixture(scope="module")
def hf_with_tokenizer(tiny_hf_models, tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_tok") / "model"
    shutil.copytree(tiny_hf_models("qwen2"), path)
    build_char_tokenizer(path)
    return str(path)


def _lines(*records) -> bytes:
    return b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in records)


OK = {"prompt": "1+1=", "label": "2"}
IDS = {"prompt": [5, 6, 7], "label": "2"}
BIG = b'{"prompt": "x", "label": "' + b"y" * (2 * MIB) + b'"}'

# (id, file content, extra flags, tokenizer in --hf-checkpoint, what the refusal says after "--prompt-data PATH")
CASES = [
    ("empty", b"", [], True, r": the file has no prompts \(it is empty or holds only blank lines\)"),
    ("not-json-lines", b"What is 1+1?\t2\n", [], True,
     r" line 1: not valid JSON \(Expecting value at column 1; the line starts 'What is 1\+1\?\\t2\\n'\); each line must "
     r"be one JSON object \(JSON lines\)"),
    ("json-array", json.dumps([OK, OK], indent=2).encode(), [], True,
     r" line 1 starts a JSON array; prompt files are JSON lines \(one JSON object per line\): convert it with jq -c"),
    ("json-array-one-line", json.dumps([OK, OK]).encode(), [], True, r" line 1 is a JSON array; .* jq -c"),
    ("missing-input-key", _lines(OK, OK, {"question": "3+3=", "label": "6"}), [], True,
     r" line 3: no key 'prompt' \(--input-key\); keys there: 'question', 'label'; pass --input-key with one of them"),
    ("enormous-line", _lines(OK, BIG, OK), ["--max-prompt-line-mib", "1"], True,
     r" line 2 is longer than the 1 MiB a prompt line may hold \(--max-prompt-line-mib 1\); reading stopped there\. "
     r"Shorten the line .* or raise --max-prompt-line-mib"),
    ("not-utf8", _lines(OK, b'{"prompt": "caf\xe9", "label": "x"}'), [], True,
     r" line 2: byte 16 of the line \(0xe9\) is not UTF-8; prompt files are read as UTF-8: convert the file"),
    ("hf-without-tokenizer", _lines(IDS, OK), [], False,
     r" line 2 holds a text prompt, which needs a tokenizer, but --hf-checkpoint .* holds no tokenizer files "
     r"\(none of tokenizer.json, .*\); copy the base model's tokenizer files there, or store the prompts as token ids"),
    ("chat-without-template", _lines(OK, {"prompt": [{"role": "user", "content": "hi"}], "label": "x"}), [], True,
     r" line 2: --input-key 'prompt' holds chat messages; pass --apply-chat-template"),
    ("token-ids-too-long", _lines(IDS), ["--rollout-max-prompt-len", "2"], False,
     r" line 1: prompt has 3 tokens, more than --rollout-max-prompt-len 2"),
]


@pytest.mark.parametrize("content, extra, tokenizer, message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_each_bad_prompt_input_is_refused_before_the_workers_start(tmp_path, hf_with_tokenizer,
                                                                   hf_without_tokenizer, content, extra, tokenizer,
                                                                   message):
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(content)
    hf = hf_with_tokenizer if tokenizer else hf_without_tokenizer
    cfg = parse_config(["--hf-checkpoint", hf, "--prompt-data", str(path), *extra])
    with pytest.raises(ConfigError, match="^--prompt-data " + str(path) + message):
        preflight(cfg)


def test_eval_sets_are_checked_by_name_and_good_data_passes(tmp_path, hf_with_tokenizer, hf_without_tokenizer):
    good = tmp_path / "good.jsonl"
    good.write_bytes(_lines(OK, IDS))
    bad = tmp_path / "aime.jsonl"
    bad.write_bytes(_lines(OK, {"problem": "x", "label": "1"}))
    preflight(parse_config(["--hf-checkpoint", hf_with_tokenizer, "--prompt-data", str(good)]))
    ids_only = tmp_path / "ids.jsonl"
    ids_only.write_bytes(_lines(IDS, IDS))  # token ids need no tokenizer
    preflight(parse_config(["--hf-checkpoint", hf_without_tokenizer, "--prompt-data", str(ids_only)]))
    cfg = parse_config(["--hf-checkpoint", hf_with_tokenizer, "--prompt-data", str(good),
                        "--eval-prompt-data", "gsm8k", str(good), "aime", str(bad)])
    with pytest.raises(ConfigError, match=f"^--eval-prompt-data aime {bad} line 2: no key 'prompt'"):
        preflight(cfg)


class _Server:
    """A tiny HTTP server on 127.0.0.1 answering every GET with ``status`` and ``body``."""

    def __init__(self, status: int, body: bytes):
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def bad_servers():
    """A closed port, a socket that accepts connections and never answers, garbage JSON, HTTP 500."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # the kernel completes the handshake; nothing ever reads or answers
    garbage = _Server(200, b"<html>not json")
    failing = _Server(500, b"scheduler crashed")
    urls = {"closed": f"http://127.0.0.1:{free_port()}", "silent": f"http://127.0.0.1:{silent.getsockname()[1]}",
            "garbage": garbage.url, "failing": failing.url}
    yield urls
    silent.close()
    garbage.close()
    failing.close()


def _sglang_cfg(hf, prompts, tmp_path, *urls):
    return parse_config(["--hf-checkpoint", hf, "--prompt-data", str(prompts), "--rollout-backend", "sglang",
                         "--update-weight-transport", "disk", "--update-weight-disk-dir", str(tmp_path / "w"),
                         "--rollout-engine-urls", *urls])


def test_engine_urls_that_do_not_answer_as_sglang_are_named_with_what_they_answered(tmp_path, bad_servers,
                                                                                     hf_without_tokenizer):
    prompts = tmp_path / "ids.jsonl"
    prompts.write_bytes(_lines(IDS))
    cfg = _sglang_cfg(hf_without_tokenizer, prompts, tmp_path, *bad_servers.values())
    with pytest.raises(EngineError) as exc:
        preflight(cfg, engine_timeout_s=PROBE_TIMEOUT_S)
    lines = str(exc.value).splitlines()
    assert lines[0] == ("--rollout-engine-urls: 4 server(s) do not answer as running SGLang servers (checked before "
                        "the workers started):")
    said = dict(line[4:].split(": ", 1) for line in lines[1:5])  # "  - URL: what" in the order given
    assert list(said) == list(bad_servers.values())
    assert said[bad_servers["closed"]].startswith("GET /health: connection refused"), said
    assert said[bad_servers["silent"]] == f"GET /health: timeout: no reply within {PROBE_TIMEOUT_S:g} s", said
    assert said[bad_servers["garbage"]] == (f"GET /model_info: SGLang server {bad_servers['garbage']} answered "
                                            "/model_info with a body that is not JSON: '<html>not json'"), said
    assert said[bad_servers["failing"]] == "GET /health: HTTP 500: scheduler crashed", said
    assert lines[5].startswith("start them (python -m sglang.launch_server ...) and wait until GET /health answers "
                               "200, or fix the URLs")


def test_a_running_sglang_server_passes(tmp_path, hf_without_tokenizer):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "rollout"))
    from sglang_standin import SGLangStandIn  # tests/rollout/, put on sys.path above

    prompts = tmp_path / "ids.jsonl"
    prompts.write_bytes(_lines(IDS))
    with SGLangStandIn(hf_without_tokenizer) as server:
        preflight(_sglang_cfg(hf_without_tokenizer, prompts, tmp_path, server.url), engine_timeout_s=10)


def test_main_refuses_in_preflight_before_run_with_one_error_line(tmp_path, hf_without_tokenizer, monkeypatch,
                                                                  capsys):
    """Non-UTF-8 data, which used to end in a raw UnicodeDecodeError and exit 1 after the workers started."""
    from megatron_rl import train

    def run(cfg):
        raise AssertionError("run() started: the refusal came after the workers started")

    monkeypatch.setattr(train, "run", run)
    monkeypatch.setenv("RANK", "0")
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(_lines(IDS, b'{"prompt": [1], "label": "\xe9t\xe9"}'))
    assert train.main(["--hf-checkpoint", hf_without_tokenizer, "--prompt-data", str(path)]) == 2
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if line.startswith("error:")] == [
        f"error: --prompt-data {path} line 2: byte 27 of the line (0xe9) is not UTF-8; prompt files are read as "
        f"UTF-8: convert the file (e.g. iconv -f latin1 -t utf-8 {path} > {path}.utf8) and pass the converted one"]
    assert "Traceback" not in err


USER_MODULE = """
CONSTANT = 3
REGISTRY_NOT_DICT = [1]
EMPTY = {}
BAD_ENTRIES = {"t": 3}
TWO_ARG_TOOL = {"t": lambda a, b: ""}


def one(a):
    return 1.0


def two(a, b):
    return True


def three(a, b, c):
    return []
"""

# (flag, value: {mod} the module above, {syntax} a file that does not parse, what the refusal says after the value)
USER_CODE_CASES = [
    ("--custom-generate-function-path", "{mod}:missing", r": module '.*user_mod.py' has no 'missing'; callables "
                                                         r"there: one, three, two"),
    ("--custom-generate-function-path", "{mod}:CONSTANT", r": 'CONSTANT' in '.*user_mod.py' is a int, not a function"),
    ("--custom-generate-function-path", "{syntax}:broken", r": cannot import '.*broken.py' \(SyntaxError: .*\) "
                                                           r"\(line 1 of .*broken.py\)"),
    ("--custom-generate-function-path", "no_such_rollout_mod:gen", r": cannot import 'no_such_rollout_mod' "
                                                                   r"\(ModuleNotFoundError: .*\); put the module on "
                                                                   r"PYTHONPATH or give a file path like "
                                                                   r"path/to/no_such_rollout_mod.py:gen"),
    ("--custom-generate-function-path", "{mod}:one", r": one\(a\) cannot be called as fn\(request, sampling, engine\)"),
    ("--rollout-function-path", "{mod}:three", r": three\(a, b, c\) cannot be called as fn\(rollout_id, requests, "
                                               r"sampling, engine\)"),
    ("--agent-function-path", "{mod}:three", r": three\(a, b, c\) cannot be called as agent\(base_url, task\)"),
    ("--custom-rm-path", "{mod}:two", r": two\(a, b\) cannot be called as fn\(sample\)"),
    ("--custom-rm-path", "{mod}:CONSTANT", r": 'CONSTANT' in '.*user_mod.py' is a int, not a function"),
    ("--custom-reward-function-path", "{mod}:three", r": parameter 'a' has no default and verl's call does not "
                                                     r"give it \(it gives data_source, solution_str, ground_truth, "
                                                     r"extra_info\)"),
    ("--dynamic-sampling-filter-path", "no_such_filters.keep", r": cannot import 'no_such_filters' .*give a file path "
                                                               r"like path/to/no_such_filters.py:keep"),
    ("--dynamic-sampling-filter-path", "{mod}:one", r": one\(a\) cannot be called as fn\(args, samples\)"),
    ("--custom-advantage-function-path", "{mod}:one", r": one\(a\) cannot be called as fn\(args, rollout_data\)"),
    ("--tools", "{mod}:REGISTRY_NOT_DICT", r": list, not a dict of tool name -> callable"),
    ("--tools", "{mod}:EMPTY", r": the registry is empty"),
    ("--tools", "{mod}:BAD_ENTRIES", r": entries t are not name -> callable"),
    ("--tools", "{mod}:TWO_ARG_TOOL", r" \(tool 't'\): <lambda>\(a, b\) cannot be called as tool\(arguments: dict\)"),
    ("--tools", "no_such_tools:TOOLS", r": cannot import 'no_such_tools' .*give a file path like "
                                       r"path/to/no_such_tools.py:TOOLS"),
]


def test_the_user_code_cases_cover_every_entry_point():
    from megatron_rl.rollout.entry_points import USER_CODE

    assert {c[0] for c in USER_CODE_CASES} == {e.flag for e in USER_CODE}


@pytest.mark.parametrize("flag, value, says", USER_CODE_CASES,
                         ids=[f"{c[0][2:]}-{c[1].rpartition(':')[2] or c[1]}" for c in USER_CODE_CASES])
def test_every_user_code_flag_is_imported_and_checked_before_the_workers_start(tmp_path, hf_without_tokenizer, flag,
                                                                               value, says):
    """The class "late refusals of user code": each was found 17-115 s in, once the model was built (the rollout
    imported them); the pre-flight walks ``rollout.entry_points.USER_CODE`` with the run's own loaders."""
    prompts = tmp_path / "ids.jsonl"
    prompts.write_bytes(_lines(IDS))
    mod = tmp_path / "user_mod.py"
    mod.write_text(USER_MODULE)
    (tmp_path / "broken.py").write_text("def broken(:\n    pass\n")
    value = value.format(mod=mod, syntax=tmp_path / "broken.py")
    extra = (["--custom-generate-function-path", "megatron_rl.rollout.agent:generate"] if flag == "--tools" else
             ["--n-samples-per-prompt", "2"] if flag == "--dynamic-sampling-filter-path" else [])
    cfg = parse_config(["--hf-checkpoint", hf_without_tokenizer, "--prompt-data", str(prompts), flag, value, *extra])
    with pytest.raises(ConfigError) as exc:
        preflight(cfg)
    assert re.match(re.escape(f"{flag} {value}") + says, str(exc.value)), str(exc.value)
    assert "\n" not in str(exc.value)


def test_a_sandbox_this_machine_cannot_give_is_refused_before_the_workers_start(tmp_path, hf_without_tokenizer):
    """--rm-type code and the sandboxed python tool start the sandbox once in the pre-flight: an interpreter the
    sandbox cannot run, or a wall bound the tool loop would not wait for, is one line before any worker."""
    prompts = tmp_path / "ids.jsonl"
    prompts.write_bytes(_lines(IDS))
    base = ["--hf-checkpoint", hf_without_tokenizer, "--prompt-data", str(prompts)]
    with pytest.raises(ConfigError, match=r"^the sandbox cannot run Python on this machine \(/nonexistent/python: "
                                          r".*give --sandbox-python an interpreter"):
        preflight(parse_config(base + ["--rm-type", "code", "--sandbox-python", "/nonexistent/python"]))
    agent = ["--custom-generate-function-path", "megatron_rl.rollout.agent:generate", "--tools",
             "megatron_rl.rollout.agent.sandbox_tools:TOOLS"]
    with pytest.raises(ConfigError, match=r"^--sandbox-wall-seconds 30 must be below --tool-timeout 30"):
        preflight(parse_config(base + agent + ["--sandbox-wall-seconds", "30"]))


def test_a_reward_server_url_nothing_listens_at_is_refused_before_the_workers_start(tmp_path, hf_without_tokenizer):
    """--rm-url at a closed port was found after a whole rollout; a listening server passes (nothing is posted)."""
    prompts = tmp_path / "ids.jsonl"
    prompts.write_bytes(_lines(IDS))
    port = free_port()
    cfg = parse_config(["--hf-checkpoint", hf_without_tokenizer, "--prompt-data", str(prompts),
                        "--rm-url", f"http://127.0.0.1:{port}/score", "--rm-max-retries", "1"])
    with pytest.raises(EngineError, match=rf"^--rm-url http://127.0.0.1:{port}/score: nothing accepts a connection "
                                          rf"at 127.0.0.1:{port} after 2 attempt\(s\) \(ConnectionRefusedError"):
        preflight(cfg)
    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    listening.listen(1)
    try:
        preflight(parse_config(["--hf-checkpoint", hf_without_tokenizer, "--prompt-data", str(prompts),
                                "--rm-url", f"http://127.0.0.1:{listening.getsockname()[1]}/score"]))
    finally:
        listening.close()


def test_main_refuses_bad_user_code_before_run_with_one_error_line(tmp_path, hf_without_tokenizer, monkeypatch,
                                                                   capsys):
    """A generate function's module with a syntax error: refused by ``train.main``'s pre-flight, before ``run``
    builds anything (it was found once the model was built)."""
    from megatron_rl import train

    def run(cfg):
        raise AssertionError("run() started: the refusal came after the workers started")

    monkeypatch.setattr(train, "run", run)
    monkeypatch.setenv("RANK", "0")
    prompts = tmp_path / "ids.jsonl"
    prompts.write_bytes(_lines(IDS))
    broken = tmp_path / "my_rollout.py"
    broken.write_text("def generate(request, sampling, engine)\n    return []\n")
    argv = ["--hf-checkpoint", hf_without_tokenizer, "--prompt-data", str(prompts),
            "--custom-generate-function-path", f"{broken}:generate"]
    assert train.main(argv) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(
        f"error: --custom-generate-function-path {broken}:generate: cannot import '{broken}' (SyntaxError: "), err
    assert f"(line 1 of {broken})" in errors[0] and "Traceback" not in err


def test_an_over_memory_plan_is_refused_on_gpus_only(tmp_path, caplog):
    """The memory estimate against the card (plan/fit.py): refused before the workers start on a GPU that is too
    small, a warning with --allow-over-memory, and nothing checked on a CPU run (no CUDA device here)."""
    from megatron_rl.runner.preflight import check_memory_fit

    hf = tmp_path / "m"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(dict(
        model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False)))
    argv = ["--hf-checkpoint", str(hf), "--debug-train-only", "--load-debug-rollout-data", str(tmp_path / "r{rollout_id}.pt"),
            "--bf16", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "4096", "--actor-num-gpus-per-node", "2"]
    cfg = parse_config(argv)
    assert check_memory_fit(cfg) is None  # CPU: no check, whatever the plan
    with pytest.raises(ConfigError, match=r"does not fit the GPU's memory: trainer on rank 0's GPU \(train: static "
                                          r"\+ activation peak\) needs 154.69 GiB, the GPU has 79.60 GiB: 75.09 GiB "
                                          r"short; fix: --optimizer-cpu-offload --use-precision-aware-optimizer "
                                          r"\(checked before the workers started"):
        check_memory_fit(cfg, device_gib=79.6)
    assert check_memory_fit(cfg, device_gib=400.0) is None
    warned = check_memory_fit(parse_config(argv + ["--allow-over-memory"]), device_gib=79.6)
    assert warned and "going on: --allow-over-memory" in caplog.text

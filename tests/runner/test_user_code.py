"""Every call into user code, in every mode, ends in one error line naming the flag, the function and its line.

The class: a ``--custom-generate-function-path`` function that never returned hung a synchronous run
for good; a raising function printed a 40-line traceback; what a function returned was checked in part (token
ids beyond the vocabulary crashed the embedding, NaN log-probs passed). ``rollout.entry_points.USER_CODE`` is the
table of the flags that name user code; this file walks every row with a hanging, a raising and a malformed
function, through the real loop (``train.run`` with the recording doubles of test_loop_order.py, in process) in
each ``--async-mode`` the flag runs in, and ``--tools`` through its call site (the tool loop needs a tokenizer;
a tool's failure is an observation the model reads, never the run's end). A hung function waits for a marker
file the test writes at the end (state, not a clock); only the hang cases set a short
``--user-function-timeout``, so no working call races it.
"""

from __future__ import annotations

import json
import os
import re
import sys
import textwrap

import pytest

from megatron_rl.backends.factory import BACKENDS
from megatron_rl.config import parse_config
from megatron_rl.errors import ConfigError, UserFunctionError
from megatron_rl.rollout.base import ENGINES
from megatron_rl.rollout.entry_points import USER_CODE
from megatron_rl.train import run

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_loop_order import EVENTS, RecordingBackend, RecordingEngine  # noqa: E402 - the loop's doubles

HANG_TIMEOUT_S = 1.0  # the hang cases' --user-function-timeout: their function never returns on its own
MODES = ("off", "one-step", "full")

USER_MODULE = '''
import math
import os
import re
import time

from megatron_rl.data.types import Sample
from megatron_rl.rollout.dynamic_sampling import DynamicFilterOutput

RELEASE = {release!r}
VOCAB = {vocab}


def _stuck():
    # one line: a thread sampled mid-loop is at this line whether in the test or in the sleep
    while not os.path.exists(RELEASE): time.sleep(0.01)  # STUCK-LINE (the test writes RELEASE at its end)


def hang(*args, **kwargs):
    _stuck()  # HANG-LINE
    return None


def boom(*args, **kwargs):
    raise ValueError("the user's bug")  # BOOM-LINE


def _sample(request, response_ids, logprobs):
    return Sample(group_index=request.group_index, prompt_ids=list(request.prompt_ids), response_ids=response_ids,
                  rollout_logprobs=logprobs, finish_reason="stop", response_text="x")


def group_out_of_vocab(request, sampling, engine):
    return [_sample(request, [5, VOCAB], [-1.0, -1.0]) for _ in range(sampling.n)]


def batch_nan_logprobs(rollout_id, requests, sampling, engine):
    return [_sample(r, [5, 6], [-1.0, math.nan]) for r in requests for _ in range(sampling.n)]


def nan_reward(sample):
    return math.nan


def verl_nan(data_source, solution_str, ground_truth, extra_info=None):
    return {{"score": math.nan, "acc": False}}


def undecided(args, samples):
    return "maybe"


def advantages_of_text(args, rollout_data):
    rollout_data["advantages"] = "all good"


def agent_says_maybe(base_url, task):
    return "maybe"


def fails_from_the_second_rollout(request, sampling, engine):
    if request.metadata["prompt_index"] >= 2:  # rollout 1 (--rollout-batch-size 2)
        raise ValueError("rollout 1 broke")
    return [_sample(request, [5, 6], [-1.0, -1.0]) for _ in range(sampling.n)]


TOOLS_HANG = {{"t": hang}}
TOOLS_BOOM = {{"t": boom}}
TOOLS_MALFORMED = {{"t": lambda arguments: 42}}
'''

# flag -> (modes walked, the malformed function, what the refusal says of it after "FLAG PATH")
MALFORMED = {
    "--custom-generate-function-path": (MODES, "group_out_of_vocab",
                                        r": sample 0 \(group \d, prompt_index (\d), line \d\) has response_ids {vocab} at "
                                        r"position 1, outside the model's vocabulary \[0, {vocab}\)"),
    "--rollout-function-path": (MODES, "batch_nan_logprobs",
                                r": sample 0 \(group 0, prompt_index (\d), line \d\) has rollout_logprobs\[1\] = nan; a "
                                r"behaviour log-prob is a finite number"),
    # the agent's sessions on the run's endpoint, called per sample as a generate function is (sync and full)
    "--agent-function-path": (("off", "full"), "agent_says_maybe",
                              r" returned str; an agent returns its reward \(a number\)"),
    "--custom-rm-path": (MODES, "nan_reward",
                         r" returned nan for sample 0 \(prompt_index \d, line \d of --prompt-data .*prompts.jsonl\); "
                         "rewards must be finite"),
    # verl's contract (rollout/verl_reward.py): the same scoring call site as --custom-rm-path, walked in one mode
    "--custom-reward-function-path": (("off",), "verl_nan",
                                      r" returned nan for sample 0 \(prompt_index \d, line \d of --prompt-data "
                                      r".*prompts.jsonl\); rewards must be finite"),
    # called by the training step, on the main thread, the same in every mode: walked in one
    "--custom-advantage-function-path": (("off",), "advantages_of_text",
                                         r" left rollout_data\['advantages'\] as <class 'str'>; it must set it to a "
                                         r"list of 4 per-sample tensors"),
    "--dynamic-sampling-filter-path": (MODES, "undecided",
                                       r" returned 'maybe' for the group of prompt \(prompt_index \d, line \d\); a "
                                       "filter returns True"),
}


@pytest.fixture
def user_code(tmp_path, tiny_hf_models, monkeypatch):
    """(start(mode, *flags), module path, release marker, vocab): ``start`` runs ``train.run`` in process."""
    hf = tiny_hf_models("qwen2")
    vocab = json.load(open(os.path.join(hf, "config.json")))["vocab_size"]
    release = tmp_path / "release"
    module = tmp_path / "user_code.py"
    module.write_text(textwrap.dedent(USER_MODULE.format(release=str(release), vocab=vocab)))
    EVENTS.clear()
    monkeypatch.setitem(BACKENDS._rows, "megatron", RecordingBackend)
    monkeypatch.setitem(ENGINES._rows, "embedded", RecordingEngine)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": [1, 2, i], "label": str(i)}) + "\n" for i in range(8)))

    common = ["--hf-checkpoint", hf, "--prompt-data", str(prompts), "--rollout-batch-size", "2",
              "--n-samples-per-prompt", "2", "--save", str(tmp_path / "ckpt"), "--output-dir", str(tmp_path / "run")]

    def start(mode, *flags, rollouts=1):
        rm = [] if {"--custom-rm-path", "--custom-reward-function-path"} & set(flags) else ["--rm-type", "exact_match"]
        mode_flags = [] if mode == "off" else ["--async-mode", mode, "--embedded-engine-ranks", "driver"]
        cfg = parse_config([*common, *rm, "--num-rollout", str(rollouts), *mode_flags, *flags],
                           validate=mode == "off")  # async: the double stands as the embedded engine (unplaced)
        return run(cfg)

    start.argv = [*common, "--rm-type", "exact_match"]  # what train.main parses, validated (a sync run)

    yield start, str(module), release, vocab
    release.write_text("done")  # the hung calls' threads return and end


def _line_of(module: str, marker: str) -> int:
    return next(i for i, line in enumerate(open(module).read().splitlines(), 1) if marker in line)


def _one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message, message
    return message


def _cases():
    for entry in USER_CODE:
        if entry.flag == "--tools":
            continue  # through its call site below: the tool loop's failures are observations
        modes, _, _ = MALFORMED[entry.flag]
        for mode in modes:
            for behaviour in ("hang", "raise", "malformed"):
                yield pytest.param(entry.flag, mode, behaviour, id=f"{entry.flag[2:]}-{mode}-{behaviour}")


def test_the_walk_covers_every_entry_point():
    assert {e.flag for e in USER_CODE} == set(MALFORMED) | {"--tools"}


@pytest.mark.parametrize("flag, mode, behaviour", list(_cases()))
def test_a_hanging_raising_or_malformed_user_function_is_one_line_naming_it(user_code, flag, mode, behaviour):
    start, module, _, vocab = user_code
    _, malformed, says = MALFORMED[flag]
    fn = {"hang": "hang", "raise": "boom", "malformed": malformed}[behaviour]
    value = f"{module}:{fn}"
    extra = ["--user-function-timeout", str(HANG_TIMEOUT_S)] if behaviour == "hang" else []
    if flag == "--dynamic-sampling-filter-path":
        extra += ["--over-sampling-batch-size", "2"]
    expected = UserFunctionError if behaviour != "malformed" else ConfigError
    with pytest.raises(expected) as exc:
        start(mode, flag, value, *extra)
    message = _one_line(exc)
    assert message.startswith(f"{flag} {value}"), message
    if behaviour == "hang":
        assert f" did not return within {HANG_TIMEOUT_S:g} s (--user-function-timeout); it was at {module}:" in message
        assert (f"{module}:{_line_of(module, 'STUCK-LINE')} in _stuck. " in message
                or f"{module}:{_line_of(module, 'HANG-LINE')} in hang. " in message), message  # the call's own line
        assert "Python cannot stop a thread" in message
    elif behaviour == "raise":
        assert (f" raised ValueError: the user's bug (at {module}:{_line_of(module, 'BOOM-LINE')} in boom); fix the "
                "function") in message
    else:
        assert re.match(re.escape(f"{flag} {value}") + says.format(vocab=vocab), message), message
    assert not any(isinstance(e, tuple) and e[0] == "update_weights" and e[1] > 0 for e in EVENTS), \
        "the step after the failed rollout trained and synced"


def test_tool_failures_are_observations_through_the_bounded_call(user_code):
    from megatron_rl.rollout.agent.tools import load_tools, run_tool

    _, module, _, _ = user_code
    text, failed = run_tool(load_tools(f"{module}:TOOLS_HANG"), "t", {}, HANG_TIMEOUT_S)
    assert failed and text == f"error: tool 't' timed out after {HANG_TIMEOUT_S:g} s (--tool-timeout)"
    text, failed = run_tool(load_tools(f"{module}:TOOLS_BOOM"), "t", {}, 60.0)
    assert failed and text == "error: tool 't' failed: ValueError: the user's bug"
    assert run_tool(load_tools(f"{module}:TOOLS_MALFORMED"), "t", {}, 60.0) == (
        "error: tool 't' returned int, not a string", True)


def test_an_async_def_function_that_hangs_is_cancelled_at_the_deadline():
    import asyncio

    from megatron_rl.infra.user_function import call_user_function

    async def waits_forever(x):
        await asyncio.Event().wait()

    async def doubles(x):
        await asyncio.sleep(0)
        return 2 * x

    assert call_user_function(doubles, 21, where="--custom-rm-path m:doubles", timeout_s=60.0) == 42
    with pytest.raises(UserFunctionError, match=r"^--custom-rm-path m:waits_forever did not return within 0.2 s "
                                                r"\(--user-function-timeout\)") as exc:
        call_user_function(waits_forever, 1, where="--custom-rm-path m:waits_forever", timeout_s=0.2)
    assert exc.value.kind == "timeout"


def test_one_step_keeps_the_trained_step_when_the_next_rollout_fails(user_code, tmp_path):
    """``--async-mode one-step``: rollout 1, generated while step 0 trains, fails; step 0's metrics record and its
    scheduled checkpoint are written before the error ends the run (they came after the join, and were lost)."""
    start, module, _, _ = user_code
    with pytest.raises(UserFunctionError, match="raised ValueError: rollout 1 broke") as exc:
        start("one-step", "--custom-generate-function-path", f"{module}:fails_from_the_second_rollout",
              "--save-interval", "1", rollouts=3)
    _one_line(exc)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "train/pg_loss" in r] == [1]
    assert [e[1] for e in EVENTS if isinstance(e, tuple) and e[0] == "save"] == ["iter_0000001"]
    assert EVENTS.count("train_step") == 1


def test_main_ends_a_raising_function_with_one_error_line_and_exit_2(user_code, tmp_path, monkeypatch, capsys):
    """What a user sees (``train.main``, the synchronous loop): one ``error:`` line, no traceback, exit 2."""
    from megatron_rl import train

    start, module, _, _ = user_code
    monkeypatch.setenv("RANK", "0")
    argv = [*start.argv, "--num-rollout", "1", "--custom-generate-function-path", f"{module}:boom"]
    assert train.main(argv) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "raised ValueError: the user's bug (at" in errors[0], err[-3000:]
    assert "Traceback" not in err


@pytest.mark.parametrize("field, value, says", [
    ("prompt_ids", [1, 250], r"has prompt_ids 250 at position 1, outside the model's vocabulary \[0, 250\)"),
    ("prompt_ids", [1, -1], r"has prompt_ids -1 at position 1: not non-negative int token ids"),
    ("response_ids", [5, True], r"has response_ids True at position 1: not non-negative int token ids"),
    ("response_ids", [5, 7.0], r"has response_ids 7.0 at position 1: not non-negative int token ids"),
    ("rollout_logprobs", [-1.0, float("inf")], r"has rollout_logprobs\[1\] = inf; a behaviour log-prob is a finite"),
    ("rollout_logprobs", [-1.0, "0.5"], r"has rollout_logprobs\[1\] = '0.5'; a behaviour log-prob is a finite"),
])
def test_a_returned_sample_is_checked_whole(field, value, says):
    """Every token id against the model's vocabulary, every log-prob for a finite number, the prompt named."""
    from megatron_rl.data.types import GenerateRequest, Sample, SamplingParams
    from megatron_rl.rollout.generate_fn import check_samples

    request = GenerateRequest(prompt_ids=[1, 2], group_index=3, metadata={"prompt_index": 7, "line": 8})
    fields = {"prompt_ids": [1, 2], "response_ids": [5, 6], "rollout_logprobs": [-1.0, -0.5], field: value}
    sample = Sample(group_index=3, finish_reason="stop", **fields)
    with pytest.raises(ConfigError, match=r"^fn: sample 0 \(group 3, prompt_index 7, line 8\) " + says):
        check_samples([sample], [request], SamplingParams(n=1, max_new_tokens=4), "fn", vocab_size=250)
    fine = Sample(group_index=3, prompt_ids=[1, 2], response_ids=[5, 249], rollout_logprobs=[-1.0, 0.0],
                  finish_reason="stop")
    assert check_samples([fine], [request], SamplingParams(n=1, max_new_tokens=4), "fn", vocab_size=250)[0] is fine
    assert fine.metadata == {"prompt_index": 7, "line": 8}  # what reward errors name it by


def test_this_packages_errors_raised_under_a_user_function_pass_through_unchanged():
    """An engine that failed under a generate function's engine call stays an ``EngineError`` (the fault tolerance
    restarts engines on it); only the user's own exceptions become ``UserFunctionError``."""
    from megatron_rl.errors import EngineError
    from megatron_rl.infra.user_function import call_user_function

    died = EngineError("SGLang server http://h:1 died")

    def calls_a_dead_engine(request):
        raise died

    with pytest.raises(EngineError) as exc:
        call_user_function(calls_a_dead_engine, None, where="--custom-generate-function-path m:g", timeout_s=60.0)
    assert exc.value is died

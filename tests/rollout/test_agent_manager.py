"""Rollout functions through the real ``RolloutManager`` and the real embedded engine.

* the built-in tool loop on a tiny model that calls the calculator (``_tool_model.py``): every sample is
  the engine's output tokens plus observation tokens, and the behaviour log-probs of the model's tokens are
  what the same weights give teacher-forced on the final trajectory (so the trajectory is exactly what the
  engine conditioned on, turn after turn);
* a user's generate function and a user's batch function from files outside the package;
* the errors a bad function, a bad return or a bad flag gives.
"""

import dataclasses
import json

import pytest
import torch

from _tool_model import ANSWER, build_tool_model, write_prompts  # tests/ is on sys.path (conftest)

from megatron_rl.config import parse_config
from megatron_rl.data.types import GenerateRequest, Sample, SamplingParams
from megatron_rl.errors import ConfigError
from megatron_rl.rollout.agent.framing import tool_turn_ids
from megatron_rl.rollout.agent.parse import parse_tool_calls
from megatron_rl.rollout.agent.tools import BUILTIN_TOOLS, run_tool
from megatron_rl.rollout.generate_fn import check_samples, load_function


@pytest.fixture(autouse=True)
def _no_torchrun(monkeypatch):
    for var in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(scope="module")
def tool_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("agent")
    model, tok, prompt_ids, target_ids = build_tool_model(root / "model")
    write_prompts(root / "prompts.jsonl", 4)
    (root / "exact_answer.py").write_text("def score(sample):\n"
                                          "    return float(sample.response_text.strip().endswith(sample.label))\n")
    return root, tok, prompt_ids


def flags(root, *extra):
    return ["--hf-checkpoint", str(root / "model"), "--prompt-data", str(root / "prompts.jsonl"),
            "--apply-chat-template", "--custom-rm-path", f"{root / 'exact_answer.py'}:score",
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "160",
            "--embedded-engine-ranks", "driver", *extra]


class Recorder:
    """Wraps ``engine.generate``: every call's requests and samples, in order."""

    def __init__(self, engine):
        self.engine, self.generate_fn, self.calls = engine, engine.generate, []
        engine.generate = self

    def __call__(self, requests, sampling):
        out = self.generate_fn(requests, sampling)
        self.calls.append(([list(r.prompt_ids) for r in requests], sampling, [dataclasses.replace(s) for s in out]))
        return out


def test_tool_loop_on_the_embedded_engine_is_token_in_token_out(tool_run):
    from megatron_rl.rollout.build import build_rollout
    import transformers

    root, tok, prompt_ids = tool_run
    manager = build_rollout(parse_config(flags(root, "--custom-generate-function-path",
                                               "megatron_rl.rollout.agent:generate", "--max-turns", "3")))
    recorder = Recorder(manager.engine)
    samples, metrics = manager.generate(0)
    assert len(samples) == 4 and all(s.prompt_ids == prompt_ids for s in samples)
    assert sum(s.metadata["tool_calls"] for s in samples) >= 1  # the model calls the calculator
    assert metrics["rollout/turns_mean"] == sum(s.metadata["turns"] for s in samples) / 4
    assert metrics["rollout/tool_calls_mean"] > 0 and "rollout/tool_error_frac" in metrics
    # rebuild each trajectory from the engine's side: contexts it was given, tokens it returned
    outputs = {}  # context -> the engine samples returned for it
    for contexts, sampling, out in recorder.calls:
        n = sampling.n
        for i, c in enumerate(contexts):
            outputs.setdefault(tuple(c), []).extend(out[i * n:(i + 1) * n])
    firsts = outputs[tuple(prompt_ids)]
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(root / "model"), dtype=torch.float32).eval()
    for s, first in zip(samples, firsts):
        response, turn = [], first
        while True:
            keep = len(turn.response_ids)
            text = tok.decode(turn.response_ids, skip_special_tokens=False)
            if "</tool_call>" in text:  # the loop cut the turn after the tag
                keep = next(k for k in range(1, keep + 1) if "</tool_call>" in tok.decode(turn.response_ids[:k]))
            response += turn.response_ids[:keep]
            calls = parse_tool_calls(tok.decode(turn.response_ids[:keep]))
            context = tuple(prompt_ids + response)
            nxt = [c for c in outputs if len(c) > len(context) and c[:len(context)] == context]
            if not calls or not nxt:
                break
            observation = list(nxt[0][len(context):])
            results = [run_tool(BUILTIN_TOOLS, c.name, c.arguments, 30.0)[0] if c.error is None else f"error: {c.error}"
                       for c in calls]
            assert observation == tool_turn_ids(tok, results)  # the framing, tokenised alone
            response += observation
            turn = outputs[nxt[0]][0]
        assert s.response_ids == response
        mask = torch.tensor(s.loss_mask, dtype=torch.bool)
        assert len(mask) == len(response) and (s.metadata["tool_calls"] == 0) == bool(mask.all())
        # teacher-forced log-probs of the model's tokens on the final trajectory = the engine's behaviour ones
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        with torch.no_grad():
            logits = hf(input_ids=ids).logits[0, len(s.prompt_ids) - 1:-1].float()
        forced = torch.log_softmax(logits, -1).gather(-1, ids[0, len(s.prompt_ids):, None])[:, 0]
        behaviour = torch.tensor(s.rollout_logprobs)
        assert torch.allclose(forced[mask], behaviour[mask], atol=1e-4)
        assert (behaviour[~mask] == 0).all()
    assert any(s.response_text.strip().endswith(ANSWER) for s in samples) == any(s.reward == 1.0 for s in samples)


USER_GENERATE = '''
from megatron_rl.data.types import Sample

OBSERVATION = [5, 6, 7]


def generate(request, sampling, engine):
    """Two turns per sample, a fixed observation between them (loss mask 0)."""
    out = []
    firsts = engine.generate(request.prompt_ids, sampling)
    for first in firsts:
        ids = first.output_ids + OBSERVATION
        second = engine.generate(request.prompt_ids + ids, sampling.__class__(
            temperature=sampling.temperature, max_new_tokens=2, n=1, seed=sampling.seed))[0]
        out.append(Sample(group_index=request.group_index, prompt_ids=list(request.prompt_ids),
                          response_ids=ids + second.output_ids,
                          rollout_logprobs=first.logprobs + [0.0] * 3 + second.logprobs,
                          loss_mask=[1] * len(first.output_ids) + [0] * 3 + [1] * len(second.output_ids),
                          token_versions=first.token_versions + [first.token_versions[-1]] * 3 + second.token_versions,
                          finish_reason=second.finish_reason, weight_version=first.weight_version,
                          metadata={"turns": 2, "tool_calls": 1, "tool_errors": 0}))
    return out


async def agenerate(request, sampling, engine):
    firsts = await engine.agenerate(request.prompt_ids, sampling)
    return [Sample(group_index=request.group_index, prompt_ids=list(request.prompt_ids), response_ids=g.output_ids,
                   rollout_logprobs=g.logprobs, finish_reason=g.finish_reason) for g in firsts]


def rollout(rollout_id, requests, sampling, engine):
    outs = engine.generate_batch([r.prompt_ids for r in requests], sampling)
    return [Sample(group_index=r.group_index, prompt_ids=list(r.prompt_ids), response_ids=g.output_ids,
                   rollout_logprobs=g.logprobs, finish_reason=g.finish_reason, metadata={"rollout_id": rollout_id})
            for r, gens in zip(requests, outs) for g in gens]


def wrong_count(request, sampling, engine):
    return []


def long_logprobs(request, sampling, engine):
    g = engine.generate(request.prompt_ids, sampling)[0]
    return [Sample(group_index=request.group_index, prompt_ids=list(request.prompt_ids), response_ids=g.output_ids,
                   rollout_logprobs=g.logprobs + [0.0]) for _ in range(sampling.n)]

NOT_CALLABLE = 3
'''


@pytest.fixture(scope="module")
def user_module(tmp_path_factory):
    d = tmp_path_factory.mktemp("user_fn")
    (d / "my_rollout.py").write_text(USER_GENERATE)
    return d


@pytest.mark.parametrize("as_module", [False, True])
def test_a_user_generate_function_from_outside_the_package_runs_through_the_manager(tool_run, user_module,
                                                                                     monkeypatch, as_module):
    from megatron_rl.rollout.build import build_rollout

    root, tok, prompt_ids = tool_run
    if as_module:
        monkeypatch.syspath_prepend(str(user_module))
    path = "my_rollout:generate" if as_module else f"{user_module / 'my_rollout.py'}:generate"
    manager = build_rollout(parse_config(flags(root, "--custom-generate-function-path", path)))
    recorder = Recorder(manager.engine)
    samples, metrics = manager.generate(0)
    assert len(samples) == 4 and [s.group_index for s in samples] == [0, 0, 1, 1]
    for s in samples:
        k = s.loss_mask.index(0)
        assert s.response_ids[k:k + 3] == [5, 6, 7] and s.loss_mask[k:k + 3] == [0, 0, 0]
        assert s.label == ANSWER and s.response_text is not None  # filled from the request, decoded
    # one engine call per round across both groups: the first turns (n rows per prompt), then the function's
    # second turns, one sample after the other in each group (it calls the engine sample by sample)
    assert [len(c) for c, _, _ in recorder.calls] == [2, 2, 2]
    assert [sp.n for _, sp, _ in recorder.calls] == [2, 1, 1]
    assert metrics["rollout/turns_mean"] == 2.0 and metrics["rollout/tool_calls_mean"] == 1.0
    assert metrics["rollout/tool_error_frac"] == 0.0


def test_async_and_batch_functions(tool_run, user_module):
    from megatron_rl.rollout.build import build_rollout

    root, _, prompt_ids = tool_run
    manager = build_rollout(parse_config(flags(root, "--custom-generate-function-path",
                                               f"{user_module / 'my_rollout.py'}:agenerate")))
    samples, metrics = manager.generate(0)
    assert len(samples) == 4 and "rollout/turns_mean" not in metrics  # no multi-turn metadata, no metric
    manager = build_rollout(parse_config(flags(root, "--rollout-function-path",
                                               f"{user_module / 'my_rollout.py'}:rollout")))
    samples, _ = manager.generate(5)
    assert [s.metadata["rollout_id"] for s in samples] == [5] * 4 and [s.group_index for s in samples] == [0, 0, 1, 1]
    assert manager.evaluate(6) == {}  # no eval sets: nothing to do


def test_bad_functions_and_returns_are_named(tool_run, user_module):
    from megatron_rl.rollout.build import build_rollout

    root, _, _ = tool_run
    file = user_module / "my_rollout.py"
    for path, match in [(f"{file}:NOT_CALLABLE", "is a int, not a function"), (f"{file}:missing", "has no 'missing'"),
                        ("no_such_module_xyz:fn", "cannot import 'no_such_module_xyz'"),
                        (f"{root}/none.py:fn", "no such file")]:
        with pytest.raises(ConfigError, match=f"--custom-generate-function-path {path}: .*{match}"):
            load_function(path, "--custom-generate-function-path")
    for fn, match in [("wrong_count", r"returned 0 samples for one group of n=2 .*exactly 2"),
                      ("long_logprobs", r"sample 0 \(group 0, prompt_index 0, line 1\) has \d+ rollout_logprobs for \d+ response_ids")]:
        manager = build_rollout(parse_config(flags(root, "--custom-generate-function-path", f"{file}:{fn}")))
        with pytest.raises(ConfigError, match=f"--custom-generate-function-path {file}:{fn}.*{match}"):
            manager.generate(0)


def test_returned_samples_are_checked_against_the_contract():
    req = GenerateRequest(prompt_ids=[1, 2], group_index=4)
    sp = SamplingParams(max_new_tokens=3, n=1)

    def ok(**kw):
        base = dict(group_index=4, prompt_ids=[1, 2], response_ids=[3, 4], rollout_logprobs=[-1.0, -2.0])
        return Sample(**{**base, **kw})

    assert check_samples(ok(), [req], sp, "fn")[0].response_ids == [3, 4]  # one bare Sample for n 1
    for sample, match in [(ok(loss_mask=[1]), "loss_mask of 1 entries for 2"),
                          (ok(loss_mask=[1, 2]), "values other than 0 and 1"),
                          (ok(token_versions=[0]), "1 token_versions for 2"),
                          (ok(group_index=5), "group_index 5, not its request's 4"),
                          (ok(response_ids=[1, 2, 3, 4], rollout_logprobs=[0.0] * 4), "more than max_new_tokens 3"),
                          (ok(response_ids=[], rollout_logprobs=[]), "no response token"),
                          (ok(finish_reason="done"), "finish_reason 'done'"),
                          (ok(prompt_ids=[]), "non-empty list"), (ok(response_ids=[3, "4"]), "not non-negative int")]:
        with pytest.raises(ConfigError, match=f"fn: sample 0 \\(group 4\\) .*{match}"):
            check_samples([sample], [req], sp, "fn")
    with pytest.raises(ConfigError, match="returned dict"):
        check_samples({"a": 1}, [req], sp, "fn")


@pytest.mark.parametrize("extra, match", [
    (["--custom-generate-function-path", "nocolon"], "must be module:function"),
    (["--custom-generate-function-path", "/nope/x.py:f"], "no such file /nope/x.py"),
    (["--custom-generate-function-path", "a:f", "--rollout-function-path", "a:g"], "would never be called"),
    (["--agent-function-path", "a:f", "--custom-generate-function-path", "a:g"],
     "--agent-function-path a:f generates every sample through the agent endpoint, so "
     "--custom-generate-function-path a:g would never be called"),
    (["--agent-function-path", "nocolon"], "--agent-function-path nocolon must be module:function"),
    (["--max-turns", "3"], "--max-turns 3 configure the tool loop of a generate function"),
    (["--tools", "m:R"], "add --custom-generate-function-path megatron_rl.rollout.agent:generate"),
    (["--custom-generate-function-path", "a:f", "--max-turns", "0"], "--max-turns 0 must be >= 1"),
    (["--custom-generate-function-path", "a:f", "--tools", "m"], "must be module:REGISTRY"),
    (["--custom-generate-function-path", "a:f", "--tool-timeout", "0"], "--tool-timeout 0 is out of range"),
])
def test_flag_errors_name_the_flag(tool_run, extra, match):
    root, _, _ = tool_run
    with pytest.raises(ConfigError, match=match):
        parse_config(flags(root, *extra))


def test_async_refusals_say_why(tool_run):
    root, _, _ = tool_run
    base = ["--async-mode", "full", "--rollout-backend", "sglang", "--rollout-engine-urls", "http://127.0.0.1:1",
            "--update-weight-transport", "disk", "--update-weight-disk-dir", str(root / "w")]
    args = [a for a in flags(root) if a not in ("--embedded-engine-ranks", "driver")]
    with pytest.raises(ConfigError, match="cannot resume a function's own state"):
        parse_config(args + base + ["--partial-rollout", "--custom-generate-function-path", "a:f"])
    with pytest.raises(ConfigError, match="cannot resume an agent's own state"):
        parse_config(args + base + ["--partial-rollout", "--agent-function-path", "a:f"])
    with pytest.raises(ConfigError, match=r"--rollout-function-path a:f with --async-mode full --partial-rollout.*"
                                          r"a cut batch is generated again whole"):
        parse_config(args + base + ["--partial-rollout", "--rollout-function-path", "a:f"])
    assert parse_config(args + base + ["--rollout-function-path", "a:f"]).rollout.rollout_function_path == "a:f"
    with pytest.raises(ConfigError, match="generates nothing"):
        parse_config(["--hf-checkpoint", str(root / "model"), "--debug-train-only", "--custom-generate-function-path",
                      "a:f", "--load-debug-rollout-data", str(root / "r_{rollout_id}.pt")])


def test_an_aborted_group_is_generated_again_through_the_function(tool_run, user_module):
    from megatron_rl.rollout.build import build_rollout

    root, _, _ = tool_run
    manager = build_rollout(parse_config(flags(root, "--custom-generate-function-path",
                                               f"{user_module / 'my_rollout.py'}:agenerate")))
    real, seen = manager.engine.generate, []

    def abort_first(requests, sampling):
        out = real(requests, sampling)
        seen.append(len(requests))
        if len(seen) == 1:
            out[0] = dataclasses.replace(out[0], finish_reason="abort")
        return out

    manager.engine.generate = abort_first
    samples, metrics = manager.generate(0)
    assert not any(s.finish_reason == "abort" for s in samples)
    assert metrics["rollout/aborted_samples"] == 1.0 and metrics["rollout/abort_retried_groups"] == 1.0
    assert seen == [2, 1]  # both groups in one round, then the aborted group alone
    assert json.dumps(manager.fingerprint()["custom_generate_function_path"]).endswith(':agenerate"')

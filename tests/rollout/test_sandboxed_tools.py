"""The sandbox's users: the ``python`` tool (through ``run_tool``, as the tool loop calls it, and bound to the
run's ``--sandbox-*`` flags) and ``--rm-type code`` (stdin/stdout and assert tests, an early exit that must not
pass, labels that are refused). The escapes themselves: tests/infra/test_sandbox.py."""

import pytest

from megatron_rl.config import collect_errors, parse_config
from megatron_rl.data.types import Sample
from megatron_rl.errors import ConfigError
from megatron_rl.infra.sandbox import SandboxLimits, SandboxUnavailable, check_sandbox
from megatron_rl.rollout.agent import check_tools, settings_from_config
from megatron_rl.rollout.agent.sandbox_tools import TOOLS, PythonTool, ShellTool, check_sandboxed_tools
from megatron_rl.rollout.agent.tools import run_tool
from megatron_rl.rollout.code_reward import CodeReward, extract_code, parse_cases
from megatron_rl.rollout.rewards import compute_rewards, reward_fn_from_config, reward_metrics

LIMITS = SandboxLimits(wall_seconds=60.0, cpu_seconds=1, memory_mb=128, file_size_mb=1, disk_mb=2, processes=8,
                       open_files=32, output_bytes=2048)
AGENT = ["--custom-generate-function-path", "megatron_rl.rollout.agent:generate"]


@pytest.fixture(scope="module")
def sandbox():
    try:
        check_sandbox(LIMITS)
    except SandboxUnavailable as exc:
        pytest.skip(f"no sandbox on this machine: {exc}")


def flags(*argv):
    """A config of these flags (not validated as a whole run: no model is needed here)."""
    return parse_config(list(argv), validate=False)


def test_the_python_tool_answers_with_what_the_program_printed(sandbox):
    tools = {"python": PythonTool(LIMITS)}
    assert run_tool(tools, "python", {"code": "```python\nprint(6 * 7)\n```"}, 30.0) == ("42", False)
    text, failed = run_tool(tools, "python", {"code": "print('partial')\n1 / 0"}, 30.0)
    assert not failed and text.startswith("partial\nTraceback") and text.endswith(
        "ZeroDivisionError: division by zero\n[sandbox: exit 1]")
    text, failed = run_tool(tools, "python", {"code": "x = ' ' * (1 << 30)"}, 30.0)
    assert not failed and text.endswith("[sandbox: exit 1; memory limit (--sandbox-memory-mb 128)]")
    text, failed = run_tool(tools, "python", {"code": "while True: print('y' * 99)"}, 30.0)
    assert not failed and len(text) < 2048 + 100 and text.endswith("output limit (--sandbox-output-bytes 2048)]")
    assert run_tool(tools, "python", {"code": "pass"}, 30.0) == ("(no output)", False)
    text, failed = run_tool(tools, "python", {"source": "print(1)"}, 30.0)  # a malformed call: a tool error
    assert failed and 'give {"code"' in text


def test_the_shell_tool_runs_a_command_line_in_the_same_sandbox(sandbox):
    tools = {"shell": ShellTool(LIMITS)}
    assert run_tool(tools, "shell", {"command": "echo hi > f.txt && cat f.txt && pwd"}, 30.0) == ("hi\n/tmp/work",
                                                                                                  False)
    text, failed = run_tool(tools, "shell", {"command": "echo x > /tmp/out; exit 3"}, 30.0)
    assert not failed and text.endswith("[sandbox: exit 3; only the work directory is writable]")
    text, failed = run_tool(tools, "shell", {"code": "ls"}, 30.0)
    assert failed and 'give {"command"' in text


def test_the_run_binds_sandboxed_tools_to_its_flags(sandbox):
    cfg = flags(*AGENT, "--tools", "megatron_rl.rollout.agent.sandbox_tools:TOOLS", "--sandbox-memory-mb", "128",
                "--sandbox-output-bytes", "100", "--sandbox-wall-seconds", "4", "--sandbox-processes", "8")
    tools = settings_from_config(cfg).tools
    assert tools["python"].limits == SandboxLimits(wall_seconds=4.0, memory_mb=128, output_bytes=100, processes=8)
    assert tools["shell"].limits == tools["python"].limits and tools["calculator"] is TOOLS["calculator"]
    check_tools(cfg)  # the sandbox starts Python under these limits on this machine
    assert run_tool(tools, "python", {"code": "print('z' * 500)"}, 30.0)[0].endswith(
        "(--sandbox-output-bytes 100)]")
    with pytest.raises(ConfigError, match="--sandbox-wall-seconds 10 must be below --tool-timeout 5"):
        check_sandboxed_tools(TOOLS, SandboxLimits(), tool_timeout=5.0)


def test_sandbox_flags_are_validated():
    errors = collect_errors(flags("--sandbox-processes", "0", "--sandbox-python", "python3",
                                  "--sandbox-wall-seconds", "0"))
    assert "--sandbox-processes 0 must be >= 1" in errors
    assert any(e.startswith("--sandbox-python python3 must be an absolute path") for e in errors)
    assert any(e.startswith("--sandbox-wall-seconds 0 is out of range") for e in errors)


def sample(response, label):
    return Sample(group_index=0, prompt_ids=[1], response_ids=[2], response_text=response, label=label)


ADD_STDIO = '{"inputs": ["1 2\\n", "40 2\\n", "5 5\\n"], "outputs": ["3\\n", "42", "10\\n\\n"]}'


def test_code_reward_scores_the_fraction_of_tests_passed(sandbox):
    reward = reward_fn_from_config(flags("--rm-type", "code", "--sandbox-memory-mb", "128", "--sandbox-cpu-seconds",
                                         "5", "--sandbox-wall-seconds", "60"))
    assert isinstance(reward, CodeReward) and (reward.limits.memory_mb, reward.limits.cpu_seconds) == (128, 5)
    samples = [
        sample("Read two numbers:\n```python\na, b = map(int, input().split())\nprint(a + b)\n```", ADD_STDIO),
        sample("```python\nprint(3)\n```", ADD_STDIO),
        sample("```python\ndef add(a, b):\n    return a + b\n```", {"asserts": ["assert add(1, 2) == 3",
                                                                             "assert add(2, 2) == 5"]}),
        sample("```python\nimport os\ndef add(a, b):\n    return 0\nos._exit(0)\n```",  # exits 0 before the test
               {"asserts": ["assert add(1, 2) == 3"]}),
        sample("```python\nimport sys\nsys.exit(1)\n```", {"asserts": ["assert True"]}),
        sample("the answer is 3", ADD_STDIO),
    ]
    assert compute_rewards(samples, reward) == [1.0, 1 / 3, 0.5, 0.0, 0.0, 0.0]
    assert [s.metadata["reward_metrics"]["all_passed"] for s in samples] == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert reward_metrics(samples)["reward/all_passed"] == pytest.approx(1 / 6)


def test_code_blocks_and_labels():
    assert extract_code("a\n```python\nx = 1\n```\nb\n```\ny = 2\n```\n```bash\nls\n```") == "y = 2\n"
    assert extract_code("no code") is None
    for label, match in [("not json", "is not JSON"), ([1], "is a list"), ({"asserts": []}, "'asserts' that is"),
                         ({"inputs": ["1"], "outputs": []}, "keys: inputs, outputs")]:
        with pytest.raises(ConfigError, match=f"--rm-type code: the label of sample 3 .*{match}"):
            parse_cases(label, "sample 3 (group 0)")
    with pytest.raises(ConfigError, match="needs a label with the tests"):
        CodeReward(LIMITS)([sample("x", None)])


def test_a_fork_bomb_through_the_tool_loop_is_an_observation_and_the_trajectory_goes_on(tmp_path, sandbox):
    """The tool loop (``run_agent``) with a scripted engine double: the model's turn calls ``python`` with a fork
    bomb; the loop appends what the sandbox said (loss mask 0) and the next turn answers."""
    import json

    from _tokenizer import build_char_tokenizer  # tests/ is on sys.path (conftest)

    from megatron_rl.data.types import GenerateRequest, SamplingParams
    from megatron_rl.rollout.agent import AgentSettings, run_agent
    from megatron_rl.rollout.generate_fn import EngineHandle

    tok = build_char_tokenizer(tmp_path / "tok")
    call = {"name": "python", "arguments": {"code": "import os\nwhile True:\n    os.fork()"}}
    turns = [tok.encode(f"<tool_call>{json.dumps(call)}</tool_call>", add_special_tokens=False),
             tok.encode("done", add_special_tokens=False) + [tok.eos_token_id]]

    def engine(requests, sampling):
        ids = turns.pop(0)
        return [Sample(group_index=r.group_index, prompt_ids=list(r.prompt_ids), response_ids=ids,
                       rollout_logprobs=[-1.0] * len(ids), finish_reason="stop", weight_version=0)
                for r in requests]

    prompt = tok.encode("<|user|>fork<|assistant|>", add_special_tokens=False)
    request = GenerateRequest(prompt_ids=prompt, group_index=0)
    (s,) = run_agent(request, SamplingParams(max_new_tokens=2048, n=1), EngineHandle(engine, tokenizer=tok,
                                                                                      request=request),
                     AgentSettings(tools={"python": PythonTool(LIMITS)}, max_turns=3, tool_timeout_s=120.0))
    observation = tok.decode([t for t, m in zip(s.response_ids, s.loss_mask) if m == 0])
    assert "BlockingIOError" in observation and "process limit (--sandbox-processes 8)" in observation
    assert (s.metadata["tool_calls"], s.metadata["tool_errors"], s.metadata["agent_stop"]) == (1, 0, "answer")
    assert tok.decode(s.response_ids, skip_special_tokens=True).endswith("done")

"""Training start-up with a damaged --hf-checkpoint ends in one ``error:`` line and exit 2.

a truncated ``model.safetensors`` raised safetensors' SafetensorError traceback from
inside the weight load. One real ``python -m megatron_rl.train`` process (it fails before any
collective, so one rank shows the whole behaviour).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from _util import REPO, free_port

pytestmark = pytest.mark.e2e


def _start_training(hf, tmp_path) -> subprocess.CompletedProcess:
    """One real single-rank ``python -m megatron_rl.train`` on ``hf`` (it is expected to refuse at start-up)."""
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "megatron_rl.train", "--hf-checkpoint", str(hf), "--output-dir",
                           str(tmp_path / "run"), "--num-rollout", "1", "--rollout-batch-size", "2",
                           "--n-samples-per-prompt", "2", "--global-batch-size", "4"],
                          env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)


def test_truncated_hf_checkpoint_is_one_error_line(tmp_path, tiny_hf_models):
    hf = tmp_path / "hf"
    shutil.copytree(tiny_hf_models("llama"), hf)
    shard = hf / "model.safetensors"
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    p = _start_training(hf, tmp_path)
    assert p.returncode == 2, p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    assert (f"error: {shard} ({os.path.getsize(shard)} bytes) is not a readable safetensors file"
            in p.stderr), p.stderr[-3000:]


def test_damaged_dist_to_hf_output_is_refused_by_file_name(tmp_path, tiny_hf_models):
    """A dist-to-hf output carries CRC-32s in its COMPLETE.json; same-size damage to a shard used to
    train silently from --hf-checkpoint (only the converter checked the marker)."""
    import json

    from megatron_rl.models.model_dir import HF_FORMAT
    from megatron_rl.infra.checkpoint_root import MARKER_NAME, file_list

    hf = tmp_path / "hf"
    shutil.copytree(tiny_hf_models("llama"), hf)
    (hf / MARKER_NAME).write_text(json.dumps({"format": HF_FORMAT, "files": file_list(str(hf))}))
    shard = hf / "model.safetensors"
    with open(shard, "r+b") as f:  # flip bytes of the last tensor's data: the header stays readable
        f.seek(-16, os.SEEK_END)
        tail = f.read(16)
        f.seek(-16, os.SEEK_END)
        f.write(bytes(b ^ 0xFF for b in tail))
    p = _start_training(hf, tmp_path)
    assert p.returncode == 2, p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    assert "model.safetensors has CRC-32" in p.stderr and "same size, different bytes" in p.stderr, p.stderr[-3000:]


LAUNCH_TIMEOUT_S = 300  # start-up of 2 ranks and the refusal take ~25-45 s on 2 busy cores


def _two_rank_launch(tmp_path, hf, prompts, *flags) -> tuple[int, str]:
    """A real 2-rank ``megatron_rl.infra.launch`` of ``megatron_rl.train`` (sync mode, the embedded engine with a
    replica on each rank) expected to stop with an error: (exit code, stdout + stderr)."""
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "megatron_rl.infra.launch", "--run-dir", str(out), "--nproc-per-node", "2",
           "--nnodes", "1", "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", "megatron_rl.train",
           "--hf-checkpoint", str(hf), "--actor-num-gpus-per-node", "2", "--prompt-data", str(prompts),
           "--rm-type", "exact_match", "--num-rollout", "1", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
           "--rollout-max-response-len", "2", "--global-batch-size", "4", "--output-dir", str(out), *flags]
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S, cwd=tmp_path,
                           start_new_session=True)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"the launch did not end within {LAUNCH_TIMEOUT_S} s (a rank left waiting in a "
                             f"collective?):\n{exc.stderr}") from None
    return p.returncode, p.stdout + p.stderr


def test_a_refusal_after_the_workers_started_is_one_error_line_on_a_real_two_rank_launch(tmp_path, tiny_hf_models):
    """The class "refusals after start-up print another rank's traceback", on a real launch: a prompt longer than
    --rollout-max-prompt-len is found only once the driver tokenizes the data (after the backend's collectives),
    while rank 1 waits in a collective with it; rank 1 used to print gloo's "Connection closed by peer"
    traceback above the driver's error line. The pre-start cases: tests/runner/test_preflight.py."""
    from _tokenizer import build_char_tokenizer

    hf = tmp_path / "hf"
    shutil.copytree(tiny_hf_models("qwen2"), hf)
    build_char_tokenizer(hf)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(f'{{"prompt": "abcdefg{i}", "label": "x"}}\n' for i in range(4)))
    code, output = _two_rank_launch(tmp_path, hf, prompts, "--rollout-max-prompt-len", "4")
    assert code == 2, output[-6000:]
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert errors == [f"error: --prompt-data {prompts} line 1: prompt has 8 tokens, more than --rollout-max-prompt-len "
                      "4; raise the limit or remove the prompt"], output[-6000:]
    assert "Traceback" not in output and "Connection closed by peer" not in output, output[-6000:]


def test_a_raising_user_function_is_its_own_one_error_line_on_a_real_two_rank_launch(tmp_path, tiny_hf_models):
    """A --custom-generate-function-path function that raises in the first rollout (sync mode, the embedded
    engine's replica on rank 1 waiting for its part): one error line, the function's, naming its own line, exit
    2, no traceback (it printed rank 0's 40-line traceback; then rank 1's "rank 0's rollout stopped: ..." report
    won the launcher's status file). The hang, malformed and other-mode cases: tests/runner/test_user_code.py."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(f'{{"prompt": [1, 2, {i}], "label": "x"}}\n' for i in range(4)))
    module = tmp_path / "my_rollout.py"
    module.write_text("def helper(x):\n    return x['answer']\n\n\ndef generate(request, sampling, engine):\n"
                      "    return helper({})\n")
    code, output = _two_rank_launch(tmp_path, tiny_hf_models("qwen2"), prompts,
                                    "--custom-generate-function-path", f"{module}:generate")
    assert code == 2, output[-6000:]
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert errors == [f"error: --custom-generate-function-path {module}:generate raised KeyError: 'answer' (at "
                      "my_rollout.py:2 in helper); fix the function (this error ends the run)"], output[-6000:]  # cwd
    assert "Traceback" not in output, output[-6000:]


def test_a_rank_whose_collective_fails_after_another_ranks_refusal_ends_quietly(tmp_path, monkeypatch, capsys,
                                                                                tiny_hf_models):
    """The mechanism in ``train.main``, in process: rank 1's crash (what gloo raises when the refusing rank has
    gone) after rank 0 recorded its refusal ends with that refusal's code and no traceback; without a recorded
    refusal, a collective broken by a peer that is gone (a SIGKILLed rank: the launcher names it) ends in one
    line naming the file that keeps its traceback (was: the gloo traceback above the launcher's line), and any
    other crash is raised (its traceback is the report)."""
    import pytest

    from megatron_rl import train
    from megatron_rl.infra.wall_time import STATUS_ENV, write_error_status

    def run(cfg):
        raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:19619")

    monkeypatch.setattr(train, "run", run)
    status = tmp_path / "run_status.json"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv(STATUS_ENV, str(status))
    monkeypatch.setattr(train, "refuse_single_process_world", lambda cfg: None)  # a 2-rank world, played
    argv = ["--hf-checkpoint", tiny_hf_models("qwen2"), "--rollout-batch-size", "2"]
    monkeypatch.setenv("RANK", "1")
    capsys.readouterr()
    assert train.main(argv) == 1  # nothing recorded: a peer that is gone, which the launcher names
    err, kept = capsys.readouterr().err, tmp_path / "rank1_traceback.txt"
    assert "rank 1: a collective failed (RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer" \
        in err and f"another rank of this launch ended first; the launcher names it below. This rank's traceback: " \
        f"{kept}" in err and "Traceback" not in err, err
    assert "Traceback" in kept.read_text() and "Connection closed by peer" in kept.read_text()
    monkeypatch.setattr(train, "run", lambda cfg: {}["a bug"])
    with pytest.raises(KeyError, match="a bug"):
        train.main(argv)  # a crash of its own: raised, its traceback is the report
    monkeypatch.setattr(train, "run", run)
    monkeypatch.setenv("RANK", "0")
    assert write_error_status(str(status), "--prompt-data p.jsonl line 1: prompt has 8 tokens", 2)
    monkeypatch.setenv("RANK", "1")
    assert train.main(argv) == 2
    assert "Traceback" not in capsys.readouterr().err
    monkeypatch.setenv("RANK", "0")
    assert train.main(argv) == 1  # the refusing rank's own record does not stand for its crash: told, and kept
    assert "Connection closed by peer" in (tmp_path / "rank0_traceback.txt").read_text()
    monkeypatch.setattr(train, "run", lambda cfg: {}["a bug"])
    with pytest.raises(KeyError, match="a bug"):
        train.main(argv)

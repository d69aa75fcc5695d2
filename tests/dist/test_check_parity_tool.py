"""tools/check_parity.py, the user-facing "is my conversion and layout right?" tool.

The real CLI under torchrun on each of the tool's own paths (llama TP with padded input, Qwen2 CP with
packed input, Qwen3 PP + virtual PP, Qwen3-MoE TP + expert-TP + SP); plus the non-zero exit above
--tolerance and the refusal (exit 2) of a layout that does not fit the world size.
The numerics of every layout (TP, TP+SP, PP, VPP, CP, EP, DP, 4-rank mixes) against one process
and HF are proven at the model level in one launch each by tests/dist/test_parity_layouts.py; this
file checks the tool, each case a torchrun launch (~13 s on 2 cores), so it keeps four of the twelve
it once had, two of them in scripts/test_extended.sh (the suite has to stay under 25 minutes): Qwen2's TP
split and Qwen3-MoE's EP2 are model-level cases of test_parity_layouts.py (EP2 with gradients).
"""

import json
import os

import pytest

from _util import REPO, torchrun

pytestmark = pytest.mark.dist

TOOL = os.path.join(REPO, "tools", "check_parity.py")

# CP and PP + virtual PP through the tool run in scripts/test_extended.sh (the suite's budget): their numerics
# are test_parity_layouts.py's model-level cases, and the tool's packed path is the MoE case's
EXTENDED = pytest.mark.extended
CASES = [  # the tool's own paths (2 ranks each): padded input, packed THD, CP, PP + virtual PP, an MoE layout
    ("llama", ["--tensor-model-parallel-size", "2", "--padded"]),
    pytest.param("qwen2", ["--context-parallel-size", "2"], marks=EXTENDED),
    pytest.param("qwen3", ["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2"],
                 marks=EXTENDED),
    ("qwen3_moe", ["--tensor-model-parallel-size", "2", "--expert-tensor-parallel-size", "1", "--sequence-parallel"]),
]


def _run(hf, args, nproc=2):
    proc = torchrun(TOOL, nproc, ["--hf-checkpoint", hf, "--json", *args], timeout=600)
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("family,args", CASES,
                         ids=[f"{f}:{' '.join(a)}" for f, a in (getattr(c, "values", c) for c in CASES)])
def test_tool_reports_parity(tiny_hf_models, family, args):
    out = _run(tiny_hf_models(family), args)
    assert out["ok"] is True
    assert out["max_abs_logit_diff"] <= 1e-5 and out["max_abs_logprob_diff"] <= 1e-5
    assert out["packed"] is ("--padded" not in args)
    assert out["family"] == family and out["world_size"] == 2


def test_tool_fails_above_tolerance_and_refuses_bad_layout(tiny_hf_models):
    import subprocess
    import sys

    from _util import free_port

    hf = tiny_hf_models("qwen2")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def launch(*args):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               f"--master-port={free_port()}", TOOL, "--hf-checkpoint", hf, *args]
        return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)

    strict = launch("--tensor-model-parallel-size", "2", "--tolerance", "1e-12")
    # fp32 differences (~1e-6) exceed a 1e-12 tolerance: the tool says so and exits 1
    assert strict.returncode == 1
    assert "tolerance 1e-12  FAIL" in strict.stdout
    bad = launch("--tensor-model-parallel-size", "3")
    assert bad.returncode != 0
    assert "--tensor-model-parallel-size" in bad.stdout + bad.stderr

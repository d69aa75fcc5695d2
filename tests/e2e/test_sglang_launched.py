"""The RL loop launching its own SGLang engines: 2 torchrun ranks, 2 engines colocated (one per rank), the
tensor transport, an engine crash mid-rollout survived with ``--use-fault-tolerance``, end to end; with and
without an sglang-router launched in front of the engines (``--rollout-router on``: the real router of the
test extras); without the router, with the trainer's process groups destroyed for every generation
(``--offload-train-groups on``), the crash's resync included.

Real parts: torchrun (``megatron_rl.infra.launch``) with 2 gloo ranks, megatron-core DP2 training,
``python -m megatron_rl.train`` and its validation, the launcher (local rank 0 starts both engines
with the real ``python -m sglang.launch_server`` command line, every rank learns their URLs through
one all_gather, start-up waits on ``/health``, engines stopped when the run ends), ``SGLangEngine``
routing over both, the colocated hand-over (engines release before training and resume after), the
tensor transport picked by ``auto`` (each rank serialises flattened buckets for the engine on its
device, through file-system shared memory: the engines are other processes), and the
recovery (``runner/engine_faults.py``): one engine dies on its second ``/generate`` (the double's
``die-after-generate:1``), every rank learns it, local rank 0 restarts it on its port, the current
weights are synced again and the same rollout is generated again. The
``sglang`` package on PYTHONPATH is the test double of tests/rollout/sglang_double: SGLang's command
line, the protocol stand-in's HTTP (embedded engine on the same HF files). ``scripts/test_sglang_real.sh``
runs the launcher against real SGLang.
"""

import json
import os
import subprocess
import sys

import pytest

from megatron_rl.infra.ports import free_port

pytestmark = pytest.mark.e2e

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOUBLE = os.path.join(REPO, "tests", "rollout", "sglang_double")


# on: in scripts/test_extended.sh (the suite's 25-min budget); the suite launches the router in front of engines,
# generates through it and stops it (tests/rollout/test_sglang_launcher.py), recovers from a death the router
# served around (tests/runner/test_engine_faults.py), and runs this loop with the router off
@pytest.mark.parametrize("router", ["off", pytest.param("on", marks=pytest.mark.extended)])
def test_loop_launches_two_engines_survives_a_crash_and_stops_them(tiny_hf_models, tmp_path, router):
    hf = tiny_hf_models("qwen2")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": [3, 4, i], "label": str(i)}) + "\n" for i in range(8)))
    reward = tmp_path / "length_reward.py"  # the tiny model has no tokenizer: a reward on token ids
    reward.write_text("def score(sample):\n    return float(sample.response_ids[-1] % 2)\n")
    out, record = tmp_path / "run", tmp_path / "record"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(tmp_path), DOUBLE]),
           "MRL_SGLANG_DOUBLE_RECORD": str(record),
           # off: the engine claiming the fault at start serves 1 /generate and dies on its next (rollout 2); on: the
           # router's cache-aware policy decides which engine gets what, so the first engine to receive a request
           # dies on it (rollout 1)
           "MRL_SGLANG_DOUBLE_FAULT": "die-after-generate:1" if router == "off" else "die-on-first-generate"}
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        env.pop(var, None)
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_rl.infra.launch", "--run-dir", str(out), "--nproc-per-node", "2",
         "--nnodes", "1", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
         "-m", "megatron_rl.train", "--hf-checkpoint", hf, "--actor-num-gpus-per-node", "2",
         "--prompt-data", str(prompts), "--custom-rm-path", "length_reward:score", "--rollout-batch-size", "2",
         "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4", "--num-rollout", "2", "--lr", "1e-2",
         "--rollout-num-gpus", "2", "--sglang-disable-radix-cache", "--rollout-engine-startup-timeout", "120",
         "--use-fault-tolerance", "--rollout-router", router,
         "--colocate", "--output-dir", str(out)]
        # off: also the trainer's process groups torn down for every generation (the GPU default), so the
        # crash's resync (export collectives, the tensor transport's own gloo groups) runs on rebuilt groups
        + (["--offload-train-groups", "on"] if router == "off" else []),
        cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    launched = [json.loads(p.read_text()) for p in sorted(record.glob("*.json"))]
    # one launch per engine by local rank 0 of the one node, and the crashed one once more on its port;
    # colocated engines get --enable-memory-saver (they release and resume around training)
    assert len(launched) == 3 and len({r["argv"][r["argv"].index("--port") + 1] for r in launched}) == 2
    for rec in launched:
        assert rec["argv"][:2] == ["--model-path", hf] and "--disable-radix-cache" in rec["argv"]
        assert "--enable-memory-saver" in rec["argv"]
        assert rec["env"]["RANK"] is None and rec["env"]["MASTER_PORT"] is None  # not a torchrun rank
        try:
            os.kill(rec["pid"], 0)
            raise AssertionError(f"engine pid {rec['pid']} outlived the run")
        except ProcessLookupError:
            pass
    logs = sorted(os.listdir(out / "engines"))
    assert logs == ["engine_0.log", "engine_1.log"] + (["router.log"] if router == "on" else [])
    texts = [(out / "engines" / name).read_text() for name in logs if name.startswith("engine_")]
    assert all("The server is fired up" in t for t in texts)
    assert sorted(t.count("$ ") for t in texts) == [1, 2]  # the restarted engine's log holds both lives
    assert any(("dying on /generate call 2" if router == "off" else "dying on the run's first /generate call") in t
               for t in texts)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "rollout/weight_version" in r]
    # rollout i is generated by the weights of version i on both engines (the stand-ins' meta_info)
    assert [(r["step"], r["rollout/weight_version"]) for r in steps] == [(1, 0.0), (2, 1.0)]
    # without a router the death fails rollout 2's request to that engine: restarted, synced, rollout 2 generated
    # again; the router (0.3.2) retries the failed request of rollout 1 on the other engine and keeps listing the
    # dead one as healthy: rollout 1 completes, the look at the processes after it finds the death, the engine is
    # restarted and synced before training, and rollout 1 is kept
    restarted_at = [r["step"] for r in steps if r.get("rollout/engine_restarts") == 1.0]
    assert restarted_at == ([2] if router == "off" else [1]), [r.get("rollout/engine_restarts") for r in steps]
    if router == "on":  # the failed request was retried on the other engine: the rollout was kept, not redone
        assert "(the rollout was served by the other engines)" in proc.stdout + proc.stderr
    syncs = [r for r in records if "sync/post_s" in r]  # the tensor transport; the resync is not logged: 0, 1, 2
    assert [r["sync/weight_version"] for r in syncs] == [0.0, 1.0, 2.0]
    assert all(r["sync/requests"] >= 1 and r["sync/bytes"] > 0 for r in syncs)
    assert records[0]["perf/startup_engines_s"] > 0  # the launch is its own start-up phase
    # rebuilt after rollout 1's generation; rollout 2's were rebuilt by the crash's resync already (its export
    # needs them), so that step logs no second rebuild
    assert [("perf/groups_rebuild_s" in r) for r in steps] == ([True, False] if router == "off" else [False, False])
    assert json.loads((out / "run_status.json").read_text())["status"] == "finished"


def test_an_engine_spanning_two_nodes_is_launched_in_two_parts_that_meet(tiny_hf_models, tmp_path):
    """Two torchrun nodes on this machine (1 rank each) and one colocated engine of 2 GPUs, bigger than a node:
    each node's local rank 0 starts its part (``--nnodes 2 --node-rank 0|1``, the head's ``--dist-init-addr``,
    learned by node 1 before it starts anything); the parts meet there through torch's TCP store, as SGLang's
    do; the head serves (2 TP ranks: the tensor transport gathers both trainer ranks' entries to it), the
    follower answers /health only; the run trains and syncs through the head, and both parts stop."""
    hf = tiny_hf_models("qwen2")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": [3, 4, i], "label": str(i)}) + "\n" for i in range(8)))
    reward = tmp_path / "length_reward.py"
    reward.write_text("def score(sample):\n    return float(sample.response_ids[-1] % 2)\n")
    out, record = tmp_path / "run", tmp_path / "record"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(tmp_path), DOUBLE]),
           "MRL_SGLANG_DOUBLE_RECORD": str(record)}
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    port = str(free_port())
    nodes = [subprocess.Popen(
        [sys.executable, "-m", "megatron_rl.infra.launch", "--run-dir", str(out), "--nproc-per-node", "1",
         "--nnodes", "2", "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", port,
         "-m", "megatron_rl.train", "--hf-checkpoint", hf, "--actor-num-nodes", "2", "--actor-num-gpus-per-node", "1",
         "--prompt-data", str(prompts), "--custom-rm-path", "length_reward:score", "--rollout-batch-size", "2",
         "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4", "--num-rollout", "2", "--lr", "1e-2",
         "--rollout-num-gpus-per-engine", "2", "--sglang-disable-radix-cache",
         "--rollout-engine-startup-timeout", "120", "--colocate", "--output-dir", str(out)],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for node in (0, 1)]
    outputs = [p.communicate(timeout=400)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], "\n=====\n".join(o[-4000:] for o in outputs)
    launched = sorted((json.loads(p.read_text()) for p in record.glob("*.json")),
                      key=lambda r: r["argv"][r["argv"].index("--node-rank") + 1])
    assert len(launched) == 2
    arg = (lambda rec, name: rec["argv"][rec["argv"].index(name) + 1])
    assert [arg(r, "--node-rank") for r in launched] == ["0", "1"]
    assert all(arg(r, "--nnodes") == "2" and arg(r, "--tp-size") == "2" and "--nccl-port" not in r["argv"]
               for r in launched)
    assert arg(launched[0], "--dist-init-addr") == arg(launched[1], "--dist-init-addr")
    assert arg(launched[0], "--dist-init-addr").split(":")[0] == "127.0.0.1"
    head, follower = (out / "engines" / "engine_0.log").read_text(), (out / "engines" / "engine_0_node1.log").read_text()
    assert "node rank 0 of 2 met the others" in head and "The server is fired up" in head
    assert "node rank 1 of 2 met the others" in follower and "serves /health" in follower
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "rollout/weight_version" in r]
    assert [(r["step"], r["rollout/weight_version"]) for r in steps] == [(1, 0.0), (2, 1.0)]
    syncs = [r for r in records if "sync/post_s" in r]  # the tensor transport into the head, both ranks' entries
    assert [r["sync/weight_version"] for r in syncs] == [0.0, 1.0, 2.0]
    for rec in launched:
        try:
            os.kill(rec["pid"], 0)
            raise AssertionError(f"engine part pid {rec['pid']} outlived the run")
        except ProcessLookupError:
            pass

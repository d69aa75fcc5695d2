"""tools/check_plan.py end to end: exit codes, JSON, stderr, and no heavy imports."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOOL = str(REPO / "tools" / "check_plan.py")


def run(*args):
    proc = subprocess.run([sys.executable, TOOL, *args], cwd=REPO, capture_output=True, text=True, timeout=60)
    return proc.returncode, proc.stdout, proc.stderr


def run_json(*args):
    rc, out, err = run(*args, "--json")
    return rc, json.loads(out), err


def test_importing_the_planner_does_not_import_torch_or_megatron():
    code = ("import sys, megatron_rl.plan, megatron_rl.plan.sources;"
            "heavy = [m for m in ('torch', 'megatron', 'transformers', 'numpy') if m in sys.modules];"
            "print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_tool_does_not_import_torch():
    code = ("import runpy, sys; sys.argv = ['check_plan.py', 'sglang:d2t4', '--json'];"
            "\n"
            "try:\n  runpy.run_path(%r, run_name='__main__')\n"
            "except SystemExit as e:\n  assert e.code == 0, e.code\n"
            "print('torch' in sys.modules, 'megatron' in sys.modules, file=sys.stderr)") % TOOL
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stderr.strip().splitlines()[-1] == "False False"


def test_string_with_cluster_json():
    rc, doc, err = run_json("sglang:d4t4+megatron:(attn:d1p4t2c2|ffn:d1p4t1e4)",
                            "--n-nodes", "4", "--n-gpus-per-node", "8")
    assert rc == 0 and err == ""
    assert doc["valid"] is True and doc["total_gpus"] == 32
    assert doc["has_rollout"] is True and doc["has_training"] is True
    assert doc["cluster"] == {"n_nodes": 4, "gpus_per_node": 8, "total_gpus": 32}
    rollout, actor = doc["components"]
    assert rollout == {"backend": "sglang", "name": None, "role": "rollout",
                       "dims": {"d": 4, "t": 4, "p": 1, "c": 1, "e": 1}, "ffn_dims": None,
                       "spec": "sglang:d4t4", "world_size": 16, "gpus": 16, "colocated_with": []}
    assert actor["dims"] == {"d": 1, "t": 2, "p": 4, "c": 2, "e": 1}
    assert actor["ffn_dims"] == {"d": 1, "t": 1, "p": 4, "c": 1, "e": 4}
    assert (actor["world_size"], actor["gpus"], actor["role"]) == (16, 16, "actor")
    assert doc["placement"] == [[0, 16], [16, 32]]
    assert doc["errors"] == [] and doc["warnings"] == []


def test_colocated_gpus_are_credited_once():
    rc, doc, _ = run_json("sglang[r]:d2+fsdp[a]:d4|fsdp[c]:d4")
    assert rc == 0 and doc["total_gpus"] == 6
    assert [(c["name"], c["role"], c["gpus"], c["colocated_with"]) for c in doc["components"]] == [
        ("r", "rollout", 2, []), ("a", "actor", 4, ["c"]), ("c", "critic", 0, ["a"])]
    assert sum(c["gpus"] for c in doc["components"]) == doc["total_gpus"]


def test_training_only_is_valid_and_says_so():
    rc, out, err = run("fsdp:d2p1t1", "--n-nodes", "1", "--n-gpus-per-node", "4")
    assert rc == 0 and err == ""
    assert "total GPU demand: 2 of 4" in out
    assert "no rollout engine will be started" in out
    assert out.rstrip().endswith("VALID")


def test_table_columns():
    rc, out, _ = run("sglang:d2t2|megatron[actor]:d2t2", "--update-weight-transport", "tensor")
    assert rc == 0
    lines = out.splitlines()
    assert lines[0] == "allocation: sglang:d2t2|megatron[actor]:d2t2"
    assert lines[1].split() == ["backend", "name", "role", "dims", "world", "gpus", "colocated-with"]
    assert lines[3].split() == ["sglang", "-", "rollout", "d2t2", "4", "4", "actor"]
    assert lines[4].split() == ["megatron", "actor", "actor", "d2t2", "4", "0", "rollout"]
    assert "total GPU demand: 4" in out and "weight update: tensor" in out


def test_malformed_string_exits_2_with_caret_on_stderr():
    rc, out, err = run("d4t2")
    assert rc == 2 and out == ""
    assert "write sglang:d4t2 (rollout) or megatron:d4t2 (training)" in err
    assert err.rstrip().endswith("^^^^")


def test_malformed_string_json_still_one_object():
    rc, doc, err = run_json("sglang:d0")
    assert rc == 2 and doc["valid"] is False and doc["total_gpus"] is None
    assert "must be a positive integer, got d0" in doc["errors"][0] and "d0" in err


def test_over_capacity_exits_2_reason_on_stderr():
    rc, out, err = run("sglang:d4t4+megatron:d4t4", "--n-nodes", "1", "--n-gpus-per-node", "8")
    assert rc == 2
    assert "needs 32 GPUs (16 + 16) but the cluster has 8" in err
    assert "INVALID" in out


def test_slime_flags_with_implied_cluster():
    rc, doc, _ = run_json("--actor-num-nodes", "2", "--actor-num-gpus-per-node", "8",
                          "--rollout-num-gpus", "8", "--rollout-num-gpus-per-engine", "4",
                          "--tensor-model-parallel-size", "4", "--pipeline-model-parallel-size", "2")
    assert rc == 0
    assert doc["allocation"] == "sglang[rollout]:d2t4+megatron[actor]:d2p2t4"
    assert doc["total_gpus"] == 24 and doc["weight_update"] == "distributed"
    assert doc["cluster"] == {"n_nodes": 3, "gpus_per_node": 8, "total_gpus": 24}
    assert any("no cluster given; assuming 3 node(s) x 8 GPUs" in i for i in doc["info"])


def test_slime_engine_larger_than_node_is_refused():
    rc, _, err = run("--actor-num-gpus-per-node", "8", "--colocate", "--rollout-num-gpus-per-engine", "16",
                     "--rollout-num-gpus", "16")
    assert rc == 2 and "one inference engine (t*p) has 16 GPUs" in err


def test_areal_args_with_weight_update_error():
    rc, doc, err = run_json("rollout.backend=sglang:d2t4", "actor.backend=fsdp:d8", "cluster.n_nodes=2",
                            "cluster.n_gpus_per_node=8", "actor.weight_update_mode=tensor")
    assert rc == 2 and doc["total_gpus"] == 16
    assert len(doc["errors"]) == 1 and "'tensor' shares CUDA IPC handles" in doc["errors"][0]
    assert "'tensor' shares CUDA IPC handles" in err


def test_areal_issue_752_command_is_valid():
    rc, doc, _ = run_json("allocation_mode=fsdp:d2p1t1", "cluster.n_nodes=1", "cluster.n_gpus_per_node=4",
                          "gconfig.max_new_tokens=2048", "+sglang.attention_backend=triton")
    assert rc == 0 and doc["has_rollout"] is False and doc["has_training"] is True
    assert doc["total_gpus"] == 2 and doc["errors"] == []


def test_model_checks_from_hf_checkpoint(tiny_hf_models):
    path = tiny_hf_models("qwen3_moe")
    rc, doc, _ = run_json("sglang:d2t2+megatron:d2p2t2e4", "--hf-checkpoint", path, "--seq-length", "256",
                          "--virtual-pipeline-model-parallel-size", "2")
    assert rc == 0, doc["errors"]
    assert any("vocab 250 is padded to 256" in i for i in doc["info"])
    rc, doc, err = run_json("megatron:d1t4p2", "--model-config", os.path.join(path, "config.json"),
                            "--virtual-pipeline-model-parallel-size", "4")
    assert rc == 2
    assert any("num_key_value_heads=2 (megatron num_query_groups) is not divisible by t=4" in e
               for e in doc["errors"])
    assert any("num_hidden_layers=4 is not divisible by p*vpp = 2*4" in e for e in doc["errors"])


@pytest.mark.parametrize("args, fragment", [
    ([], "no placement given"),
    (["sglang:d2", "megatron:d2"], "got 2 allocation strings"),
    (["sglang:d2", "--actor-num-nodes", "1"], "placement is stated twice (an allocation string and slime flags)"),
    (["sglang:d2", "--hf-checkpoint", "/x", "--model-config", "/y"], "not both"),
    (["actor.backend=fsdp:d2", "cluster.n_nodes=2", "--n-nodes", "1"], "cluster stated twice"),
    (["sglang:d2", "--hf-checkpoint", "/definitely/missing"], "does not exist"),
])
def test_usage_errors_exit_2(args, fragment):
    rc, _, err = run(*args)
    assert rc == 2 and fragment in err


def test_unknown_flag_is_refused_by_argparse():
    rc, _, err = run("sglang:d2", "--lr", "1e-6")
    assert rc == 2 and "unrecognized arguments: --lr" in err


@pytest.mark.parametrize("args, fragment", [
    (["sglang:d" + "1" * 31], "is too large: the planner accepts at most 1048576"),
    (["sglang:d2", "--n-nodes", "1" + "0" * 30], "argument --n-nodes: 100000000000... (31 digits) is out of range"),
    (["sglang:d2", "--n-gpus-per-node", "\uff18"],
     "argument --n-gpus-per-node: '\uff18' is not a positive integer in ASCII"),
    (["--actor-num-gpus-per-node", "9" * 5001, "--debug-train-only"], "(5001 digits) is out of range"),
])
def test_numbers_are_ascii_and_bounded(args, fragment):
    rc, out, err = run(*args)
    assert rc == 2 and fragment in err and "Traceback" not in err


def test_areal_multi_agent_plan_is_valid_with_its_demand():
    text = "vllm[rollout1]:d2t2 + fsdp[actor1]:d4 + vllm[rollout2]:d4 + fsdp[actor2]:d4"
    rc, doc, err = run_json(text, "--n-nodes", "2", "--n-gpus-per-node", "8")
    assert rc == 0 and err == "" and doc["valid"] is True and doc["errors"] == []
    assert doc["total_gpus"] == 16 and doc["policies"] == ["actor1", "actor2"] and doc["multi_policy"] is True
    assert [c["gpus"] for c in doc["components"]] == [4, 4, 4, 4]
    rc, out, _ = run(text)
    assert rc == 0 and "multi-policy plan: 2 actors (actor1, actor2)" in out and out.rstrip().endswith("VALID")

"""validate_plan against clusters and tiny HF model configs."""

import json
import os

import pytest

from megatron_rl.errors import PlanError
from megatron_rl.plan import Cluster, ModelShape, parse_allocation, validate_plan


def _errors(text, **kw):
    return validate_plan(parse_allocation(text, weight_update=kw.pop("weight_update", None)), **kw).errors


# -- cluster ------------------------------------------------------------------------
def test_fits_and_places_groups_on_disjoint_ranges():
    plan = parse_allocation("sglang:d2t4+megatron:d2p2t2")
    report = validate_plan(plan, Cluster(2, 8))
    assert report.ok and report.errors == ()
    assert report.placement == ((0, 8), (8, 16))


def test_demand_over_capacity_names_both_numbers():
    report = validate_plan(parse_allocation("sglang:d4t4+megatron:d4t4"), Cluster(1, 8))
    assert not report.ok
    (err,) = report.errors
    assert "needs 32 GPUs (16 + 16) but the cluster has 8 (1 node(s) x 8 GPUs)" in err
    assert report.placement == ()


def test_tp_group_must_not_span_nodes():
    errs = _errors("megatron:d1t16", cluster=Cluster(2, 8))
    assert len(errs) == 1 and "a tensor-parallel group has 16 GPUs" in errs[0]
    assert "does not divide 8 GPUs per node" in errs[0]


def test_inference_engine_t_times_p_must_stay_in_a_node():
    errs = _errors("sglang:d1t4p4", cluster=Cluster(2, 8))
    assert len(errs) == 1 and "one inference engine (t*p) has 16 GPUs" in errs[0]
    assert _errors("sglang:d2t4p2", cluster=Cluster(2, 8)) == ()


def test_tp_that_does_not_divide_node_size():
    errs = _errors("megatron:d2t3", cluster=Cluster(1, 8))
    assert len(errs) == 1 and "has 3 GPUs, which does not divide 8" in errs[0]


def test_placement_aligns_groups_so_tp_stays_in_node():
    # sglang:d3 (3 GPUs, unit 1) + megatron:d1t4 (unit 4) on 2x4: placing megatron first keeps
    # its TP group on node 0; naive order would put it on GPUs 3-6 across the boundary.
    report = validate_plan(parse_allocation("sglang:d3+megatron:d1t4"), Cluster(2, 4))
    assert report.ok
    assert report.placement == ((4, 7), (0, 4))


def test_mixed_units_that_divide_the_node_fit():
    # 2 x 6 GPUs: two t3 TP groups fill node 0, three t2 engines fill node 1.
    report = validate_plan(parse_allocation("megatron:d2t3+sglang:d3t2"), Cluster(2, 6))
    assert report.ok and report.placement == ((0, 6), (6, 12))


def test_demand_over_capacity_with_several_parts():
    errs = _errors("megatron:d1t3+sglang[a]:d1t2+sglang[b]:d1t2", cluster=Cluster(1, 6))
    assert len(errs) == 1 and "needs 7 GPUs (3 + 2 + 2) but the cluster has 6" in errs[0]


def test_alignment_padding_can_exceed_capacity():
    # 1 x 12: t4 groups go first (0-3, 4-7); the t3 group must start at a multiple of 3 (9-11).
    report = validate_plan(parse_allocation("megatron:d1t4+sglang:d1t3+megatron[ref]:d1t4"), Cluster(1, 12))
    assert report.ok and report.placement == ((0, 4), (9, 12), (4, 8))
    # One more GPU fits by count (12 of 12) but not once the t3 group is aligned: 13 slots.
    errs = _errors("megatron:d1t4+sglang:d1t3+megatron[ref]:d1t4+sglang[b]:d1", cluster=Cluster(1, 12))
    assert len(errs) == 1 and "keeping every TP group / engine inside one node needs 13 GPU slots" in errs[0]


def test_idle_gpus_are_reported_as_info():
    report = validate_plan(parse_allocation("fsdp:d2p1t1"), Cluster(1, 4))
    assert report.ok
    assert "2 of 4 GPUs stay idle" in report.info
    assert any("training only: no rollout engine will be started" in i for i in report.info)


def test_cluster_rejects_non_positive_sizes():
    with pytest.raises(PlanError, match=r"gpus_per_node=0 is invalid \(--n-gpus-per-node"):
        Cluster(1, 0)


# -- roles and weight update ----------------------------------------------------------
def test_colocated_world_mismatch_is_a_warning():
    report = validate_plan(parse_allocation("sglang:d2|megatron:d8", weight_update="tensor"))
    assert report.ok
    assert len(report.warnings) == 1
    assert "different world sizes (rollout=2, actor=8); the group takes 8 GPUs" in report.warnings[0]


def test_tensor_transport_requires_colocation():
    errs = _errors("sglang:d2t4+fsdp:d8", weight_update="tensor")
    assert len(errs) == 1 and "'tensor' shares CUDA IPC handles" in errs[0]
    assert _errors("sglang:d2t4|fsdp:d8", weight_update="tensor") == ()


def test_distributed_transport_cannot_share_a_gpu():
    errs = _errors("sglang:d8|megatron:d8", weight_update="xccl")
    assert len(errs) == 1 and "NCCL cannot put two ranks on one GPU" in errs[0]
    assert _errors("sglang:d8+megatron:d8", weight_update="xccl") == ()


def test_disk_transport_is_slow_warning():
    report = validate_plan(parse_allocation("sglang:d2+fsdp:d2", weight_update="disk"))
    assert report.ok and any("'disk' writes and re-reads a full HF checkpoint" in w for w in report.warnings)


def test_default_transport_is_reported():
    report = validate_plan(parse_allocation("sglang:d2|fsdp:d2"))
    assert "weight update mode not stated; the default for this placement is 'tensor'" in report.info
    report = validate_plan(parse_allocation("sglang:d2+fsdp:d2"))
    assert "weight update mode not stated; the default for this placement is 'distributed'" in report.info


def test_rollout_without_actor_is_an_error():
    errs = _errors("sglang:d2+fsdp[critic]:d2")
    assert len(errs) == 1 and "no training component is the actor" in errs[0]


def test_weight_update_without_rollout_is_unused_info():
    report = validate_plan(parse_allocation("megatron:d2", weight_update="tensor"))
    assert report.ok and "weight update mode 'tensor' is unused: there is no rollout engine" in report.info


def test_raise_for_errors_lists_all():
    report = validate_plan(parse_allocation("sglang:d8t2+megatron:d8t2", weight_update="tensor"), Cluster(1, 8))
    with pytest.raises(PlanError) as info:
        report.raise_for_errors()
    assert str(info.value).count("\n  - ") == 2


# -- model ------------------------------------------------------------------------------
def test_model_shape_from_tiny_configs(tiny_hf_models):
    dense = ModelShape.from_hf_config(tiny_hf_models("llama"))
    assert (dense.num_attention_heads, dense.num_query_groups, dense.num_layers) == (4, 2, 4)
    assert (dense.vocab_size, dense.num_experts, dense.max_position_embeddings) == (250, 0, 512)
    moe = ModelShape.from_hf_config(os.path.join(tiny_hf_models("qwen3_moe"), "config.json"))
    assert moe.num_experts == 4 and moe.is_moe
    assert dense.padded_vocab_size(1) == 256 and dense.padded_vocab_size(2) == 256
    assert dense.padded_vocab_size(4) == 512


def test_model_shape_expert_key_aliases_and_text_config():
    base = dict(num_attention_heads=8, num_key_value_heads=8, num_hidden_layers=2, vocab_size=100)
    assert ModelShape.from_hf_config({**base, "num_local_experts": 8}).num_experts == 8
    assert ModelShape.from_hf_config({**base, "n_routed_experts": 64}).num_experts == 64
    no_kv = dict(base)
    del no_kv["num_key_value_heads"]
    assert ModelShape.from_hf_config(no_kv).num_query_groups == 8
    assert ModelShape.from_hf_config({"text_config": base}).num_layers == 2


def test_model_shape_errors_name_the_key_and_file(tmp_path):
    with pytest.raises(PlanError, match="has no 'num_hidden_layers'"):
        ModelShape.from_hf_config({"num_attention_heads": 4, "vocab_size": 10})
    with pytest.raises(PlanError, match="does not exist; pass an HF checkpoint directory"):
        ModelShape.from_hf_config(tmp_path / "nope")
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(PlanError, match="cannot read model config"):
        ModelShape.from_hf_config(tmp_path)


def test_dense_layouts_against_tiny_llama(tiny_hf_models):
    model = ModelShape.from_hf_config(tiny_hf_models("llama"))
    ok = validate_plan(parse_allocation("sglang:d2t2+megatron:d1t2p2"), model=model, vpp=2)
    assert ok.errors == ()
    assert "actor: vocab 250 is padded to 256 (multiple of 128*t = 256) in megatron" in ok.info

    errs = _errors("megatron:d1t4", model=model)   # 4 heads ok, 2 kv groups not
    assert len(errs) == 1 and "num_key_value_heads=2 (megatron num_query_groups) is not divisible by t=4" in errs[0]

    errs = _errors("megatron:d1t8", model=model)
    assert any("num_attention_heads=4 is not divisible by tensor parallel t=8; choose t from 1, 2, 4" in e
               for e in errs)

    errs = _errors("megatron:d1p3", model=model)
    assert errs == ("actor (megatron:d1p3): num_hidden_layers=4 is not divisible by p=3; each "
                    "pipeline (virtual) stage needs the same number of layers",)

    errs = _errors("megatron:d1p2", model=model, vpp=4)
    assert len(errs) == 1 and "not divisible by p*vpp = 2*4" in errs[0]

    errs = _errors("megatron:d2", model=model, vpp=2)
    assert len(errs) == 1 and "virtual pipeline size 2 needs pipeline parallel p>1" in errs[0]


def test_inference_tp_must_divide_heads(tiny_hf_models):
    model = ModelShape.from_hf_config(tiny_hf_models("llama"))
    errs = _errors("sglang:d1t8", model=model)
    assert any("num_attention_heads=4 is not divisible by tensor parallel t=8" in e for e in errs)
    # t=4 > kv heads=2: the engine replicates KV heads (4 % 2 == 0), allowed.
    assert _errors("sglang:d1t4", model=model) == ()
    assert any("exceeds num_hidden_layers=4" in e for e in _errors("sglang:d1p8", model=model))


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "glm4_moe", "deepseek_v3", "gpt_oss"])
def test_expert_parallel_against_tiny_moe(tiny_hf_models, family):
    """Each MoE family names its experts differently (num_experts / num_local_experts / n_routed_experts)."""
    moe = ModelShape.from_hf_config(tiny_hf_models(family))
    dense = ModelShape.from_hf_config(tiny_hf_models("llama"))
    assert _errors("megatron:d4e4", model=moe) == ()
    assert _errors("megatron:(attn:d2t2|ffn:d1t1e4)", model=moe) == ()
    errs = _errors("megatron:d8e8", model=moe)
    assert len(errs) == 1 and "num_experts=4 is not divisible by expert parallel e=8; choose e from 1, 2, 4" in errs[0]
    errs = _errors("megatron:d2e2", model=dense)
    assert len(errs) == 1 and "needs an MoE model" in errs[0]


def test_sequence_length_and_context_parallel():
    model = ModelShape.from_hf_config(dict(num_attention_heads=4, num_key_value_heads=2,
                                           num_hidden_layers=4, vocab_size=256,
                                           max_position_embeddings=512))
    assert _errors("megatron:d1c2", model=model, seq_length=512) == ()
    errs = _errors("megatron:d1c4", model=model, seq_length=500)
    assert errs == ("actor (megatron:d1c4): sequence length 500 must be divisible by 2*c = 8 (context "
                    "parallel splits each sequence into 2*c load-balanced chunks); pad to 504",)
    report = validate_plan(parse_allocation("megatron:d1"), model=model, seq_length=1024)
    assert report.ok and any("exceeds the model's max_position_embeddings=512" in w for w in report.warnings)
    assert "must be a positive integer" in _errors("megatron:d1", seq_length=0)[0]


def test_no_vocab_padding_info_when_already_aligned(tmp_path):
    cfg = dict(num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=2, vocab_size=256)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    report = validate_plan(parse_allocation("megatron:d1t2"), model=ModelShape.from_hf_config(str(path)))
    assert report.ok and not any("padded" in i for i in report.info)


def test_cluster_sizes_are_bounded():
    with pytest.raises(PlanError, match="cluster n_nodes=a number of about 31 digits is too large"):
        Cluster(10 ** 30, 8)
    with pytest.raises(PlanError, match="2048 node.s. x 1024 GPUs = 2097152 GPUs is more than the planner's limit"):
        Cluster(2048, 1024)
    assert Cluster(1024, 1024).total_gpus == 2 ** 20


def test_multi_policy_plan_is_valid_and_reported():
    plan = parse_allocation("vllm[rollout1]:d2t2 + fsdp[actor1]:d4 + vllm[rollout2]:d4 + fsdp[actor2]:d4")
    report = validate_plan(plan, Cluster(2, 8))
    assert report.ok and report.placement == ((0, 4), (4, 8), (8, 12), (12, 16))
    assert any(i.startswith("multi-policy plan: 2 actors (actor1, actor2) each train their own policy on 16 GPUs")
               and "megatron_rl.train trains one policy per run" in i for i in report.info)


def test_multi_policy_weight_update_must_suit_every_engine():
    """One engine colocated with its actor, the other on separate GPUs: no single transport fits."""
    text = "sglang[rollout1]:d4|fsdp[actor1]:d4+sglang[rollout2]:d4+fsdp[actor2]:d4"
    assert any("'tensor' shares CUDA IPC handles" in e for e in _errors(text, weight_update="tensor"))
    assert any("NCCL cannot put two ranks on one GPU" in e for e in _errors(text, weight_update="distributed"))


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_text"])
def test_gated_delta_net_layers_limit_tp_and_refuse_cp(tiny_hf_models, family):
    """Hybrid models: TP shards the delta-net's key heads in whole groups, and CP is not built for its state, so
    the plan (and --dry-run) refuses both before any worker starts, as the bridge would at build time."""
    model = ModelShape.from_hf_config(tiny_hf_models(family))
    assert model.linear_num_key_heads == 2 and ModelShape.from_hf_config(tiny_hf_models("qwen3")).linear_num_key_heads == 0
    assert _errors("megatron:d1t2", model=model) == ()
    errs = _errors("megatron:d1t4", model=model)
    assert any("linear_num_key_heads=2 (the gated delta-net layers) is not divisible by t=4" in e for e in errs), errs
    errs = _errors("megatron:d1c2", model=model, seq_length=64)
    assert errs == ("actor (megatron:d1c2): context parallel c=2 with gated delta-net layers (linear_num_key_heads=2)"
                    ": their recurrent state and convolution window would pass from one CP rank to the next, which "
                    "is not built; drop c",)

"""slime flags and AReaL key=value args resolve into the same Allocation as strings."""

import pytest

from megatron_rl.errors import PlanError
from megatron_rl.plan import Cluster, Dims, parse_allocation, plan_from_areal_args, plan_from_slime_flags


# -- slime ----------------------------------------------------------------------------
def test_slime_separate_rollout_and_actor():
    plan = plan_from_slime_flags(actor_num_nodes=2, actor_num_gpus_per_node=8, rollout_num_gpus=8,
                                 rollout_num_gpus_per_engine=2, tensor_model_parallel_size=2,
                                 pipeline_model_parallel_size=2)
    assert plan == parse_allocation("sglang[rollout]:d4t2+megatron[actor]:d4t2p2", weight_update="distributed")
    assert plan.total_gpus == 24
    assert plan.actor.dp == 4 and plan.rollout[0].num_engines == 4 and plan.rollout[0].engine_size == 2


def test_slime_colocate_defaults_rollout_gpus_to_actor_world_and_tensor_transport():
    plan = plan_from_slime_flags(actor_num_nodes=1, actor_num_gpus_per_node=8, colocate=True,
                                 rollout_num_gpus_per_engine=4, context_parallel_size=2)
    assert plan.to_string() == "sglang[rollout]:d2t4|megatron[actor]:d4c2"
    assert plan.total_gpus == 8 and plan.weight_update == "tensor"
    assert plan.colocated_with(plan.actor) == plan.rollout


def test_slime_train_only_is_valid_without_rollout_flags():
    plan = plan_from_slime_flags(actor_num_nodes=1, actor_num_gpus_per_node=4, debug_train_only=True)
    assert not plan.has_rollout and plan.total_gpus == 4 and plan.weight_update is None


def test_slime_rollout_only():
    plan = plan_from_slime_flags(rollout_num_gpus=4, rollout_num_gpus_per_engine=2, debug_rollout_only=True)
    assert plan.to_string() == "sglang[rollout]:d2t2" and not plan.has_training


def test_slime_expert_parallel_uses_megatron_default_expert_tp():
    # --expert-tensor-parallel-size defaults to TP in megatron, so EP4 x ETP2 on 8 GPUs.
    plan = plan_from_slime_flags(actor_num_gpus_per_node=8, debug_train_only=True,
                                 tensor_model_parallel_size=2, expert_model_parallel_size=4)
    actor = plan.actor
    assert actor.is_hybrid and actor.dims == Dims(d=4, t=2) and actor.ffn == Dims(d=1, t=2, e=4)
    assert (actor.ep, actor.etp, actor.edp, actor.world_size) == (4, 2, 1, 8)
    flat = plan_from_slime_flags(actor_num_gpus_per_node=8, debug_train_only=True,
                                 tensor_model_parallel_size=2, expert_model_parallel_size=4,
                                 expert_tensor_parallel_size=1)
    assert flat.to_string() == "megatron[actor]:d4t2e4" and flat.actor.edp == 2


def test_slime_fsdp_backend():
    plan = plan_from_slime_flags(actor_num_gpus_per_node=4, train_backend="fsdp", rollout_num_gpus=4)
    assert plan.to_string() == "sglang[rollout]:d4+fsdp[actor]:d4"


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(actor_num_gpus_per_node=6, tensor_model_parallel_size=4, debug_train_only=True),
     "actor world 6 (--actor-num-nodes 1 x --actor-num-gpus-per-node 6) is not divisible by t*p*c"),
    (dict(actor_num_gpus_per_node=8), "--rollout-num-gpus is required unless --colocate"),
    (dict(rollout_num_gpus=6, rollout_num_gpus_per_engine=4),
     "--rollout-num-gpus 6 is not a multiple of --rollout-num-gpus-per-engine 4"),
    (dict(actor_num_nodes=0, debug_train_only=True), "--actor-num-nodes=0 is invalid"),
    (dict(debug_train_only=True, debug_rollout_only=True), "exclude each other"),
    (dict(train_backend="fsdp", tensor_model_parallel_size=2, debug_train_only=True),
     "--train-backend fsdp is FSDP2 on a 1-D data-parallel mesh"),
    (dict(train_backend="deepspeed", debug_train_only=True), "--train-backend='deepspeed' is unknown"),
    (dict(actor_num_gpus_per_node=4, tensor_model_parallel_size=2, expert_model_parallel_size=4,
          debug_train_only=True), "not divisible by expert-TP x EP x PP = 2*4*1"),
    (dict(rollout_num_gpus=2, update_weight_transport="rdma"), "weight update mode='rdma' is unknown"),
])
def test_slime_errors_name_the_flag(kwargs, fragment):
    with pytest.raises(PlanError) as info:
        plan_from_slime_flags(**kwargs)
    assert fragment in str(info.value)


# -- AReaL ----------------------------------------------------------------------------
def test_areal_per_role_backends_and_cluster():
    plan, cluster = plan_from_areal_args([
        "rollout.backend=sglang:d2t4", "actor.backend=fsdp:d8", "cluster.n_nodes=2",
        "cluster.n_gpus_per_node=8", "actor.weight_update_mode=xccl"])
    assert plan == parse_allocation("sglang[rollout]:d2t4+fsdp[actor]:d8", weight_update="distributed")
    assert cluster == Cluster(2, 8) and plan.total_gpus == 16


def test_areal_training_only_allocation_mode_is_valid():
    """The AReaL #752 command: fsdp-only allocation_mode must not demand a rollout backend."""
    plan, cluster = plan_from_areal_args([
        "allocation_mode=fsdp:d2p1t1", "experiment_name=test", "trial_name=test",
        "cluster.n_nodes=1", "cluster.n_gpus_per_node=4", "gconfig.max_new_tokens=2048",
        "train_dataset.batch_size=1024", "+sglang.attention_backend=triton"])
    assert not plan.has_rollout and plan.actor.backend == "fsdp" and plan.total_gpus == 2
    assert cluster == Cluster(1, 4)


def test_areal_actor_only_per_role_is_training_only():
    plan, cluster = plan_from_areal_args(["actor.backend=megatron:d2t2"])
    assert cluster is None and not plan.has_rollout and plan.total_gpus == 4


def test_areal_colocation_via_scheduling_strategy():
    plan, _ = plan_from_areal_args([
        "rollout.backend=sglang:d4t2", "actor.backend=megatron:d4t2", "critic.backend=megatron:d4t2",
        "critic.scheduling_strategy.type=colocation", "critic.scheduling_strategy.target=actor",
        "ref.backend=megatron:d8", "ref.scheduling_strategy.type=colocation",
        "ref.scheduling_strategy.target=critic"])
    assert plan.to_string() == ("sglang[rollout]:d4t2+megatron[actor]:d4t2|megatron[critic]:d4t2"
                                "|megatron[ref]:d8")
    assert plan.total_gpus == 16 and [c.role for c in plan.components] == ["rollout", "actor", "critic", "ref"]


def test_areal_rollout_can_colocate_onto_actor_declared_after_it():
    plan, _ = plan_from_areal_args([
        "rollout.backend=sglang:d8", "actor.backend=fsdp:d8",
        "rollout.scheduling_strategy.type=colocation", "rollout.scheduling_strategy.target=actor"])
    assert plan.to_string() == "fsdp[actor]:d8|sglang[rollout]:d8" and plan.total_gpus == 8


def test_areal_keeps_explicit_component_names():
    plan, _ = plan_from_areal_args(["rollout.backend=sglang[gen]:d2", "actor.backend=fsdp[policy]:d2"])
    assert [(c.name, c.role) for c in plan.components] == [("gen", "rollout"), ("policy", "actor")]


@pytest.mark.parametrize("args, fragment", [
    (["allocation_mode=sglang:d2+fsdp:d2", "actor.backend=fsdp:d2"], "both state placement"),
    (["cluster.n_nodes=2"], "no placement given"),
    (["rollout.backend=fsdp:d2"], "the rollout needs a sglang or vllm backend"),
    (["actor.backend=sglang:d2"], "the actor needs a megatron or fsdp backend"),
    (["actor.backend=fsdp:d2+sglang:d2"], "must be one component"),
    (["actor.backend=fsdp:d2e2"], "actor.backend: bad allocation 'fsdp:d2e2'"),
    (["actor.backend=fsdp:d2", "cluster.n_nodes=two"], "cluster.n_nodes='two' is not an integer"),
    (["actor.backend=fsdp:d2", "cluster.n_gpus_per_node=0"], "gpus_per_node=0 is invalid"),
    (["actor.backend=fsdp:d2", "actor.weight_update_mode=ipc"], "actor.weight_update_mode='ipc' is unknown"),
    (["actor.backend=fsdp:d2", "sglang:d2"], "'sglang:d2' is not key=value"),
    (["actor.backend=fsdp:d2", "actor.backend=fsdp:d4"], "actor.backend is given twice"),
    (["actor.backend=fsdp:d2", "actor.scheduling_strategy.type=colocation",
      "actor.scheduling_strategy.target=rollout"], "must name another role"),
    (["actor.backend=fsdp:d2", "actor.scheduling_strategy.type=shared"], "is unknown; use separation"),
])
def test_areal_errors(args, fragment):
    with pytest.raises(PlanError) as info:
        plan_from_areal_args(args)
    assert fragment in str(info.value)


@pytest.mark.parametrize("args, fragment", [
    (["actor.backend=fsdp:d2", "cluster.n_nodes=\uff12"],
     "cluster.n_nodes='\uff12' is not an integer: write it with the ASCII digits 0-9"),
    (["actor.backend=fsdp:d2", "cluster.n_gpus_per_node=+8"], "is not an integer"),
    (["actor.backend=fsdp:d2", "cluster.n_nodes=1" + "0" * 30],
     "(31 digits) is too large: the planner accepts at most 1048576"),
    (["actor.backend=fsdp:d2", "cluster.n_nodes=" + "9" * 5001], "(5001 digits) is too large"),
])
def test_areal_cluster_numbers_are_ascii_and_bounded(args, fragment):
    with pytest.raises(PlanError) as info:
        plan_from_areal_args(args)
    assert fragment in str(info.value)


def test_slime_sizes_are_bounded():
    with pytest.raises(PlanError, match="--actor-num-gpus-per-node=a number of about 31 digits is too large"):
        plan_from_slime_flags(actor_num_gpus_per_node=10 ** 30, debug_train_only=True)

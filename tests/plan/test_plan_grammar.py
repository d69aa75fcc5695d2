"""Allocation-string grammar: demand, structure, round-trip, and pointed errors."""

import dataclasses
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rl.errors import PlanError
from megatron_rl.plan import Allocation, Component, Dims, parse_allocation


@pytest.mark.parametrize("text, gpus", [
    ("sglang:d2t4", 8),
    ("sglang:d4t4+megatron:(attn:d1p4t2c2|ffn:d1p4t1e4)", 32),
    ("sglang[r]:d2+fsdp[a]:d4|fsdp[c]:d4", 6),
    ("megatron:d2p2t4e4", 16),
    ("fsdp:d2p1t1", 2),
    ("vllm:d2p2t2", 8),
    ("megatron:c2d2", 4),
    ("sglang:d4t2|megatron:d2t4", 8),          # colocated: same GPUs
    ("sglang:d2|megatron:d8", 8),              # colocated, worlds differ: the max counts
    ("sglang:d2t4+megatron:d2p2t2+fsdp[ref]:d4", 20),
    (" sglang : d2t4 + megatron : d1t8 ", 16),  # whitespace between tokens
    ("megatron:attn:d2t2|ffn:d1t1e4", 4),      # hybrid without parentheses (AReaL accepts it)
])
def test_total_gpu_demand(text, gpus):
    assert parse_allocation(text).total_gpus == gpus


def test_structure_of_a_hybrid_moe_plan():
    plan = parse_allocation("sglang:d4t4+megatron:(attn:d1p4t2c2|ffn:d1p4t1e4)")
    rollout, actor = plan.components
    assert (rollout.backend, rollout.role, rollout.num_engines, rollout.engine_size) == ("sglang", "rollout", 4, 4)
    assert actor.is_hybrid and actor.role == "actor"
    assert (actor.dp, actor.tp, actor.pp, actor.cp) == (1, 2, 4, 2)
    assert (actor.ep, actor.etp, actor.edp, actor.world_size) == (4, 1, 1, 16)
    assert plan.actor is actor and plan.has_rollout and plan.has_training


def test_flat_megatron_expert_layout_uses_expert_tp_1():
    c = parse_allocation("megatron:d2p2t4e4").components[0]
    assert (c.world_size, c.ep, c.etp, c.edp) == (16, 4, 1, 2)


def test_missing_dims_default_to_one_and_order_is_free():
    a = parse_allocation("megatron:t2d4").components[0]
    b = parse_allocation("megatron:d4t2p1c1e1").components[0]
    assert a.dims == b.dims == Dims(d=4, t=2)


def test_training_only_plan_is_valid_and_has_no_rollout():
    plan = parse_allocation("fsdp:d2p1t1")
    assert plan.total_gpus == 2
    assert not plan.has_rollout and plan.has_training
    assert plan.actor.backend == "fsdp" and plan.actor.dp == 2


def test_rollout_only_plan():
    plan = parse_allocation("sglang:d2t4")
    assert plan.has_rollout and not plan.has_training and plan.actor is None


def test_roles_from_names_and_colocation():
    plan = parse_allocation("sglang[r]:d2+fsdp[a]:d4|fsdp[c]:d4")
    assert [c.role for c in plan.components] == ["rollout", "actor", "critic"]
    assert [g.gpus for g in plan.groups] == [2, 4]
    critic = plan["c"]
    assert [m.name for m in plan.colocated_with(critic)] == ["a"]
    assert plan["critic"] is critic and plan["actor"] is plan["a"]
    with pytest.raises(KeyError, match="no component named or with role 'teacher'"):
        plan["teacher"]


def test_short_aliases_only_apply_when_they_fit_the_backend():
    plan = parse_allocation("sglang[a]:d1+sglang[rm]:d2+megatron[r]:d2+megatron[c]:d2")
    assert [c.role for c in plan.components] == ["rollout", "reward", "r", "critic"]
    assert [c.name for c in plan.rollout] == ["a"]          # the reward server is not a rollout engine
    assert plan.actor is None


def test_identical_unnamed_engines_are_kept_apart():
    plan = parse_allocation("sglang:d2|megatron:d2+sglang:d2")
    first, actor, second = plan.components
    assert first == second and plan.group_of(second) is plan.groups[1]
    assert plan.colocated_with(actor) == (first,) and plan.colocated_with(second) == ()


def test_custom_name_is_its_own_role():
    plan = parse_allocation("sglang:d2+megatron:d2+megatron[reward_model]:d2")
    assert [c.role for c in plan.components] == ["rollout", "actor", "reward_model"]


@pytest.mark.parametrize("text", [
    "sglang:d2t4",
    "sglang[gen]:d4t2|megatron[actor]:d2p2t2",
    "sglang:d4t4+megatron:(attn:d1p4t2c2|ffn:d1p4t1e4)",
    "vllm:d1t2p2+fsdp[policy]:d4+megatron[ref]:d2c2",
])
def test_round_trip_through_canonical_string(text):
    plan = parse_allocation(text)
    again = parse_allocation(plan.to_string())
    assert again == plan and again.total_gpus == plan.total_gpus


_train_dims = st.builds(Dims, d=st.integers(1, 8), t=st.integers(1, 8), p=st.integers(1, 4), c=st.integers(1, 4))
_inf_dims = st.builds(Dims, d=st.integers(1, 8), t=st.integers(1, 8), p=st.integers(1, 4))


@settings(max_examples=60, deadline=None)
@given(inf=_inf_dims, train=_train_dims, colocate=st.booleans())
def test_demand_rule_property(inf, train, colocate):
    """Separate parts add; colocated members cost the largest member's world only."""
    joint = "|" if colocate else "+"
    plan = parse_allocation(f"sglang:{inf}{joint}megatron:{train}")
    w_inf = inf.d * inf.t * inf.p
    w_train = train.d * train.t * train.p * train.c
    assert plan.total_gpus == (max(w_inf, w_train) if colocate else w_inf + w_train)
    assert parse_allocation(plan.to_string()) == plan


def _caret_column(message: str) -> int:
    """1-based column of the first caret in the message's last line."""
    return message.splitlines()[-1].index("^") - 1


@pytest.mark.parametrize("text, fragment, column", [
    ("d4t2", "write sglang:d4t2 (rollout) or megatron:d4t2", 1),
    ("sglang:d4+d4t2", "'d4t2' has no backend", 11),
    ("sglang:d0", "must be a positive integer, got d0", 8),
    ("fsdp:d2e2", "fsdp does not support expert parallel (e2)", 1),
    ("fsdp:d2t2", "FSDP2 on a 1-D data-parallel mesh", 1),
    ("fsdp:d2p2", "p2 (pipeline parallel) is refused", 1),
    ("fsdp:d2c2", "c2 (context parallel) is refused", 1),
    ("megatron:(attn:d1p4t2c2|ffn:d1p4t1e4", "unbalanced '('", 10),
    ("sglang:d2)", "unbalanced ')'", 10),
    ("(sglang:d2)", "'(' without a backend", 1),
    ("sglang[x]:d2+fsdp[x]:d2", "component name 'x' is already used at column 8", 19),
    ("tgi:d2", "unknown backend 'tgi'", 1),
    ("sglnag:d2", "did you mean sglang?", 1),
    ("sglang:x2", "unknown degree letter 'x'", 8),
    ("sglang:d2d4", "'d' is given twice", 10),
    ("sglang:c2", "sglang does not take 'c' (context parallel)", 8),
    ("vllm:d2e2", "vllm does not take 'e'", 8),
    ("sglang:d2++fsdp:d2", "empty component before '+'", 11),
    ("sglang:d2+", "empty component at the end", 11),
    ("+sglang:d2", "empty component before '+'", 1),
    ("sglang:d2||megatron:d2", "empty component before '|'", 11),
    ("sglang:", "no parallel degrees after ':'", 8),
    ("sglang d2", "expected ':' after 'sglang'", 8),
    ("sglang:d2 megatron:d2", "join components with '+'", 11),
    ("sglang:t", "'t' needs a size", 8),
    ("fsdp[:d2", "expected a component name", 5),
    ("fsdp[x:d2", "unbalanced '['", 5),
    ("megatron:(attn:d1p4t2|ffn:d1p2t1e8)", "ffn p2 must equal attn p4", 1),
    ("megatron:(attn:d1p4t2|ffn:d1p4t1e4)", "attn world d*t*p*c = 8 must equal ffn world d*t*p*e = 16", 1),
    ("megatron:(attn:d1e2|ffn:d2e1)", "attn section does not take 'e' (expert parallel); it takes only d, t, p, c; move it to the ffn section", 18),
    ("megatron:(attn:d2|ffn:d1c2)", "ffn section does not take 'c' (context parallel); it takes only d, t, p, e; move it to the attn section", 25),
    ("megatron:(ffn:d2e2|attn:d4)", "expected 'attn:' here", 11),
    ("fsdp:(attn:d2|ffn:d1e2)", "hybrid layout is megatron-only", 6),
    ("attn:d2|ffn:d2", "needs its backend", 1),
    ("megatron:d2e4", "expert parallel e4 must divide d*t*c = 2", 1),
])
def test_malformed_input_points_at_the_offending_part(text, fragment, column):
    with pytest.raises(PlanError) as info:
        parse_allocation(text)
    message = str(info.value)
    assert fragment in message
    assert repr(text) in message                      # the input is quoted
    assert f"at column {column}:" in message
    assert _caret_column(message) == column
    assert message.splitlines()[-2].strip() == text.strip()


@pytest.mark.parametrize("text, fragment", [
    ("", "the allocation string is empty"),
    ("   ", "the allocation string is empty"),
    ("sglang:d2+megatron:d2+megatron:d4", "role is ambiguous; name it"),
    ("megatron[actor]:d2+fsdp[a]:d2", "two components resolve to role 'actor'"),
    ("sglang[actor]:d2", "an inference backend cannot be the actor"),
    ("vllm[critic]:d2", "an inference backend cannot be the critic"),
    ("fsdp[rollout]:d2", "a training backend cannot be the rollout engine"),
])
def test_plan_level_errors(text, fragment):
    with pytest.raises(PlanError, match=re.escape(fragment)):
        parse_allocation(text)


def test_unbalanced_bracket_in_hybrid_shows_opening_column():
    with pytest.raises(PlanError) as info:
        parse_allocation("sglang:d8+megatron:(attn:d1p2t2|ffn:d1p2e2")
    assert "at column 20:" in str(info.value)


def test_components_cannot_be_built_invalid_in_code():
    """The dataclass enforces the same invariants as the parser (no invalid plan exists)."""
    with pytest.raises(PlanError, match="fsdp does not support expert parallel"):
        Component("fsdp", Dims(d=2, e=2))
    with pytest.raises(PlanError, match="must be a positive integer"):
        Dims(d=0)
    with pytest.raises(PlanError, match="unknown backend 'trt'"):
        Component("trt", Dims())
    with pytest.raises(PlanError, match="allocation is empty"):
        Allocation(())
    with pytest.raises(PlanError, match="weight update mode='ipc' is unknown"):
        parse_allocation("sglang:d2|megatron:d2", weight_update="ipc")


def test_plan_objects_are_frozen():
    plan = parse_allocation("sglang:d2+megatron:d2")
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.groups = ()
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.components[0].dims.d = 4


def test_weight_update_aliases_are_canonical():
    assert parse_allocation("sglang:d2+megatron:d2", weight_update="xccl").weight_update == "distributed"
    assert parse_allocation("sglang:d2|megatron:d2", weight_update="TENSOR").weight_update == "tensor"


# -- bounded, ASCII-only numbers ------------------------------------------------
@pytest.mark.parametrize("text, fragment, column", [
    ("sglang:d" + "1" * 31, "data parallel size d<31 digits> is too large: the planner accepts at most 1048576", 8),
    ("megatron:t1" + "0" * 4000, "tensor parallel size t<4001 digits> is too large", 10),
    ("megatron:d2t" + "9" * 5001, "tensor parallel size t<5001 digits> is too large", 12),  # int() raised here
    ("sglang:d1048577", "data parallel size d1048577 is too large", 8),
    ("sglang:d\uff12", "'\uff12' is not an ASCII digit; write sizes with 0-9 only", 9),   # full-width 2
    ("megatron:d2t\u0664", "is not an ASCII digit", 13),                                  # Arabic-Indic 4
])
def test_sizes_are_ascii_and_bounded(text, fragment, column):
    with pytest.raises(PlanError) as info:
        parse_allocation(text)
    message = str(info.value)
    assert fragment in message and f"at column {column}:" in message
    assert _caret_column(message) == column


def test_world_and_demand_are_bounded():
    assert parse_allocation("sglang:d1024t1024").total_gpus == 2 ** 20      # the limit itself is fine
    with pytest.raises(PlanError, match=r"world d\*t\*p\*c = 1049600 GPUs is more than the planner's limit"):
        parse_allocation("sglang:d1024t1025")
    with pytest.raises(PlanError, match="the plan needs 2097152 GPUs, more than the planner's limit of 1048576"):
        parse_allocation("sglang:d1048576+megatron:d1048576")
    with pytest.raises(PlanError, match="degree t=a number of about 4001 digits is too large"):
        Dims(t=10 ** 4000)
    with pytest.raises(PlanError, match="degree d=a number of about 5001 digits is invalid"):
        Dims(d=-10 ** 5000)                       # the message never str()s a 5001-digit int


# -- multi-policy plans (AReaL multi-agent allocations) -----------------------------------
AREAL_MULTI_AGENT = "vllm[rollout1]:d2t2 + fsdp[actor1]:d4 + vllm[rollout2]:d4 + fsdp[actor2]:d4"


def test_areal_multi_agent_plan_has_two_numbered_actors():
    """AReaL's own test case (areal/tests: multi_agent_allocation): 4 named parts, 16 GPUs."""
    plan = parse_allocation(AREAL_MULTI_AGENT)
    assert plan.total_gpus == 16 and [g.gpus for g in plan.groups] == [4, 4, 4, 4]
    assert [c.name for c in plan.components] == ["rollout1", "actor1", "rollout2", "actor2"]
    assert [c.role for c in plan.components] == ["rollout", "actor", "rollout", "actor"]
    assert [a.name for a in plan.actors] == ["actor1", "actor2"] and plan.is_multi_policy
    assert plan.actor is plan["actor1"] and [r.name for r in plan.rollout] == ["rollout1", "rollout2"]
    assert parse_allocation(plan.to_string()) == plan


@pytest.mark.parametrize("text, actors", [
    ("sglang:d2+fsdp[actor]:d2+fsdp[actor_2]:d2", ["actor", "actor_2"]),      # a bare name and a numbered one
    ("sglang[gen1]:d2+megatron[policy1]:d2|megatron[c1]:d2+megatron[policy2]:d2", ["policy1", "policy2"]),
    ("vllm[rollout1]:d2t2+fsdp[actor1]:d4", ["actor1"]),                      # numbered, one policy
])
def test_numbered_role_names_take_the_role(text, actors):
    plan = parse_allocation(text)
    assert [a.name for a in plan.actors] == actors and plan.is_multi_policy == (len(actors) > 1)
    assert all(c.role == "rollout" for c in plan.components if c.is_inference)


@pytest.mark.parametrize("text, fragment", [
    ("fsdp[rollout1]:d2", "a training backend cannot be the rollout engine"),
    ("sglang[actor2]:d2", "an inference backend cannot be the actor"),
    ("fsdp[actor]:d2+fsdp[policy]:d2+fsdp[actor3]:d2", "number the policies of a multi-policy plan (actor1, actor2)"),
])
def test_numbered_role_names_follow_the_role_rules(text, fragment):
    with pytest.raises(PlanError, match=re.escape(fragment)):
        parse_allocation(text)

"""--ref-load (HF dir) and --opd-teacher-load (torch_dist) become weight tags of the live TP2 model; weights of
other shapes become roles with a model of their own.

Three different random models: the actor, a reference given as an HF directory,
and a teacher converted to torch_dist with tools/convert_ckpt.py. Log-probs under
each tag must equal HF transformers on that model, and the actor's must come back
unchanged after the swaps.

Models by role (backends/roles.py): a teacher with twice the actor's hidden size and one more layer, and a critic
of half its hidden size and depth, each built as a model of its own, at one process, at the actor's TP2, and
beside an actor at CP2 (the teacher then at DP2, the critic at its own TP2: two second layouts interleaved).
"""

import json
import os
import subprocess
import sys

import pytest

from _util import REPO, hf_response_logprobs, loss_token_error
from megatron_rl.models.hf_tiny import build_tiny_hf_model

pytestmark = pytest.mark.dist

ROLE_LAYOUTS = ("one", "tp2", "cp2_own")  # scripts/frozen_worker.py --roles

SCRIPTS = os.path.join(os.path.dirname(__file__), "scripts")


def _convert(hf, out, *extra):
    conv = subprocess.run([sys.executable, "tools/convert_ckpt.py", "hf-to-dist", "--input", hf, "--output", str(out),
                           "--no-progress", *extra], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert conv.returncode == 0, conv.stderr[-3000:]


def shared_launch(ctx):
    """Four random models (actor, reference, teacher, start) and two converted to torch_dist with
    tools/convert_ckpt.py, then three 2-rank jobs of scripts/frozen_worker.py in the group's launch
    (tests/_launches.py). The paths by name."""
    tmp = ctx.tmp_path_factory.mktemp("frozen")
    p = {name: build_tiny_hf_model("qwen2", tmp / name, seed=seed)
         for name, seed in (("actor", 0), ("ref", 1), ("teacher_hf", 2), ("start_hf", 5))}
    p["teacher_big"] = build_tiny_hf_model("qwen2", tmp / "teacher_big", seed=7, hidden_size=128,
                                           intermediate_size=256, num_hidden_layers=5)
    p["critic_small"] = build_tiny_hf_model("qwen2", tmp / "critic_small", seed=8, hidden_size=32,
                                            intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                            num_key_value_heads=2)
    p["roles"] = {layout: tmp / f"roles_{layout}.json" for layout in ROLE_LAYOUTS}
    roles = (lambda layout: ("frozen", ["--roles", p["actor"], p["teacher_big"], p["critic_small"], layout,
                                        p["roles"][layout]]))
    p.update(teacher_dist=str(tmp / "teacher_dist"), start_dist=str(tmp / "start_dist"), tags=tmp / "out.json",
             init=tmp / "init.json", init_ref=tmp / "init_ref.json")
    _convert(p["teacher_hf"], p["teacher_dist"])
    _convert(p["start_hf"], p["start_dist"], "--dtype", "bfloat16")
    yield {1: [roles("one")],
           2: [roles("tp2"), roles("cp2_own"),
               ("frozen", [p["actor"], p["ref"], p["teacher_dist"], p["tags"]]),
               ("frozen", ["--init", p["actor"], p["start_dist"], p["init"]]),
               # the same run started from start_hf itself (bf16 params are the same values as the bf16 dir)
               ("frozen", ["--init", p["start_hf"], "-", p["init_ref"]])]}
    return p


@pytest.fixture(scope="module")
def paths(shared_launch_state):
    return shared_launch_state


def test_ref_and_teacher_tags_from_hf_and_torch_dist(paths):
    sys.path.insert(0, SCRIPTS)
    from backend_worker import make_samples

    actor, ref, teacher_hf = paths["actor"], paths["ref"], paths["teacher_hf"]
    got = json.loads(paths["tags"].read_text())
    samples = make_samples(250)
    for key, path in [("actor", actor), ("ref", ref), ("teacher", teacher_hf), ("actor_again", actor)]:
        worst = loss_token_error(hf_response_logprobs(path, samples), got[key], samples)
        assert worst < 1e-5, (key, worst)
    # the three models really differ, so the tags are not all the same weights
    assert abs(got["actor"][0][0] - got["ref"][0][0]) > 1e-3
    assert abs(got["ref"][0][0] - got["teacher"][0][0]) > 1e-3


def test_load_of_a_converted_model_dir_gives_the_initial_weights(paths):
    """--load of a model-only torch_dist dir (convert_ckpt.py hf-to-dist) initialises the policy from
    it, not from --hf-checkpoint, in bf16 at TP2, and a train step from there moves the weights."""
    sys.path.insert(0, SCRIPTS)
    from backend_worker import make_samples

    start_hf, actor = paths["start_hf"], paths["actor"]
    got, ref = json.loads(paths["init"].read_text()), json.loads(paths["init_ref"].read_text())
    samples = make_samples(250)
    want_start, want_actor = hf_response_logprobs(start_hf, samples), hf_response_logprobs(actor, samples)
    err = (lambda want, g: loss_token_error(want, g, samples))
    assert err(want_start, got["before"]) < 0.05  # bf16 weights of start_hf
    assert err(want_actor, got["before"]) > 0.5  # ... and not --hf-checkpoint's
    assert err(want_start, got["after"]) > 1e-3  # the optimizer stepped
    # ... from exactly those weights, with master weights made from them: bitwise the HF-started run
    assert got["before"] == ref["before"] and got["after"] == ref["after"]
    untimed = (lambda m: {k: v for k, v in m.items() if not k.endswith("_time_s")})
    assert untimed(got["metrics"]) == untimed(ref["metrics"]) and got["metrics"]["train/grad_norm"] > 0


def _hf_values(hf_dir: str, samples, *, seed: int, std: float) -> list:
    """A critic's values by hand: the HF trunk's final-normed hidden state before each response token, through a
    ``[hidden -> 1]`` head drawn as the backends draw it (``normal(0, std)`` from ``torch.Generator(seed)``)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    hidden = model.config.hidden_size
    weight = torch.empty(1, hidden).normal_(0.0, std, generator=torch.Generator().manual_seed(seed))
    out = []
    for s in samples:
        p = len(s.prompt_ids)
        with torch.no_grad():
            h = model.model(torch.tensor([s.prompt_ids + s.response_ids])).last_hidden_state[0]
        out.append((h[p - 1:-1] @ weight.T)[:, 0].double())
    return out


@pytest.mark.parametrize("layout", ROLE_LAYOUTS)
def test_a_larger_teacher_and_a_smaller_critic_are_models_of_their_own(paths, layout):
    """The teacher (2x hidden, +1 layer) scores as HF's teacher does and the critic (half the size) values as its HF
    trunk with the seeded head; the OPD reverse KL of the first step equals the one computed from HF's log-probs of
    both models; a step moves the critic, never the teacher; neither is a weight tag."""
    import torch

    sys.path.insert(0, SCRIPTS)
    from backend_worker import make_samples

    got = json.loads(paths["roles"][layout].read_text())
    samples = make_samples(250)
    assert got["own_models"] == ["teacher"] and "teacher" not in got["tags"]
    assert got["critic_hidden"] == 32
    teacher, actor = hf_response_logprobs(paths["teacher_big"], samples), hf_response_logprobs(paths["actor"], samples)
    assert loss_token_error(teacher, got["teacher"], samples) < 1e-5
    assert got["teacher_again"] == got["teacher"]
    assert loss_token_error(actor, got["actor"], samples) < 1e-5
    values = _hf_values(paths["critic_small"], samples, seed=1234, std=got["init_method_std"])
    assert loss_token_error(values, got["values"], samples) < 1e-5
    assert loss_token_error(values, got["values_again"], samples) > 1e-4  # the critic stepped
    mask = torch.cat([torch.tensor(s.loss_mask or [1] * len(s.response_ids), dtype=torch.bool) for s in samples])
    reverse_kl = torch.cat([a - t for a, t in zip(actor, teacher)])[mask]
    assert abs(got["metrics"]["train/opd_reverse_kl"] - float(reverse_kl.mean())) < 1e-5
    assert got["metrics"]["critic/grad_norm"] > 0


# each role's layout per job (scripts/frozen_worker.py ROLE_LAYOUTS): world 1, or 2 ranks with the actor at TP2 (the
# teacher and the critic at its layout) or at CP2 (the teacher at DP2 and the critic at TP2, each its own layout)
ROLE_GROUPS = {"one": {"actor": (1, 1, 1), "teacher": (1, 1, 1), "critic": (1, 1, 1)},
               "tp2": {"actor": (2, 1, 1), "teacher": (2, 1, 1), "critic": (2, 1, 1)},
               "cp2_own": {"actor": (1, 2, 1), "teacher": (1, 1, 2), "critic": (2, 1, 1)}}


@pytest.mark.parametrize("layout", ROLE_LAYOUTS)
def test_each_role_holds_its_own_process_groups(paths, layout):
    """Every role's modules (attention and MLP linears, embedding, output layer or value head, core attention's CP
    group, the block's PP group), its DDP and its optimizer hold its own ProcessGroupCollection's groups, seen with
    the actor's parallel_state current: beside an actor at CP2 the critic's linears are TP2 and the teacher's DP2."""
    groups = json.loads(paths["roles"][layout].read_text())["groups"]
    for role, (tp, cp, dp) in ROLE_GROUPS[layout].items():
        got = groups[role]
        assert (got["tp"], got["cp"], got["dp"], got["attention_tp"]) == (tp, cp, dp, tp), (role, got)
        assert got["held"] and all(got["held"].values()), (role, got["held"])
        assert (got["globals_tp"], got["globals_cp"]) == (groups["actor"]["tp"], groups["actor"]["cp"])
    assert {"ddp_dp_cp", "optimizer_tp"} <= set(groups["critic"]["held"])  # the trained roles' DDP and optimizer

import pytest
import torch

from megatron_rl.backends.base import WeightManager, broadcast_samples, bucketed, finish_step_metrics
from megatron_rl.backends.factory import make_backend
from megatron_rl.data.types import Sample
from megatron_rl.errors import BackendError, ConfigError


def test_weight_manager_swaps_tags_in_place():
    model = torch.nn.Linear(3, 2)
    wm = WeightManager(model.named_parameters)
    wm.backup("ref")
    ref_w = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.add_(1.0)  # "training"
    actor_w = model.weight.detach().clone()
    with wm.use("ref"):
        assert wm.active == "ref"
        assert torch.equal(model.weight, ref_w)
    assert wm.active == "actor"
    assert torch.equal(model.weight, actor_w)
    # a second switch must not overwrite the actor snapshot with ref values
    wm.switch("ref")
    wm.switch("ref")
    wm.restore()
    assert torch.equal(model.weight, actor_w)


def test_weight_manager_reuses_the_actor_copy_and_times_the_swaps():
    """Every swap copies the CURRENT actor (trained since the last one) into the same buffers."""
    model = torch.nn.Linear(3, 2)
    wm = WeightManager(model.named_parameters)
    wm.backup("ref")
    assert wm.swap_seconds > 0
    for step in range(3):
        with torch.no_grad():
            model.weight.add_(1.0)  # "training" between reference forwards
        actor_w = model.weight.detach().clone()
        before = wm.swap_seconds
        with wm.use("ref"):
            assert not torch.equal(model.weight, actor_w)
        assert torch.equal(model.weight, actor_w) and wm.swap_seconds > before
        if step == 0:
            buffer = wm._tags["actor"]["weight"]
        assert wm._tags["actor"]["weight"] is buffer  # no new allocation per swap


def test_weight_manager_unknown_tag():
    wm = WeightManager(torch.nn.Linear(2, 2).named_parameters)
    with pytest.raises(BackendError, match="no weights are stored under tag 'teacher'"):
        wm.switch("teacher")


def test_broadcast_samples_single_process():
    s = [Sample(group_index=0, prompt_ids=[1], response_ids=[2])]
    assert broadcast_samples(s) == s


def test_unknown_backend():
    with pytest.raises(ConfigError, match="--train-backend='deepspeed' is not a known training backend; choose one "
                                          "of fsdp, megatron$"):
        make_backend("deepspeed")
    from megatron_rl.backends.fsdp.backend import FSDPBackend

    assert isinstance(make_backend("fsdp"), FSDPBackend)  # built lazily, not initialised


def test_megatron_backend_import_skips_wandb_and_dynamo_but_leaves_both_usable():
    """megatron.core.timers imports wandb (~0.5 CPU-s per rank) for a feature never used, and jit_fuser's
    import-time torch.compile decorations import dynamo and inductor (~1.1 CPU-s; compiled functions the
    CPU patch turns off anyway): both skipped at start-up, both importable afterwards."""
    import subprocess
    import sys

    code = ("import sys, torch\n"
            "from megatron_rl.backends.factory import make_backend\n"
            "make_backend('megatron')\n"
            "import megatron.core.timers as t\n"
            "from megatron.core.transformer.moe.router import TopKRouter\n"
            "assert 'wandb' not in sys.modules and t.wandb is None, 'wandb imported'\n"
            "assert 'torch._dynamo' not in sys.modules, 'dynamo imported'\n"
            "assert not hasattr(TopKRouter._apply_expert_bias, '_torchdynamo_orig_callable')\n"
            "assert torch.compile.__module__.startswith('torch'), 'torch.compile left replaced'\n"
            "import wandb\n"  # the hiding is over: --wandb-project later still works
            "print('ok', wandb.__name__)\n")
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "ok wandb" in proc.stdout, proc.stderr[-2000:]


def test_models_import_megatron_through_the_same_finder():
    """Any path into megatron-core through the package (models, converters) gets the cheap first import."""
    import subprocess
    import sys

    code = ("import sys\n"
            "import megatron_rl.models.bridge\n"  # installs the finder; megatron itself is imported lazily
            "from megatron.core.models.gpt import GPTModel\n"
            "assert 'torch._dynamo' not in sys.modules, 'dynamo imported'\n"
            "print('ok')\n")
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-2000:]


@pytest.mark.parametrize("location", ["host", "device"])
def test_weight_manager_locations_swap_the_same_values(location):
    """Both locations keep an exact copy and swap it in and out; on CPU both copies are host tensors."""
    model = torch.nn.Linear(3, 2)
    wm = WeightManager(model.named_parameters, location)
    wm.backup("ref")
    ref_w = model.weight.detach().clone()
    assert wm._tags["ref"]["weight"].device == model.weight.device
    assert wm._tags["ref"]["weight"].data_ptr() != model.weight.data_ptr()  # a copy, not an alias
    assert wm.nbytes("ref") == sum(p.numel() * 4 for p in model.parameters()) and wm.nbytes("nope") == 0
    with torch.no_grad():
        model.weight.add_(1.0)
    actor_w = model.weight.detach().clone()
    with wm.use("ref"):
        assert torch.equal(model.weight, ref_w)
    assert torch.equal(model.weight, actor_w)


def test_weight_manager_refuses_an_unknown_location():
    with pytest.raises(BackendError, match="'host' or 'device', not 'disk'"):
        WeightManager(torch.nn.Linear(2, 2).named_parameters, "disk")


GIB = 2**30


@pytest.mark.parametrize("requested,cuda,offload,tag,free,where,why", [
    ("device", False, False, GIB, None, "host", "CPU-only run"),
    ("auto", False, False, GIB, None, "host", "CPU-only run"),
    ("host", True, False, GIB, 80 * GIB, "host", "--ref-weights-location host"),
    ("auto", True, True, GIB, 80 * GIB, "host", "--offload-train/--colocate"),
    ("device", True, False, 70 * GIB, 80 * GIB, "device", "--ref-weights-location device"),  # asked: obeyed
    ("auto", True, False, 20 * GIB, 80 * GIB, "device", "auto: one copy (20.00 GiB) is <= 25% of the free"),
    ("auto", True, False, 21 * GIB, 80 * GIB, "host", "auto: one copy (21.00 GiB) is more than 25%"),
])
def test_resolve_weights_location(requested, cuda, offload, tag, free, where, why):
    from megatron_rl.backends.base import resolve_weights_location

    got, reason = resolve_weights_location(requested, cuda=cuda, offload_train=offload, tag_bytes=tag,
                                           free_bytes=free)
    assert got == where and why in reason


def test_export_buckets_close_only_past_the_budget_and_never_split_a_tensor():
    """Both backends' ``export_weights`` are ``bucketed`` over their own tensor stream: a bucket closes
    once it holds at least the budget, a tensor larger than the budget is a bucket of its own, order
    and tensors are kept as they came (the same objects: nothing copied or cut)."""
    sizes = [10, 20, 30, 100, 5, 5, 1]  # float32 elements: 4 bytes each
    named = [(f"w{i}", torch.zeros(n)) for i, n in enumerate(sizes)]
    buckets = list(bucketed(iter(named), bucket_bytes=4 * 40))
    assert [[n for n, _ in b] for b in buckets] == [["w0", "w1", "w2"], ["w3"], ["w4", "w5", "w6"]]
    assert [t for b in buckets for _, t in b] == [t for _, t in named]  # the same tensors, in order
    for bucket in buckets[:-1]:  # every closed bucket passed the budget, and not before its last tensor
        nbytes = [t.numel() * t.element_size() for _, t in bucket]
        assert sum(nbytes) >= 160 and sum(nbytes[:-1]) < 160
    assert list(bucketed(iter([]), 1)) == []
    assert [len(b) for b in bucketed(iter(named), bucket_bytes=1)] == [1] * len(named)


def test_weight_tags_load_through_the_live_parameters_and_put_the_actor_back():
    p = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    wm = WeightManager(lambda: iter([("p", p)]))
    wm.load_tag("ref", lambda: p.data.copy_(torch.tensor([7.0, 8.0])))
    assert p.tolist() == [1.0, 2.0]
    with wm.use("ref"):
        assert p.tolist() == [7.0, 8.0]
    assert p.tolist() == [1.0, 2.0]


def test_step_metrics_are_the_same_keys_from_every_backend():
    m = finish_step_metrics({"train/loss": 0.5}, grad_norm=None, lr=1e-3, update_ok=False, loss_scale=None,
                            micro_batches=2, started=0.0)
    assert set(m) == {"train/loss", "train/grad_norm", "train/lr", "train/update_skipped", "train/micro_batches",
                      "train/step_time_s"}
    assert m["train/update_skipped"] == 1.0 and m["train/grad_norm"] != m["train/grad_norm"]  # NaN: no norm
    assert "train/loss_scale" in finish_step_metrics({}, grad_norm=1.0, lr=0.1, update_ok=True, loss_scale=8.0,
                                                     micro_batches=1, started=0.0)

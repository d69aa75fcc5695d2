"""The megatron backend with a vision-language checkpoint, in one process: rollout samples carrying images
(``Sample.multimodal_inputs``) packed into THD micro-batches with their pixels, grids and M-RoPE positions; the
log-probs of a packed forward equal those of one sample per micro-batch and HF transformers' own model; a training
step moves the vision tower too; a sample whose image-pad tokens disagree with its images is refused by name.
DP2 / CP2 / PP2 / TP2 + SP against one process (the grad norm of the step here, ONE_PROCESS_GRAD_NORM):
tests/dist/test_vlm_layouts.py."""

import numpy as np
import pytest
import torch

from _vlm_samples import LOGPROB_TOL, ONE_PROCESS_GRAD_NORM, hf_logprobs, make_vl_backend, vl_samples
from megatron_rl.data.images import VisionInputs
from megatron_rl.data.packing import ImageTokens, MicroBatchPlan, pack_samples
from megatron_rl.data.types import Sample
from megatron_rl.errors import ConfigError
from megatron_rl.models import vlm_parity


@pytest.fixture(scope="module")
def vl_backend(tiny_hf_models):
    import torch.distributed as dist

    from megatron_rl.models.parallel import destroy_parallel

    made = not dist.is_initialized()
    path = tiny_hf_models("qwen2_5_vl")
    backend, spec = make_vl_backend(path)
    yield path, backend, spec
    destroy_parallel()
    if made and dist.is_initialized():
        dist.destroy_process_group()


def test_packing_carries_each_samples_images_and_mrope_rows():
    from megatron_rl.models.mrope import mrope_position_ids

    gen = torch.Generator().manual_seed(0)
    a = Sample(0, [1, 7, 9, 9, 8], [2, 3], multimodal_inputs=VisionInputs(torch.randn(8, 24, generator=gen).numpy(),
                                                                       np.array([[1, 2, 4]])))
    b = Sample(0, [4, 5], [6])
    c = Sample(1, [7, 9, 8, 1], [2], multimodal_inputs=VisionInputs(torch.randn(4, 24, generator=gen).numpy(),
                                                                 np.array([[1, 2, 2]])))
    mb = pack_samples([a, b, c], [0, 1, 2], pad_to_multiple=4, image_tokens=ImageTokens(9, 2))
    assert mb.has_mrope and mb.position_ids.shape == (3, 20)
    assert torch.equal(mb.pixel_values, torch.cat([torch.from_numpy(a.multimodal_inputs.pixel_values),
                                                   torch.from_numpy(c.multimodal_inputs.pixel_values)]))
    assert mb.image_grid_thw.tolist() == [[1, 2, 4], [1, 2, 2]]
    want_a = mrope_position_ids(torch.tensor(a.prompt_ids + a.response_ids), torch.tensor([[1, 2, 4]]), 9, 2)
    assert torch.equal(mb.position_ids[:, :7], want_a)
    assert mb.position_ids[:, 7].tolist() == [int(want_a.max()) + 1] * 3  # the pad tail counts on
    assert mb.position_ids[:, 8:11].tolist() == [[0, 1, 2]] * 3  # text only: plain positions in all rows
    # a text model refuses samples with images; a sample whose pad tokens disagree with its images is named
    with pytest.raises(ConfigError, match="rollout sample 0 carries images"):
        pack_samples([a], [0])
    bad = Sample(0, [1, 9, 9, 9, 8], [2], multimodal_inputs=a.multimodal_inputs)
    with pytest.raises(ConfigError, match=r"rollout sample 3: its image-pad tokens .* runs of \[3\]"):
        pack_samples([a, b, c, bad], [3], image_tokens=ImageTokens(9, 2))


def test_packed_forward_equals_one_sample_per_micro_batch_and_hf(vl_backend):
    path, backend, _ = vl_backend
    samples = vl_samples(path)
    packed_plan = backend.plan_micro_batches(samples)
    assert packed_plan.num_micro_batches == 1  # every sample in one THD micro-batch (the budget counts pad tokens)
    packed = backend.forward(samples)
    alone = backend.forward(samples, plan=MicroBatchPlan(tuple([tuple((i,) for i in range(len(samples)))]), None,
                                                         backend.pad_to_multiple))
    hf = vlm_parity.load_hf_model(path)
    for s, a, b in zip(samples, packed, alone):
        want = hf_logprobs(hf, s, backend.bridge.image_token_id)
        assert (a - b).abs().max().item() <= LOGPROB_TOL, (a, b)
        assert (a - want).abs().max().item() <= LOGPROB_TOL, (a, want)


def test_train_step_moves_the_vision_tower(vl_backend):
    from megatron_rl.backends.base import TrainBatch

    path, backend, spec = vl_backend
    samples = vl_samples(path, seed=1)
    vision = backend.chunks[0].vision
    before = [p.detach().clone() for p in vision.parameters()]
    old = backend.forward_only(samples)
    adv = spec.compute_advantages(samples, old_logprobs=old, ref_logprobs=None)
    metrics = backend.train_step(TrainBatch(samples, adv, old))
    assert abs(metrics["train/grad_norm"] - ONE_PROCESS_GRAD_NORM) <= 1e-5 * ONE_PROCESS_GRAD_NORM
    moved = [not torch.equal(a, p.detach()) for a, p in zip(before, vision.parameters())]
    assert all(moved), f"{moved.count(False)} vision tensors did not move"
    bad = vl_samples(path, seed=2)
    bad[1].prompt_ids.remove(backend.bridge.image_token_id)  # one pad token short of its first image's features
    with pytest.raises(ConfigError, match="rollout sample 1: its image-pad tokens"):
        backend.forward(bad)


def test_embedded_engine_generates_with_images_as_the_trainer_scores_them_and_syncs_the_tower(vl_backend):
    """The engine's rollout log-probs (HF's Qwen2.5-VL module with a KV cache, pixels given at the prefill, each
    prompt prefilled once for its group) equal the trainer's at the same tokens; after a training step the sync
    carries every tensor, the vision tower's included, and the two agree again."""
    from megatron_rl.backends.base import TrainBatch
    from megatron_rl.data.types import GenerateRequest, SamplingParams
    from megatron_rl.rollout.embedded import EmbeddedEngine

    path, backend, spec = vl_backend
    engine = EmbeddedEngine(path)
    tower_runs = []
    engine.model.model.visual.register_forward_hook(lambda *_: tower_runs.append(1))
    requests = [GenerateRequest(s.prompt_ids, group_index=k, multimodal_inputs=s.multimodal_inputs)
                for k, s in enumerate(vl_samples(path, seed=4))]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=5, n=2, seed=7, ignore_eos=True)

    def engine_vs_trainer(samples) -> float:
        trainer = backend.forward(samples)
        return max((torch.tensor(s.rollout_logprobs) - t).abs().max().item() for s, t in zip(samples, trainer))

    def sync(version: int) -> None:  # the trainer's weights (trained by the tests above) into the engine
        sent = [item for bucket in backend.export_weights(1 << 20) for item in bucket]
        assert sum(name.startswith("visual.") for name, _ in sent) == 30
        engine.update_weights(iter(sent), version=version)
        live = dict(engine.named_weights())
        assert sorted(live) == sorted(name for name, _ in sent)
        assert all(torch.equal(live[name], t) for name, t in sent)

    sync(1)
    samples = engine.generate(requests, sampling)
    assert len(tower_runs) == 1  # one prefill of the four prompts: the tower ran once for the 8 samples
    assert samples[0].multimodal_inputs is requests[0].multimodal_inputs and samples[4].multimodal_inputs is None
    assert engine_vs_trainer(samples) <= LOGPROB_TOL
    for k, s in enumerate(samples):
        s.reward = float(k % 2)
    old = backend.forward_only(samples)
    backend.train_step(TrainBatch(samples, spec.compute_advantages(samples, old_logprobs=old, ref_logprobs=None), old))
    sync(2)
    assert engine_vs_trainer(engine.generate(requests, sampling)) <= LOGPROB_TOL


def test_freeze_vision_tower_trains_and_syncs_the_language_model_only(vl_backend):
    """--freeze-vision-tower: the tower has no gradient and no optimizer state, a step leaves it unchanged, and
    the weight sync sends it with the first export only. (Builds a backend of its own: runs last in this file.)"""
    from megatron_rl.backends.base import TrainBatch

    path, _, _ = vl_backend
    backend, spec = make_vl_backend(path, "--freeze-vision-tower")
    vision = backend.chunks[0].vision
    assert not any(p.requires_grad for p in vision.parameters())
    in_optimizer = {id(p) for group in backend.optimizer.param_groups for p in group["params"]}
    assert not in_optimizer & {id(p) for p in vision.parameters()} and in_optimizer
    before_vision = [p.detach().clone() for p in vision.parameters()]
    before_lm = backend.chunks[0].decoder.layers[0].mlp.linear_fc1.weight.detach().clone()
    samples = vl_samples(path, seed=5)
    old = backend.forward_only(samples)
    backend.train_step(TrainBatch(samples, spec.compute_advantages(samples, old_logprobs=old, ref_logprobs=None), old))
    assert all(torch.equal(a, p) for a, p in zip(before_vision, vision.parameters()))
    assert not torch.equal(before_lm, backend.chunks[0].decoder.layers[0].mlp.linear_fc1.weight)
    first = [name for bucket in backend.export_weights(1 << 20) for name, _ in bucket]
    second = [name for bucket in backend.export_weights(1 << 20) for name, _ in bucket]
    assert sum(n.startswith("visual.") for n in first) == 30 and not any(n.startswith("visual.") for n in second)
    assert len(second) == len(first) - 30

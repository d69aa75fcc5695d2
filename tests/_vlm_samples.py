"""Rollout samples with images for the tiny Qwen2.5-VL, HF's log-probs of them and a megatron backend built on the
checkpoint: shared by tests/backends/test_vlm_backend.py (one process) and tests/dist/scripts/vlm_worker.py
(DP2 / CP2)."""

from __future__ import annotations

import json
import os

import numpy as np
import torch

from megatron_rl.data.images import VisionInputs
from megatron_rl.data.types import Sample
from megatron_rl.models import vlm_parity

# (text tokens before the image, image grids (t, h, w) in patches, response tokens); a text-only sample among them
LAYOUTS = [(3, [(1, 4, 8)], 5), (2, [(1, 4, 4), (1, 8, 4)], 4), (6, [], 3), (4, [(1, 4, 4)], 6)]
# trainer log-probs vs HF transformers' (fp32): measured <= 2e-6 on one process, DP2 and CP2
LOGPROB_TOL = 2e-5
# the grad norm of one GRPO step on vl_samples(seed=1) from the checkpoint (make_vl_backend's flags), one process
# (tests/backends/test_vlm_backend.py); every 2-rank layout's step equals it (tests/dist/test_vlm_layouts.py)
ONE_PROCESS_GRAD_NORM = 12.0763


def vl_samples(hf_dir: str, layouts=LAYOUTS, seed: int = 0) -> list[Sample]:
    """Rollout samples of the tiny Qwen2.5-VL: prompts with each image's slot (vision start, its t*h*w/4 pad
    tokens, vision end) after some text, random text responses, random pixel patches of the tower's width."""
    with open(os.path.join(hf_dir, "config.json")) as fh:
        config = json.load(fh)
    vc = config["vision_config"]
    start, end, pad = config["vision_start_token_id"], config["vision_end_token_id"], config["image_token_id"]
    width = vc["in_channels"] * vc["temporal_patch_size"] * vc["patch_size"] ** 2
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for k, (text, grids, response) in enumerate(layouts):
        prompt = torch.randint(0, start - 2, (text,), generator=gen).tolist()
        for t, h, w in grids:
            prompt += [start] + [pad] * (t * h * w // 4) + [end] + torch.randint(0, 200, (1,), generator=gen).tolist()
        vision = None
        if grids:
            patches = sum(t * h * w for t, h, w in grids)
            vision = VisionInputs(torch.randn(patches, width, generator=gen).numpy(), np.array(grids, dtype=np.int64))
        samples.append(Sample(group_index=k // 2, prompt_ids=prompt,
                              response_ids=torch.randint(0, 200, (response,), generator=gen).tolist(),
                              rollout_logprobs=[-1.0] * response, reward=float(k % 2), finish_reason="stop",
                              multimodal_inputs=vision))
    return samples


def hf_logprobs(hf_model, sample: Sample, image_token_id: int) -> torch.Tensor:
    """HF transformers' log-probs of the sample's response tokens (its own M-RoPE positions)."""
    ids = torch.tensor(sample.prompt_ids + sample.response_ids)
    pixels = grid = None
    if sample.multimodal_inputs is not None:
        pixels = torch.from_numpy(sample.multimodal_inputs.pixel_values)
        grid = torch.from_numpy(sample.multimodal_inputs.image_grid_thw)
    with torch.no_grad():
        logits = vlm_parity.hf_forward(hf_model, vlm_parity.VLSample(ids, torch.ones(len(ids)), pixels, grid),
                                       image_token_id)
    p = len(sample.prompt_ids)
    logp = torch.log_softmax(logits[p - 1:-1].float(), dim=-1)
    return logp.gather(-1, torch.tensor(sample.response_ids)[:, None])[:, 0]


def make_vl_backend(hf_dir: str, *flags: str):
    from megatron_rl.algorithms.from_config import spec_from_config
    from megatron_rl.backends.factory import make_backend
    from megatron_rl.config import parse_config

    cfg = parse_config(["--hf-checkpoint", hf_dir, "--actor-num-gpus-per-node", "1", "--train-backend", "megatron",
                        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", "4",
                        "--advantage-estimator", "grpo", "--optimizer", "adam", "--lr", "1e-3",
                        "--use-dynamic-batch-size", "--max-tokens-per-gpu", "4096", "--seed", "1", *flags],
                       validate=False)
    spec = spec_from_config(cfg)
    backend = make_backend("megatron")
    backend.initialize(cfg, spec)
    return backend, spec



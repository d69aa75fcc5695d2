"""A GRPO run with a vision-language checkpoint, in process (``megatron_rl.train.main``): the tiny random Qwen2.5-VL
of the counting-squares demo (``data/vlm_demo.py``), its PNG prompts read through ``--multimodal-keys``, the
embedded engine generating with the images, the megatron backend training on them, the weight sync checked equal
(every tensor, the vision tower's included), for two steps."""

import json
import os

from megatron_rl.data.vlm_demo import prepare


def test_two_grpo_steps_with_images_on_the_embedded_engine_and_megatron(tmp_path):
    from megatron_rl.train import main

    paths = prepare(str(tmp_path / "demo"), num_prompts=8, num_eval=0)
    out = tmp_path / "run"
    rc = main(["--hf-checkpoint", paths["model"], "--actor-num-gpus-per-node", "1", "--rollout-backend", "embedded",
               "--prompt-data", paths["prompts"], "--input-key", "prompt", "--label-key", "label",
               "--multimodal-keys", '{"image": "images"}', "--custom-rm-path", "megatron_rl.data.synthetic:digit_reward",
               "--num-rollout", "2", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
               "--rollout-max-response-len", "3", "--global-batch-size", "16", "--use-dynamic-batch-size",
               "--max-tokens-per-gpu", "4096", "--advantage-estimator", "grpo", "--lr", "1e-3",
               "--output-dir", str(out), "--check-weight-update-equal", "--seed", "3"])
    assert rc == 0
    with open(os.path.join(out, "metrics.jsonl")) as fh:
        records = [json.loads(line) for line in fh]
    steps = {r["step"]: r for r in records}
    assert steps[0]["sync/verified_tensors"] == 81  # the first sync: every tensor, the 30 visual.* ones included
    for step in (1, 2):  # the engine's log-probs are the trainer's at the same tokens (with the images)
        assert steps[step]["train/mismatch_abs_logprob"] <= 1e-5, steps[step]
        assert steps[step]["rollout/response_len_mean"] > 0

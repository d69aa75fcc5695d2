"""Worker for tests/dist/test_reward_model_ranks.py: the reward-model role scores a batch on every trainer rank.

Job ``reward_model`` of tests/dist/harness.py: argv = POLICY_HF RM_DIR OUT.json. The driver (rank 0) holds the
batch, the other ranks None; every rank scores its share and the driver gets every score
(backends/reward_model.py ``score_batch``).
"""

import json


def main(argv):
    import torch.distributed as dist

    from backend_worker import make_samples
    from megatron_rl.backends.reward_model import RewardModel, score_batch
    from megatron_rl.config import parse_config

    policy, rm_dir, out = argv[:3]
    cfg = parse_config(["--hf-checkpoint", policy, "--reward-model-path", rm_dir, "--rm-type", "exact_match",
                        "--reward-model-micro-batch-size", "2", "--actor-num-gpus-per-node", str(dist.get_world_size())])
    rm = RewardModel(cfg)
    samples = make_samples(250) if dist.get_rank() == 0 else None
    scores = score_batch(rm, samples)
    assert (scores is None) == (dist.get_rank() != 0), "the driver alone gets the scores"
    if dist.get_rank() == 0:
        with open(out, "w") as fh:
            json.dump({"scores": scores, "own_tokenizer": rm.tokenizer is not None}, fh)

"""Worker for tests/dist/test_frozen_weights.py: --ref-load / --opd-teacher-load tags under TP2.

Usage: frozen_worker.py ACTOR_HF REF_HF TEACHER_DIST OUT.json
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))


def main():
    import torch.distributed as dist

    from backend_worker import make_samples
    from megatron_rl.algorithms.config import PolicyGradientConfig
    from megatron_rl.algorithms.spec import PolicyGradientSpec
    from megatron_rl.backends.megatron.backend import MegatronBackend
    from megatron_rl.config import parse_config

    actor, ref, teacher, out = sys.argv[1:5]
    world = os.environ["WORLD_SIZE"]
    cfg = parse_config(["--hf-checkpoint", actor, "--actor-num-gpus-per-node", world,
                        "--tensor-model-parallel-size", world, "--rollout-batch-size", "2",
                        "--n-samples-per-prompt", "3", "--micro-batch-size", "1"])
    backend = MegatronBackend()
    backend.initialize(cfg, PolicyGradientSpec(PolicyGradientConfig()))
    backend.load_frozen_weights("ref", ref)
    backend.load_frozen_weights("teacher", teacher)
    samples = make_samples(backend.vocab_size)
    result = {"actor": backend.forward_only(samples),
              "ref": backend.maybe_compute_ref_log_probs(samples, True),
              "teacher": backend.maybe_compute_teacher_log_probs(samples, True),
              "actor_again": backend.forward_only(samples)}
    if dist.get_rank() == 0:
        with open(out, "w") as fh:
            json.dump({k: [t.tolist() for t in v] for k, v in result.items()}, fh)


if __name__ == "__main__":
    main()

"""The driver: everything the RL loop (``megatron_rl/train.py``) orders besides the model and the engine.

One small class per job, built together by ``RunContext.create(cfg)``:

- ``resume.Resumer``: reference snapshot, frozen tags, continue from the newest good checkpoint;
- ``checkpoints.CheckpointSaver``: the save schedule and the collective save + pointers + pruning;
- ``evaluation.EvalSchedule``: when to evaluate (and whether the wall clock still allows it);
- ``colocation.Colocation``: the sleep/wake order when trainer and engine share accelerators;
- ``stop.StopPolicy``: agree on a planned stop (wall time, SIGTERM) and record it for the launcher;
- ``rollout_source.RolloutSource``: rollout N from the engine, a debug file or ``rollout_ckpts/``;
- ``step.train_on_rollout``: old/ref/teacher log-probs, advantages, the optimizer steps.

The runner sits above every other package (docs/architecture.md); ``infra/`` below
it is plumbing that knows nothing of RL. Importing the package imports nothing
(``--dry-run`` loads ``runner.dry_run`` alone).
"""

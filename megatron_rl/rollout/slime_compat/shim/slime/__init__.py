"""megatron_rl's stand-in for the parts of slime a user function imports (``slime.utils.types``,
``slime.utils.http_utils``, ``slime.utils.misc``, ``slime.rollout.sglang_rollout``, ``slime.rollout.base_types``,
``slime.rollout.rm_hub``).

Found only when no real slime is installed (``megatron_rl.rollout.slime_compat.finder``): an installed slime is
always the one imported. See docs/slime-functions.md."""

IS_MEGATRON_RL_SHIM = True

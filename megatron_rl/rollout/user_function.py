"""Re-export of :mod:`megatron_rl.infra.user_function` (the loader moved below ``algorithms`` so the
algorithm Spec can load ``--custom-advantage-function-path`` with the same errors)."""

from megatron_rl.infra.user_function import load_user_function

__all__ = ["load_user_function"]

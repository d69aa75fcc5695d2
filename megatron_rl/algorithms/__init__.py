"""RL algorithms: advantage estimators, policy losses, KL estimators and the Spec hooks.

Backends use only the ``Spec`` hooks; the runner builds the spec with
``spec_from_config(cfg)``; the loss and advantage functions are public for tests
and for new Specs.
"""

from megatron_rl.algorithms.config import PolicyGradientConfig
from megatron_rl.algorithms.losses import (LossInputs, Metrics, compute_policy_loss,
                                           reduce_metrics)
from megatron_rl.algorithms.from_config import spec_from_config
from megatron_rl.algorithms.spec import (BatchRequirements, ModelOutput, PolicyGradientSpec, Spec, get_spec,
                                         register_spec)

__all__ = ["PolicyGradientConfig", "LossInputs", "Metrics", "compute_policy_loss",
           "reduce_metrics", "BatchRequirements", "ModelOutput", "PolicyGradientSpec", "Spec", "get_spec",
           "register_spec", "spec_from_config"]

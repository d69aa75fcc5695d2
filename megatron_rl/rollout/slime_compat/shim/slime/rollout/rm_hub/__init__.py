"""slime's ``async_rm`` / ``batched_async_rm``: ``args.custom_rm_path`` when given (awaited as slime awaits it),
else the run's built-in ``--rm-type`` rule on the sample's response and label."""

import asyncio

from megatron_rl.data.types import Sample as OurSample
from megatron_rl.rollout.rewards import BUILTIN_REWARDS
from ...utils.misc import load_function

__all__ = ["async_rm", "batched_async_rm"]


async def async_rm(args, sample, **kwargs):
    path = getattr(sample, "custom_rm_path", None) or getattr(args, "custom_rm_path", None)
    if path:
        return await load_function(path)(args, sample, **kwargs)
    rm_type = ((sample.metadata or {}).get("rm_type") or getattr(args, "rm_type", None) or "").strip()
    if rm_type not in BUILTIN_REWARDS:
        raise NotImplementedError(f"Rule-based RM for {rm_type!r} is not implemented here; built-ins: "
                                  f"{', '.join(BUILTIN_REWARDS)}")
    return BUILTIN_REWARDS[rm_type](OurSample(group_index=sample.group_index or 0, prompt_ids=[], response_ids=[],
                                              response_text=sample.response, label=sample.label))


async def batched_async_rm(args, samples, **kwargs):
    path = getattr(args, "custom_rm_path", None)
    if path:
        return await load_function(path)(args, samples, **kwargs)
    return list(await asyncio.gather(*(async_rm(args, s, **kwargs) for s in samples)))

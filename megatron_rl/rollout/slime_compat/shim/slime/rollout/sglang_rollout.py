"""slime's ``GenerateState``, default token-in/token-out ``generate``, ``generate_and_rm(_group)`` and
``get_model_url``: what custom generate and rollout functions import from ``slime.rollout.sglang_rollout``.
``args.sglang_router_ip`` / ``args.sglang_router_port`` name the SGLang-protocol endpoint the run serves."""

import asyncio
import inspect

from megatron_rl.rollout.base import load_tokenizer  # the run's own tokenizer loader
from .rm_hub import async_rm, batched_async_rm
from ..utils.http_utils import post
from ..utils.misc import SingletonMeta, load_function
from ..utils.types import Sample

__all__ = ["GenerateState", "generate", "generate_and_rm", "generate_and_rm_group", "get_model_url"]


def get_model_url(args, model_name=None, endpoint="/generate"):
    routers = getattr(args, "sglang_model_routers", None)
    if routers and model_name in routers:
        ip, port = routers[model_name]
        return f"http://{ip}:{port}{endpoint}"
    return f"http://{args.sglang_router_ip}:{args.sglang_router_port}{endpoint}"


class GenerateState(metaclass=SingletonMeta):
    """The process's generation state: the model's tokenizer, the run's sampling parameters, a semaphore."""

    def __init__(self, args) -> None:
        self.args = args
        self.tokenizer = load_tokenizer(args.hf_checkpoint)
        self.processor = None
        self.semaphore = asyncio.Semaphore(max(int(getattr(args, "sglang_server_concurrency", 512) or 512), 1))
        self.sampling_params = dict(
            temperature=args.rollout_temperature, top_p=args.rollout_top_p, top_k=args.rollout_top_k,
            max_new_tokens=args.rollout_max_response_len, stop=args.rollout_stop,
            stop_token_ids=args.rollout_stop_token_ids, skip_special_tokens=args.rollout_skip_special_tokens,
            no_stop_trim=True, spaces_between_special_tokens=False)
        self.dp_counts = [0]
        self.dp_rank = 0
        self.reset()

    def reset(self) -> None:
        self.remaining_batch_size = 0
        self.pendings: set = set()
        self.aborted = False


async def generate(args, sample: Sample, sampling_params: dict) -> Sample:
    """One turn on the sample's tokens (slime's default generate): the response tokens and log-probs the engine
    returns, appended as they are."""
    state = GenerateState(args)
    url = get_model_url(args)
    prompt_ids = list(sample.tokens) or state.tokenizer.encode(sample.prompt, add_special_tokens=False)
    sampling_params = dict(sampling_params)
    sampling_params["max_new_tokens"] -= sample.response_length
    if sampling_params["max_new_tokens"] <= 0:
        sample.status = Sample.Status.TRUNCATED
        return sample
    if not sample.tokens:
        sample.tokens = prompt_ids
    output = await post(url, {"input_ids": prompt_ids, "sampling_params": sampling_params, "return_logprob": True})
    pairs = output["meta_info"].get("output_token_logprobs") or []
    sample.append_response_tokens(args, tokens=[p[1] for p in pairs], log_probs=[p[0] for p in pairs],
                                  trainable=True, meta_info=output["meta_info"], text=output["text"])
    return sample


async def generate_and_rm(args, sample, sampling_params, evaluation=False):
    """``--custom-generate-function-path`` (or ``generate``), then the reward unless the function set one."""
    if sample.status in (Sample.Status.COMPLETED, Sample.Status.TRUNCATED):
        return sample
    path = getattr(sample, "generate_function_path", None) or getattr(args, "custom_generate_function_path", None)
    fn = load_function(path) if path else generate
    if "evaluation" in inspect.signature(fn).parameters:
        sample = await fn(args, sample, sampling_params, evaluation=evaluation)
    else:
        sample = await fn(args, sample, sampling_params)
    if getattr(args, "group_rm", False):
        return sample
    samples = sample if isinstance(sample, list) else [sample]
    if any(s.status == Sample.Status.ABORTED for s in samples):
        return sample
    for s in samples:
        if s.reward is None:
            s.reward = await async_rm(args, s)
    return sample


async def generate_and_rm_group(args, group, sampling_params, evaluation=False):
    group = await asyncio.gather(*(generate_and_rm(args, s, dict(sampling_params), evaluation=evaluation)
                                   for s in group))
    if getattr(args, "group_rm", False):
        for s, r in zip(group, await batched_async_rm(args, group)):
            s.reward = r
    return list(group)

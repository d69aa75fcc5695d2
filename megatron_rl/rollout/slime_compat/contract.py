"""slime's function contracts, detected by signature and called as slime calls them.

* ``--custom-generate-function-path``: ``async def generate(args, sample, sampling_params) -> Sample`` (an
  ``evaluation`` keyword is passed when declared), called once per sample of a group, the group's samples
  concurrently (slime's ``generate_and_rm_group``);
* ``--rollout-function-path``: ``generate_rollout(args, rollout_id, data_source, evaluation=False)`` returning
  ``RolloutFnTrainOutput`` or a list of groups; ``data_source.get_samples(k)`` hands out the rollout's prompt
  groups, ``add_samples`` takes groups back (generated again later, as slime's buffer does);
* ``--custom-rm-path``: ``async def reward_func(args, sample, **kwargs)``, or ``(args, samples)`` batched.

A function is slime's when its first parameter is named ``args`` (ours take ``request`` / ``rollout_id`` /
``sample`` first). It is called with ``args`` (``args.slime_args``: the router address is this process's
gateway, ``gateway.py``), slime's ``Sample`` (``slime.utils.types``: an installed slime's, else the compatibility
package's, ``finder.py``), and its coroutines run on one shared loop (``loop.py``).

What it returns becomes our samples token for token (``to_ours``): ``tokens`` split by ``response_length``,
``loss_mask`` and ``rollout_log_probs`` as they are (no re-tokenisation), ``remove_sample`` as an all-zero loss
mask (slime's rule); the status as slime treats it: ``TRUNCATED`` is finish_reason "length", ``ABORTED`` is
"abort" (the group is generated again, whole, as slime puts aborted groups back in its buffer), ``COMPLETED``,
``FAILED`` and ``PENDING`` train as finished responses ("stop"; slime only tells truncated ones apart)."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

from megatron_rl.data.types import GenerateRequest, Sample, SamplingParams
from megatron_rl.errors import ConfigError, UserFunctionError
from megatron_rl.infra.user_function import call_user_function
from megatron_rl.rollout.base import load_tokenizer
from megatron_rl.rollout.slime_compat import finder, loop
from megatron_rl.rollout.slime_compat.args import slime_args
from megatron_rl.rollout.slime_compat.gateway import Gateway

#: (flag, how the docs write slime's call) of each contract
SIGNATURES = {"--custom-generate-function-path": "async def generate(args, sample, sampling_params)",
              "--rollout-function-path": "def generate_rollout(args, rollout_id, data_source, evaluation=False)",
              "--custom-rm-path": "async def reward_func(args, sample, **kwargs), or (args, samples) batched"}
_POSITIONAL = {"--custom-generate-function-path": 3, "--rollout-function-path": 3, "--custom-rm-path": 2}
GROUP_SEED_STRIDE = 7_919
#: the file beside --save-debug-rollout-data's rollouts where the gateway records each reply (JSON lines)
ENGINE_REPLIES = "engine_replies.jsonl"

_GATEWAYS: dict[tuple, Gateway] = {}
_GATEWAY_LOCK = threading.Lock()


def is_slime_function(fn: Callable) -> bool:
    """Whether ``fn`` follows slime's contract: its first parameter is named ``args`` (a ``*args`` function is
    ours: it takes whatever it is given)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    return bool(params) and params[0].name == "args" and params[0].kind in (
        inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)  # not ``*args``


def check_slime_function(fn: Callable, flag: str, path: str) -> None:
    """``ConfigError`` naming ``flag`` unless ``fn`` takes slime's positional arguments; installs the finder, so
    the function's own ``from slime...`` imports (already run) and later ones resolve."""
    finder.install()
    try:
        inspect.signature(fn).bind(*([None] * _POSITIONAL[flag]))
    except TypeError as exc:
        raise ConfigError(f"{flag} {path}: {getattr(fn, '__name__', fn)}{inspect.signature(fn)} cannot be called "
                          f"as slime calls it, {SIGNATURES[flag]} ({exc})") from None


def gateway_for(cfg: Any) -> Gateway:
    """The run's gateway (started at its first use, serving until the process ends; one per model and debug
    directory, so a process running two configurations keeps them apart)."""
    path = getattr(getattr(cfg, "model", None), "hf_checkpoint", None) or ""
    pattern = getattr(getattr(cfg, "mode", None), "save_debug_rollout_data", None)
    # beside the debug rollouts (--save-debug-rollout-data): every reply the engine gave, to compare them with
    journal = os.path.join(os.path.dirname(pattern) or ".", ENGINE_REPLIES) if pattern else None
    seed = int(getattr(getattr(cfg, "rollout", None), "rollout_seed", 0) or 0)
    with _GATEWAY_LOCK:
        gw = _GATEWAYS.get((path, journal, seed))
        if gw is None:
            gw = Gateway(load_tokenizer(path) if path else None, model_path=path, journal=journal, seed=seed).start()
            _GATEWAYS[(path, journal, seed)] = gw
        return gw


_HTTP_READY: set[int] = set()


def _args(cfg: Any) -> Any:
    """slime's ``args`` for one call, the router address this run's gateway; slime's HTTP client set up once per
    process (an installed slime's ``post`` needs ``init_http_client(args)``, as its rollout manager calls it)."""
    gw = gateway_for(cfg)
    args = slime_args(cfg, "127.0.0.1", gw.port)
    with _GATEWAY_LOCK:
        if gw.port not in _HTTP_READY:
            init = getattr(finder.slime_module("utils.http_utils"), "init_http_client", None)
            if init is not None:
                init(args)
            _HTTP_READY.add(gw.port)
    return args


def _types() -> Any:
    return finder.slime_module("utils.types")


# ------------------------------------------------------------------ conversions
def to_slime(request: GenerateRequest, index: int, tokenizer: Any = None) -> Any:
    """A fresh slime ``Sample`` of ``request`` (its prompt text and tokens, label, metadata)."""
    types = _types()
    prompt = request.prompt_text
    if prompt is None and tokenizer is not None:
        prompt = tokenizer.decode(list(request.prompt_ids))
    return types.Sample(group_index=request.group_index, index=index, prompt=prompt or "",
                        tokens=list(request.prompt_ids), label=request.label, metadata=dict(request.metadata))


def from_ours(sample: Sample, index: int) -> Any:
    """A slime ``Sample`` of one of our finished samples (what a slime reward function reads)."""
    types = _types()
    status = {"stop": "COMPLETED", "length": "TRUNCATED", "abort": "ABORTED"}.get(sample.finish_reason, "COMPLETED")
    return types.Sample(group_index=sample.group_index, index=index, prompt=sample.prompt_text or "",
                        tokens=list(sample.prompt_ids) + list(sample.response_ids),
                        response=sample.response_text or "", response_length=len(sample.response_ids),
                        label=sample.label, loss_mask=sample.effective_loss_mask(),
                        rollout_log_probs=list(sample.rollout_logprobs), metadata=dict(sample.metadata),
                        status=getattr(types.Sample.Status, status))


def to_ours(s: Any, request: GenerateRequest, where: str) -> Sample:
    """Our sample of the slime sample ``s`` a function returned for ``request`` (module docstring)."""
    tokens = [int(t) for t in (s.tokens.tolist() if hasattr(s.tokens, "tolist") else s.tokens)]
    r = int(s.response_length)
    status = getattr(getattr(s, "status", None), "name", "PENDING")
    if status == "ABORTED":
        return Sample(group_index=request.group_index, prompt_ids=list(request.prompt_ids), response_ids=[],
                      finish_reason="abort", label=request.label, prompt_text=request.prompt_text,
                      metadata={**request.metadata, "finish_message": "the slime function returned it ABORTED"})
    if r < 0 or r > len(tokens) or (r == len(tokens) and r):
        raise ConfigError(f"{where} returned a sample (group {request.group_index}) with response_length {r} and "
                          f"{len(tokens)} tokens; tokens must hold the prompt and then response_length response tokens")
    response = tokens[len(tokens) - r:]
    logprobs = s.rollout_log_probs
    if logprobs is None and r:
        raise ConfigError(f"{where} returned a sample (group {request.group_index}) with {r} response tokens and "
                          "rollout_log_probs None; training here needs the engine's log-prob of every response token: "
                          "post with \"return_logprob\": True and keep meta_info.output_token_logprobs")
    logprobs = [float(x) for x in (logprobs.tolist() if hasattr(logprobs, "tolist") else logprobs or [])]
    mask = list(s.loss_mask) if s.loss_mask is not None else []
    if getattr(s, "remove_sample", False):
        mask = [0] * r
    versions = [int(v) for v in (getattr(s, "weight_versions", None) or []) if str(v).lstrip("-").isdigit()]
    metadata = {**request.metadata, **(s.metadata if isinstance(s.metadata, dict) else {})}
    metadata["slime_status"] = status.lower()
    if getattr(s, "reward", None) is not None:  # the function scored it itself (rewards.SetByFunction reads it)
        metadata["slime_reward"] = s.reward
    return Sample(group_index=request.group_index, prompt_ids=tokens[:len(tokens) - r], response_ids=response,
                  rollout_logprobs=logprobs, loss_mask=[int(m) for m in mask],
                  finish_reason="length" if status == "TRUNCATED" else "stop",
                  weight_version=min(versions) if versions else 0, label=request.label if s.label is None else s.label,
                  prompt_text=s.prompt if isinstance(s.prompt, str) else request.prompt_text,
                  response_text=s.response if isinstance(s.response, str) else None, metadata=metadata)


def _sampling_dict(args: Any, sampling: SamplingParams) -> dict:
    """slime's ``GenerateState.sampling_params`` for this call."""
    return dict(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                max_new_tokens=sampling.max_new_tokens, stop=args.rollout_stop,
                stop_token_ids=list(sampling.stop_token_ids), skip_special_tokens=args.rollout_skip_special_tokens,
                no_stop_trim=True, spaces_between_special_tokens=False)


def _one(returned: Any, where: str) -> Any:
    if isinstance(returned, list):
        if len(returned) != 1:
            raise ConfigError(f"{where} returned {len(returned)} samples for one sample; one Sample per call is "
                              "supported here (a fan-out into several trained samples is not)")
        return returned[0]
    if not hasattr(returned, "tokens") or not hasattr(returned, "response_length"):
        raise ConfigError(f"{where} returned {type(returned).__name__}; it must return the slime Sample it was given")
    return returned


# ------------------------------------------------------------------ generate functions
def _timeout(cfg: Any) -> float:
    return float(getattr(getattr(cfg, "rollout", None), "user_function_timeout", 3600.0))


def slime_group_generate(fn: Callable, where: str, *, cfg: Any, tokenizer: Any = None) -> Callable:
    """A slime generate function as ``generate_group(request, sampling, call)`` returning the group's samples in
    our form (not yet checked: ``generate_fn.check_samples`` does that)."""
    evaluation = "evaluation" in inspect.signature(fn).parameters

    def generate_group(request: GenerateRequest, sampling: SamplingParams, call: Any) -> list[Sample]:
        gw = gateway_for(cfg)
        args = _args(cfg)
        samples = [to_slime(request, j, tokenizer) for j in range(sampling.n)]

        def run_group() -> list:
            async def group() -> list:
                tasks = []
                for s in samples:  # no sampling_seed (slime sets it only for deterministic inference): the
                    sp = _sampling_dict(args, sampling)  # gateway then batches the samples' rows in one call
                    tasks.append(fn(args, s, sp, evaluation=False) if evaluation else fn(args, s, sp))
                return list(await asyncio.gather(*tasks))
            return loop.run(group())

        with gw.lane(call) as lane:
            try:
                returned = call_user_function(run_group, where=where, timeout_s=_timeout(cfg), owner=fn)
            except UserFunctionError:
                if lane.errors:
                    raise lane.errors[0] from None
                raise
        if lane.errors:  # the engine failed or a sync cut a call: the group's attempt ends as a native one's
            raise lane.errors[0]
        return [to_ours(_one(r, where), request, where) for r in returned]

    generate_group.__name__ = f"slime_generate_group[{where}]"
    return generate_group


def slime_generate_groups(generate_group: Callable, requests: Sequence[GenerateRequest], sampling: SamplingParams,
                          engine_call: Any, *, max_concurrent: int = 64) -> list[list[Sample]]:
    """Every request's group through ``generate_group`` (threads; each group's engine calls go to the gateway,
    which serves them one at a time), request-major, group ``k`` seeded ``seed + GROUP_SEED_STRIDE * k``."""
    def one(k: int) -> list[Sample]:
        seed = None if sampling.seed is None else sampling.seed + GROUP_SEED_STRIDE * k
        return generate_group(requests[k], dataclasses.replace(sampling, seed=seed), engine_call)

    with ThreadPoolExecutor(max_workers=max(1, min(max_concurrent, len(requests))),
                            thread_name_prefix="slime-group") as pool:
        futures = [pool.submit(one, k) for k in range(len(requests))]
        return [f.result() for f in futures]


# ------------------------------------------------------------------ rollout functions
class DataSource:
    """slime's ``data_source`` over one rollout's prompt groups: ``get_samples(k)`` hands out the next ``k``
    groups (each ``n_samples_per_prompt`` fresh slime samples of a prompt), ``add_samples`` takes groups back
    (handed out again first, as slime's buffer does)."""

    def __init__(self, requests: Sequence[GenerateRequest], n: int, tokenizer: Any, where: str):
        self._requests = list(requests)
        self._next = 0
        self._back: list[list[Any]] = []
        self._n, self._tokenizer, self._where = n, tokenizer, where
        self._lock = threading.Lock()

    def get_samples(self, num_samples: int) -> list[list[Any]]:
        with self._lock:
            out = self._back[:num_samples]
            self._back = self._back[num_samples:]
            while len(out) < num_samples:
                if self._next >= len(self._requests):
                    raise ConfigError(f"{self._where} asked its data_source for more prompt groups than this rollout "
                                      f"has ({len(self._requests)}, --rollout-batch-size); a rollout's groups are "
                                      "drawn before the function runs")
                req = self._requests[self._next]
                out.append([to_slime(req, self._next * self._n + j, self._tokenizer) for j in range(self._n)])
                self._next += 1
            return out

    def add_samples(self, samples: list[list[Any]]) -> None:
        with self._lock:
            for group in samples:
                types = _types()
                self._back.append([types.Sample(group_index=s.group_index, index=s.index, prompt=s.prompt,
                                                tokens=list(s.tokens[:len(s.tokens) - int(s.response_length)])
                                                if s.response_length else list(s.tokens),
                                                label=s.label, metadata=dict(s.metadata)) for s in group])


def slime_rollout_generate(fn: Callable, where: str, *, cfg: Any, tokenizer: Any = None) -> Callable:
    """A slime rollout function as ``generate(rollout_id, requests, sampling, call)``: our samples, request-major."""

    def generate(rollout_id: int, requests: list[GenerateRequest], sampling: SamplingParams, call: Any) -> list[Sample]:
        gw = gateway_for(cfg)
        args = _args(cfg)
        args.n_samples_per_prompt = sampling.n
        source = DataSource(requests, sampling.n, tokenizer, where)
        by_group = {r.group_index: r for r in requests}

        def run() -> Any:
            out = fn(args, rollout_id, source, evaluation=False)
            return loop.run(out) if inspect.isawaitable(out) else out

        with gw.lane(call) as lane:
            try:
                output = call_user_function(run, where=where, timeout_s=_timeout(cfg), owner=fn)
            except UserFunctionError:
                if lane.errors:
                    raise lane.errors[0] from None
                raise
        if lane.errors:
            raise lane.errors[0]
        groups = getattr(output, "samples", output)
        if not isinstance(groups, list):
            raise ConfigError(f"{where} returned {type(output).__name__}; a slime rollout function returns "
                              "RolloutFnTrainOutput(samples=[[Sample, ...], ...]) or a list of groups")
        flat = [s for g in groups for s in (g if isinstance(g, list) else [g])]
        samples: list[Sample] = []
        order = {r.group_index: k for k, r in enumerate(requests)}
        for s in sorted(flat, key=lambda s: (order.get(s.group_index, len(order)), s.index or 0)):
            if s.group_index not in by_group:
                raise ConfigError(f"{where} returned a sample of group {s.group_index}, not one of this rollout's "
                                  f"groups ({', '.join(str(g) for g in by_group)}); keep each sample's group_index")
            samples.append(to_ours(_one(s, where), by_group[s.group_index], where))
        return samples

    return generate


# ------------------------------------------------------------------ reward functions
class SlimeReward:
    """A slime ``--custom-rm-path`` function in our batched form: each sample converted (``from_ours``), the
    function awaited per sample (concurrently) or once for the batch (``(args, samples)``)."""

    batched = True

    def __init__(self, fn: Callable, path: str, cfg: Any = None, timeout_s: float = 3600.0):
        self.fn, self.path, self.cfg, self.timeout_s = fn, path, cfg, timeout_s
        params = list(inspect.signature(fn).parameters)
        self.per_batch = len(params) > 1 and params[1] == "samples"

    def __call__(self, samples: list[Sample]) -> list[Any]:
        args = slime_args(self.cfg, "127.0.0.1", 0) if self.cfg is None else _args(self.cfg)
        theirs = [from_ours(s, k) for k, s in enumerate(samples)]

        def run() -> Any:
            async def score() -> Any:
                if self.per_batch:
                    return await _maybe(self.fn(args, theirs))
                return list(await asyncio.gather(*(_maybe(self.fn(args, s)) for s in theirs)))
            return loop.run(score())

        rewards = call_user_function(run, where=f"--custom-rm-path {self.path}", timeout_s=self.timeout_s,
                                     owner=self.fn)
        return list(rewards) if isinstance(rewards, (list, tuple)) else rewards

    def __repr__(self) -> str:
        return f"SlimeReward({self.path!r})"


async def _maybe(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


__all__ = ["DataSource", "ENGINE_REPLIES", "SIGNATURES", "SlimeReward", "check_slime_function", "from_ours", "gateway_for",
           "is_slime_function", "slime_generate_groups", "slime_group_generate", "slime_rollout_generate",
           "to_ours", "to_slime"]

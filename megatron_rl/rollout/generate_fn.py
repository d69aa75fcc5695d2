"""User rollout functions: ``--custom-generate-function-path`` (per prompt group) and ``--rollout-function-path``
(per batch), token-in/token-out.

slime's extension point, kept as small: the user writes one plain function (``def`` or ``async def``), not a
class. The two contracts (docs/agentic.md):

* **per group**, ``--custom-generate-function-path module:fn`` (or ``path/to/file.py:fn``)::

      fn(request: GenerateRequest, sampling: SamplingParams, engine: EngineHandle) -> list[Sample]

  called once per prompt group, it returns the group's ``sampling.n`` finished samples (a bare ``Sample``
  when ``n`` is 1), each with ``request.group_index``. The group is the unit every caller already works in:
  GRPO compares a group's samples, an aborted group is generated again whole, the asynchronous producer
  generates group by group. ``group_generate`` is this function bound to an engine call, what the rollout
  manager and the asynchronous producer both call.
* **per batch**, ``--rollout-function-path module:fn``::

      fn(rollout_id: int, requests: list[GenerateRequest], sampling: SamplingParams, engine: EngineHandle)
          -> list[Sample]

  returns ``len(requests) * sampling.n`` samples, request-major (the ``n`` samples of ``requests[i]``
  consecutive, with its ``group_index``), like ``RolloutEngine.generate``.

The engine handle (``EngineHandle``) is the only way in: ``generate(input_ids, sampling)`` returns
``Generation``s (output token ids, the behaviour log-prob of every token, the weight version of every token,
the finish reason), never text, so nothing a function returns has to be re-encoded: a trajectory is the
concatenation of engine output tokens and the tokens the function appends itself (tool observations, with
``loss_mask`` 0). It speaks only ``RolloutEngine.generate``, so a function runs on every engine. With
``--use-rollout-routing-replay`` a ``Generation`` also carries the engine's routes of its input + output
tokens (``routes``): a function sets its sample's ``routed_experts`` from the last call whose input covered
the sample's tokens (``routes.first(total_length - 1)``; the built-in agent loop does), and the trainer
refuses a sample without them, naming it.

Invariants checked on every returned sample (``check_samples``; a violation is a ``ConfigError`` naming the
flag, the function and the sample): ``rollout_logprobs``, ``loss_mask`` (0/1, or empty: all ones) and
``token_versions`` (or empty) as long as ``response_ids``; at most ``sampling.max_new_tokens`` response tokens
(the trainer's ``--seq-length`` is sized by it); at least one unless aborted; a known ``finish_reason``; the
group's ``group_index`` and the right count. A sample with finish_reason "abort" makes the caller generate
its group again (``RolloutManager._generate_complete``), as an engine's abort does.

Batching (``generate_groups``): the manager runs each group's function in a thread of its own, and the
engine calls those threads make are gathered into one ``engine.generate`` per round, issued from the
calling thread once every running group waits on the engine (state decides a round, never a clock), so
the embedded engine decodes all groups' turns in one batch and an engine that is not thread-safe (the
replicated embedded engine) is only ever called from the driver's thread. Tools run in the group threads,
in parallel. A round's rows are ordered by group, so a seeded rollout is reproducible. Calls that differ
only in seed and ``max_new_tokens`` share the round's engine call: it asks for the longest, and each row
is cut to its own budget (``truncate``), as a turn's budget is what its trajectory has left.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from megatron_rl.config.architecture import read_hf_config, text_config
from megatron_rl.data.types import (GenerateRequest, RoutedExperts, Sample, SamplingParams, describe_prompt,
                                    mark_prompt)
from megatron_rl.errors import ConfigError, EngineError
from megatron_rl.infra.user_function import (call_user_function, check_arity, load_user_function,
                                             load_user_object)
from megatron_rl.rollout.slime_compat.contract import (check_slime_function, is_slime_function,
                                                       slime_generate_groups, slime_group_generate,
                                                       slime_rollout_generate)
from megatron_rl.rollout.slime_compat.finder import load_needing_slime

log = logging.getLogger("megatron_rl")

#: what the handle calls: ``RolloutEngine.generate``, or a caller's gated / batched stand-in with its contract
EngineCall = Callable[[list[GenerateRequest], SamplingParams], list[Sample]]

#: a ``--custom-generate-function-path`` function bound to an engine call (``group_generate``)
GroupGenerate = Callable[[GenerateRequest, SamplingParams, EngineCall], list[Sample]]

#: seeds of successive engine calls of one handle, and of the handles of one batch, lie this far apart
CALL_SEED_STRIDE = 1_000_033
GROUP_SEED_STRIDE = 7_919

FINISH_REASONS = ("stop", "length", "abort")


@dataclass(frozen=True)
class Generation:
    """One continuation the engine sampled: exactly its tokens, never text.

    ``logprobs[i]`` is the behaviour log-prob of ``output_ids[i]`` (the engine's, at the sampling
    temperature); ``token_versions[i]`` the weight version whose forward drew it (always one per token).
    A stop token that ended it is the last of ``output_ids``."""

    output_ids: list[int]
    logprobs: list[float]
    token_versions: list[int]
    finish_reason: str  # "stop" | "length" | "abort"
    weight_version: int  # the first token's version (the engine's when there is no token)
    finish_message: Optional[str] = None  # what the engine said when it aborted the row
    # the engine's experts for input + output tokens, less the last (--use-rollout-routing-replay), else None
    routes: Optional[RoutedExperts] = None

    @property
    def stopped(self) -> bool:
        return self.finish_reason == "stop"


class _LockedTokenizer:
    """The engine's tokenizer behind a lock: group functions run in threads, and a fast tokenizer used from
    two threads at once can fail ("Already borrowed")."""

    def __init__(self, tokenizer: Any, lock: threading.Lock):
        self._tokenizer, self._lock = tokenizer, lock

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._tokenizer, name)
        if not callable(value):
            return value
        lock = self._lock

        def locked(*args, **kwargs):
            with lock:
                return value(*args, **kwargs)
        return locked

    def __call__(self, *args, **kwargs):
        with self._lock:
            return self._tokenizer(*args, **kwargs)

    def __len__(self) -> int:
        return len(self._tokenizer)


_TOKENIZER_LOCKS: dict[int, threading.Lock] = {}
_TOKENIZER_LOCKS_GUARD = threading.Lock()


def locked_tokenizer(tokenizer: Any) -> Any:
    """``tokenizer`` behind one lock per tokenizer object (None stays None)."""
    if tokenizer is None or isinstance(tokenizer, _LockedTokenizer):
        return tokenizer
    with _TOKENIZER_LOCKS_GUARD:
        lock = _TOKENIZER_LOCKS.setdefault(id(tokenizer), threading.Lock())
    return _LockedTokenizer(tokenizer, lock)


class EngineHandle:
    """What a rollout function generates with: token ids in, ``Generation``s out.

    ``tokenizer``: the engine's (thread-safe wrapper; None for a token-id-only engine); ``cfg``: the run's
    frozen ``Config`` when the caller has one (slime passes ``args`` to its functions: a function reads the
    flags it needs here, as the built-in tool loop reads ``--max-turns``). Successive calls of one handle get
    seeds ``CALL_SEED_STRIDE`` apart (the first keeps ``sampling.seed``), so the turns of a trajectory draw
    unrelated random streams and a seeded rollout is reproducible. ``calls`` counts the engine calls made.
    """

    def __init__(self, call: EngineCall, *, tokenizer: Any = None, cfg: Any = None,
                 request: Optional[GenerateRequest] = None):
        self._call = call
        self.tokenizer = locked_tokenizer(tokenizer)
        self.cfg = cfg
        self._request = request
        self.calls = 0
        self._lock = threading.Lock()

    def generate(self, input_ids: Sequence[int], sampling: SamplingParams) -> list[Generation]:
        """``sampling.n`` continuations of the context ``input_ids``."""
        return self.generate_batch([input_ids], sampling)[0]

    def generate_batch(self, contexts: Sequence[Sequence[int]], sampling: SamplingParams,
                       max_new_tokens: Optional[Sequence[int]] = None) -> list[list[Generation]]:
        """``sampling.n`` continuations of each context in one engine call (the engine batches them), at most
        ``max_new_tokens[i]`` tokens for context ``i`` (default ``sampling.max_new_tokens``): the call asks
        for the largest and a longer row is cut to its own (``truncate``: a prefix, finish_reason "length")."""
        rows: list[list[int]] = [list(map(int, c)) for c in contexts]
        budgets = [sampling.max_new_tokens] * len(rows) if max_new_tokens is None else list(max_new_tokens)
        if len(budgets) != len(rows):
            raise ConfigError(f"EngineHandle.generate_batch: {len(budgets)} max_new_tokens for {len(rows)} "
                              "contexts; give one per context")
        if not rows:
            return []
        with self._lock:
            k = self.calls
            self.calls += 1
        seed = None if sampling.seed is None else sampling.seed + CALL_SEED_STRIDE * k
        params = dataclasses.replace(sampling, max_new_tokens=int(max(budgets)), seed=seed)
        samples = list(self._call([self._engine_request(c) for c in rows], params))
        if len(samples) != len(rows) * params.n:
            raise EngineError(f"the rollout engine returned {len(samples)} samples for {len(rows)} contexts x "
                              f"n={params.n}; an engine returns n samples per request, request-major")
        return [[_generation(truncate(s, budgets[i])) for s in samples[i * params.n:(i + 1) * params.n]]
                for i in range(len(rows))]

    async def agenerate(self, input_ids: Sequence[int], sampling: SamplingParams) -> list[Generation]:
        """``generate`` for an ``async def`` function: the engine call runs in a worker thread."""
        return await asyncio.to_thread(self.generate, input_ids, sampling)

    async def agenerate_batch(self, contexts: Sequence[Sequence[int]], sampling: SamplingParams,
                              max_new_tokens: Optional[Sequence[int]] = None) -> list[list[Generation]]:
        return await asyncio.to_thread(self.generate_batch, contexts, sampling, max_new_tokens)

    def _engine_request(self, input_ids: list[int]) -> GenerateRequest:
        r = self._request
        if r is None:
            return GenerateRequest(prompt_ids=input_ids, group_index=0)
        return GenerateRequest(prompt_ids=input_ids, group_index=r.group_index, label=r.label,
                               metadata=dict(r.metadata))


def truncate(sample: Sample, max_new_tokens: int) -> Sample:
    """``sample`` cut to its first ``max_new_tokens`` response tokens (finish_reason "length"), or itself when
    it is no longer. Why this is what a shorter budget gives: the tokens are drawn one after the other, each
    from the ones before, so the first k of a longer response are a response of k (the embedded engine's
    per-row streams make them the same tokens); the rest was never shown to anyone."""
    if len(sample.response_ids) <= max_new_tokens:
        return sample
    k = max_new_tokens
    routes = sample.routed_experts  # its first tokens' routes: a route depends only on the tokens before it
    return dataclasses.replace(sample, response_ids=sample.response_ids[:k], rollout_logprobs=sample.rollout_logprobs[:k],
                               loss_mask=sample.loss_mask[:k], token_versions=sample.token_versions[:k],
                               finish_reason="length", response_text=None, metadata=dict(sample.metadata),
                               routed_experts=None if routes is None else routes.first(len(sample.prompt_ids) + k - 1))


def _generation(sample: Sample) -> Generation:
    n = len(sample.response_ids)
    versions = sample.effective_token_versions()
    if len(sample.rollout_logprobs) != n or len(versions) != n:
        raise EngineError(f"the rollout engine returned a sample (group {sample.group_index}) with {n} tokens, "
                          f"{len(sample.rollout_logprobs)} log-probs and {len(versions)} token versions; an engine "
                          "returns one log-prob and one version per token")
    return Generation(output_ids=list(sample.response_ids), logprobs=[float(x) for x in sample.rollout_logprobs],
                      token_versions=[int(v) for v in versions], finish_reason=sample.finish_reason,
                      weight_version=int(sample.weight_version),
                      finish_message=sample.metadata.get("finish_message"), routes=sample.routed_experts)


# ------------------------------------------------------------------ loading
#: (positional arguments, how the docs write the call) of each rollout-function flag: checked when loaded
SIGNATURES = {"--custom-generate-function-path": (3, "fn(request, sampling, engine)"),
              "--rollout-function-path": (4, "fn(rollout_id, requests, sampling, engine)")}


def load_function(path: str, flag: str) -> Callable:
    """The callable named by ``module:attr``, ``path/to/file.py:attr`` or slime's ``module.attr``; ``ConfigError``
    naming ``flag`` and the value otherwise (a module that does not import, no such attribute, not callable, a
    function that cannot take the flag's arguments). A function whose first parameter is ``args`` follows slime's
    contract (``slime_compat.contract``) and is checked against it."""
    fn = load_needing_slime(lambda: load_user_function(path, flag, example="my_rollout:generate", dotted=True))
    if flag in SIGNATURES and is_slime_function(fn):
        check_slime_function(fn, flag, path)
    elif flag in SIGNATURES:
        check_arity(fn, SIGNATURES[flag][0], flag, path, SIGNATURES[flag][1])
    return fn


def load_object(path: str, flag: str, what: str = "function", example: str = "my_rollout:generate") -> Any:
    """The object named by ``module:attr`` or ``path/to/file.py:attr`` (``ConfigError`` naming ``flag`` and
    the value when the module does not import or has no such attribute)."""
    return load_user_object(path, flag, what=what, example=example)


def vocab_size_of(cfg: Any) -> Optional[int]:
    """The model's vocabulary (``vocab_size`` of --hf-checkpoint's config.json): token ids a rollout function
    returns must lie in [0, it), or the trainer's embedding fails on them. None when there is no config to read."""
    path = getattr(getattr(cfg, "model", None), "hf_checkpoint", None)
    if not path or not os.path.isfile(os.path.join(path, "config.json")):
        return None
    try:
        size = text_config(read_hf_config(path)).get("vocab_size")
    except (OSError, ValueError):
        return None
    return int(size) if isinstance(size, int) and size > 0 else None


# ------------------------------------------------------------------ checking
def check_samples(returned: Any, requests: Sequence[GenerateRequest], sampling: SamplingParams,
                  where: str, vocab_size: Optional[int] = None) -> list[Sample]:
    """``returned`` as the list of samples of ``requests`` (``sampling.n`` each, request-major), every one
    checked against the module's invariants (token ids in [0, ``vocab_size``) when it is given, finite
    log-probs); ``ConfigError`` naming ``where`` (flag and function), the sample's prompt and the bad value
    otherwise. A sample's missing ``label`` / ``prompt_text`` and its prompt's place (``prompt_index``,
    ``line``) are filled from its request."""
    if isinstance(returned, Sample):
        returned = [returned]
    if not isinstance(returned, (list, tuple)) or not all(isinstance(s, Sample) for s in returned):
        raise ConfigError(f"{where} returned {type(returned).__name__}"
                          f"{'' if not isinstance(returned, (list, tuple)) else ' with non-Sample items'}; it must "
                          "return megatron_rl.data.types.Sample objects (a list, or one Sample when n is 1)")
    n = sampling.n
    # a trajectory split into branches (Sample.branch 1, 2, ... right after its branch 0) counts once
    heads = sum(1 for s in returned if not s.branch)
    if heads != len(requests) * n:
        what = "one group" if len(requests) == 1 else f"{len(requests)} groups"
        extra = f" ({len(returned) - heads} more branches of them)" if heads != len(returned) else ""
        raise ConfigError(f"{where} returned {heads} samples{extra} for {what} of n={n} (--n-samples-per-prompt); "
                          f"it must return exactly {len(requests) * n}")
    samples = list(returned)
    logical = -1
    for k, s in enumerate(samples):
        if not s.branch:
            logical += 1
        elif logical < 0 or samples[k - 1].branch != s.branch - 1:
            raise ConfigError(f"{where}: sample {k} is branch {s.branch} of a trajectory but does not follow its "
                              f"branch {s.branch - 1}; return a trajectory's branches consecutively, numbered 0, 1, ...")
        req = requests[logical // n]
        prompt = describe_prompt(req.metadata)
        _check_sample(s, req, sampling, f"{where}: sample {k} (group {req.group_index}"
                      + (f", {prompt}" if prompt else "") + ")", vocab_size)
        if s.label is None:
            s.label = req.label
        if s.prompt_text is None:
            s.prompt_text = req.prompt_text
        mark_prompt(s, req)  # reward errors name the prompt by them
    return samples


def group_slices(samples: Sequence[Sample], groups: int, n: int) -> list[slice]:
    """Where each of ``groups`` request-major groups of ``n`` lies in ``samples``: ``n`` samples each, or more when
    a trajectory split into branches (``Sample.branch`` > 0 follows its branch 0; ``rollout/endpoint``)."""
    heads = [i for i, s in enumerate(samples) if not s.branch]
    if len(heads) != groups * n:
        raise ConfigError(f"{len(heads)} samples for {groups} prompt group(s) of n={n}: a rollout returns n samples "
                          "per prompt, in request order")
    starts = heads[::n]
    return [slice(a, b) for a, b in zip(starts, starts[1:] + [len(samples)])]


def _bad_token(ids: Sequence[Any], vocab_size: Optional[int]) -> Optional[str]:
    """Why ``ids`` are not token ids of the model (the first bad one and its position), or None."""
    for i, t in enumerate(ids):
        if not isinstance(t, int) or isinstance(t, bool) or t < 0 or (vocab_size is not None and t >= vocab_size):
            if vocab_size is not None and isinstance(t, int) and t >= vocab_size:
                return (f"{t} at position {i}, outside the model's vocabulary [0, {vocab_size}) (vocab_size of "
                        "--hf-checkpoint's config.json; the trainer's embedding has no row for it)")
            return f"{t!r} at position {i}: not non-negative int token ids"
    return None


def _check_sample(s: Sample, req: GenerateRequest, sampling: SamplingParams, what: str,
                  vocab_size: Optional[int] = None) -> None:
    n = len(s.response_ids)
    problems = []
    if s.group_index != req.group_index:
        problems.append(f"has group_index {s.group_index}, not its request's {req.group_index} (request-major order, "
                        "n samples per request)")
    bad = _bad_token(s.prompt_ids, vocab_size)
    if not s.prompt_ids or bad:
        problems.append(f"has prompt_ids {bad or 'empty'}: a non-empty list of token ids is needed")
    bad = _bad_token(s.response_ids, vocab_size)
    if bad:
        problems.append(f"has response_ids {bad}")
    if len(s.rollout_logprobs) != n:
        problems.append(f"has {len(s.rollout_logprobs)} rollout_logprobs for {n} response_ids (one behaviour "
                        "log-prob per response token; 0.0 for tokens the function appended itself)")
    else:
        odd = next(((i, v) for i, v in enumerate(s.rollout_logprobs)
                    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v)), None)
        if odd is not None:
            problems.append(f"has rollout_logprobs[{odd[0]}] = {odd[1]!r}; a behaviour log-prob is a finite number "
                            "(--use-tis / --use-rs and the mismatch metrics read them)")
    if s.loss_mask and len(s.loss_mask) != n:
        problems.append(f"has a loss_mask of {len(s.loss_mask)} entries for {n} response_ids (response-aligned; "
                        "empty means all ones)")
    elif any(m not in (0, 1) for m in s.loss_mask):
        problems.append("has a loss_mask with values other than 0 and 1")
    if s.token_versions and len(s.token_versions) != n:
        problems.append(f"has {len(s.token_versions)} token_versions for {n} response_ids (response-aligned; "
                        "empty means every token has weight_version)")
    if s.finish_reason not in FINISH_REASONS:
        problems.append(f"has finish_reason {s.finish_reason!r}; use one of {', '.join(FINISH_REASONS)}")
    if n > sampling.max_new_tokens:
        problems.append(f"has {n} response tokens, more than max_new_tokens {sampling.max_new_tokens} "
                        "(--rollout-max-response-len: the trainer's sequences are sized by it)")
    if n == 0 and s.finish_reason != "abort":
        problems.append("has no response token (only an aborted sample may be empty)")
    if problems:
        raise ConfigError(f"{what} {'; '.join(problems)}")


def _within_budget(samples: list[Sample], sampling: SamplingParams, tokenizer: Any, where: str) -> list[Sample]:
    """A slime function's samples cut to ``sampling.max_new_tokens`` response tokens (``truncate``: a prefix,
    finish_reason "length", its text decoded again). Why cut rather than refuse: slime trains a response of any
    length, and its multi-turn examples give every turn the whole budget (search-r1), so a sample may outgrow
    --rollout-max-response-len, which sizes the trainer's sequences here; a prefix keeps its tokens, loss mask and
    log-probs exactly. Each cut is logged with the function and the lengths."""
    out = []
    for s in samples:
        n = len(s.response_ids)
        if n > sampling.max_new_tokens:
            log.warning("%s returned a response of %d tokens (group %d); trained on its first %d "
                        "(--rollout-max-response-len), as a truncated sample", where, n, s.group_index,
                        sampling.max_new_tokens)
            s = truncate(s, sampling.max_new_tokens)
            s.metadata["slime_response_length"] = n
            if tokenizer is not None:
                s.response_text = tokenizer.decode(s.response_ids, skip_special_tokens=True)
        out.append(s)
    return out


# ------------------------------------------------------------------ binding
def _timeout_of(cfg: Any) -> float:
    """--user-function-timeout of the run's config (its default without one)."""
    rollout = getattr(cfg, "rollout", None)
    return float(getattr(rollout, "user_function_timeout", 3600.0))


def group_generate(fn: Callable, where: str, *, tokenizer: Any = None, cfg: Any = None,
                   vocab_size: Optional[int] = None) -> GroupGenerate:
    """The ``--custom-generate-function-path`` function ``fn`` as ``generate_group(request, sampling, call)``:
    one group's checked samples, every engine call through ``call`` (``engine.generate``, or a caller's
    stand-in: the asynchronous producer's gated call, ``generate_groups``' batched one). Each call is bounded
    by --user-function-timeout (``infra.user_function.call_user_function``); what ``call`` raises (a
    ``MegatronRLError``: an engine's failure, the producer's cut by a sync) comes through as it is. A slime
    function (``args`` first) is called as slime calls it (``slime_compat.contract.slime_group_generate``)."""
    timeout_s = _timeout_of(cfg)
    if is_slime_function(fn):
        slime_group = slime_group_generate(fn, where, cfg=cfg, tokenizer=tokenizer)

        def generate_slime_group(request: GenerateRequest, sampling: SamplingParams, call: EngineCall) -> list[Sample]:
            return check_samples(_within_budget(slime_group(request, sampling, call), sampling, tokenizer, where),
                                 [request], sampling, where, vocab_size)

        generate_slime_group.__name__ = f"generate_group[{where}]"
        return generate_slime_group

    def generate_group(request: GenerateRequest, sampling: SamplingParams, call: EngineCall) -> list[Sample]:
        handle = EngineHandle(call, tokenizer=tokenizer, cfg=cfg, request=request)
        returned = call_user_function(fn, request, sampling, handle, where=where, timeout_s=timeout_s)
        return check_samples(returned, [request], sampling, where, vocab_size)

    generate_group.__name__ = f"generate_group[{where}]"
    return generate_group


def rollout_generate(fn: Callable, where: str, *, tokenizer: Any = None, cfg: Any = None,
                     vocab_size: Optional[int] = None):
    """The ``--rollout-function-path`` function ``fn`` as ``generate(rollout_id, requests, sampling, call)``:
    the batch's checked samples (the call bounded by --user-function-timeout). A slime rollout function (``args``
    first) is called as slime calls it (``slime_compat.contract.slime_rollout_generate``)."""
    timeout_s = _timeout_of(cfg)
    if is_slime_function(fn):
        slime_batch = slime_rollout_generate(fn, where, cfg=cfg, tokenizer=tokenizer)

        def generate_slime(rollout_id: int, requests: list[GenerateRequest], sampling: SamplingParams,
                           call: EngineCall) -> list[Sample]:
            return check_samples(_within_budget(slime_batch(rollout_id, list(requests), sampling, call), sampling,
                                                tokenizer, where), requests, sampling, where, vocab_size)

        return generate_slime

    def generate(rollout_id: int, requests: list[GenerateRequest], sampling: SamplingParams,
                 call: EngineCall) -> list[Sample]:
        handle = EngineHandle(call, tokenizer=tokenizer, cfg=cfg)
        returned = call_user_function(fn, rollout_id, list(requests), sampling, handle, where=where,
                                      timeout_s=timeout_s)
        return check_samples(returned, requests, sampling, where, vocab_size)

    return generate


@dataclass
class _Pending:
    job: int
    seq: int
    requests: list[GenerateRequest]
    sampling: SamplingParams
    result: Optional[list[Sample]] = None
    error: Optional[BaseException] = None
    done: bool = False


@dataclass
class _Lockstep:
    """Gathers the engine calls of group threads into one call per round (see the module docstring)."""

    engine_call: EngineCall
    cond: threading.Condition = field(default_factory=threading.Condition)
    pending: list[_Pending] = field(default_factory=list)
    running: set[int] = field(default_factory=set)
    seq: int = 0

    def call_for(self, job: int) -> EngineCall:
        def call(requests: list[GenerateRequest], sampling: SamplingParams) -> list[Sample]:
            with self.cond:
                self.seq += 1
                p = _Pending(job, self.seq, list(requests), sampling)
                self.pending.append(p)
                self.cond.notify_all()
                while not p.done:
                    self.cond.wait()
            if p.error is not None:
                raise p.error
            assert p.result is not None
            return p.result
        return call

    def all_waiting(self) -> bool:
        """Every running job waits on the engine (so nothing changes until the round is served)."""
        return self.running <= {p.job for p in self.pending}

    def serve(self) -> None:
        """One round: the waiting calls, by sampling (seed aside), each set as one engine call, rows by job."""
        with self.cond:
            batch, self.pending = sorted(self.pending, key=lambda p: (p.job, p.seq)), []
        sets: dict[SamplingParams, list[_Pending]] = {}
        for p in batch:  # calls that differ only in seed and length share an engine call
            sets.setdefault(dataclasses.replace(p.sampling, seed=None, max_new_tokens=1), []).append(p)
        for params, calls in sets.items():
            seed = calls[0].sampling.seed  # the first job's: deterministic, as the rows' order is
            longest = max(p.sampling.max_new_tokens for p in calls)
            try:
                samples = list(self.engine_call([r for p in calls for r in p.requests],
                                                dataclasses.replace(params, seed=seed, max_new_tokens=longest)))
                expected = sum(len(p.requests) for p in calls) * params.n
                if len(samples) != expected:
                    raise EngineError(f"the rollout engine returned {len(samples)} samples for {expected // params.n} "
                                      f"requests x n={params.n}")
                at = 0
                for p in calls:
                    k = len(p.requests) * params.n
                    p.result = [truncate(s, p.sampling.max_new_tokens) for s in samples[at:at + k]]
                    at += k
            except BaseException as exc:  # noqa: BLE001 - handed to each waiting group, which raises it
                for p in calls:
                    p.error = exc
        with self.cond:
            for p in batch:
                p.done = True
            self.cond.notify_all()


def generate_groups(generate_group: GroupGenerate, requests: Sequence[GenerateRequest], sampling: SamplingParams,
                    engine_call: EngineCall, *, max_concurrent: int = 256) -> list[Sample]:
    """Every request's group through ``generate_group``, request-major; engine calls batched by round.

    Group ``k`` gets the seed ``sampling.seed + GROUP_SEED_STRIDE * k``. At most ``max_concurrent`` groups
    run at once; a group starts only at a round boundary, so which calls share a round does not depend on
    thread timing. The first group's error (by position) is raised after every group ended."""
    lock = _Lockstep(engine_call)
    results: list[Optional[list[Sample]]] = [None] * len(requests)
    errors: dict[int, BaseException] = {}

    def run(job: int) -> None:
        seed = None if sampling.seed is None else sampling.seed + GROUP_SEED_STRIDE * job
        try:
            results[job] = generate_group(requests[job], dataclasses.replace(sampling, seed=seed), lock.call_for(job))
        except BaseException as exc:  # noqa: BLE001 - raised on the calling thread below
            errors[job] = exc
        finally:
            with lock.cond:
                lock.running.discard(job)
                lock.cond.notify_all()

    next_job = 0
    while True:
        with lock.cond:
            while not lock.all_waiting():
                lock.cond.wait()
            if next_job < len(requests) and len(lock.running) < max_concurrent:
                while next_job < len(requests) and len(lock.running) < max_concurrent:
                    lock.running.add(next_job)
                    threading.Thread(target=run, args=(next_job,), name=f"rollout-group-{next_job}",
                                     daemon=True).start()
                    next_job += 1
                continue
            if not lock.running:
                break
        lock.serve()
    if errors:
        raise errors[min(errors)]
    return [s for group in results for s in (group or [])]



@dataclass(frozen=True)
class RolloutFunctions:
    """The run's user rollout functions (``from_config``: None when neither flag is given), loaded once on
    the driver before the engine loads, so a bad path fails first. ``vocab_size``: the model's, the bound on
    the token ids they return."""

    group_fn: Optional[Callable] = None
    group_where: str = ""
    batch_fn: Optional[Callable] = None
    batch_where: str = ""
    cfg: Any = None
    vocab_size: Optional[int] = None

    @classmethod
    def from_config(cls, cfg: Any) -> "Optional[RolloutFunctions]":
        r = cfg.rollout
        if not (r.custom_generate_function_path or r.rollout_function_path):
            return None
        if r.custom_generate_function_path and r.rollout_function_path:
            raise ConfigError(f"--rollout-function-path {r.rollout_function_path} generates the whole batch, so "
                              f"--custom-generate-function-path {r.custom_generate_function_path} would never be "
                              "called: keep one")
        group = batch = None
        group_where = batch_where = ""
        if r.custom_generate_function_path:
            group_where = f"--custom-generate-function-path {r.custom_generate_function_path}"
            group = load_function(r.custom_generate_function_path, "--custom-generate-function-path")
        if r.rollout_function_path:
            batch_where = f"--rollout-function-path {r.rollout_function_path}"
            batch = load_function(r.rollout_function_path, "--rollout-function-path")
        return cls(group, group_where, batch, batch_where, cfg, vocab_size_of(cfg))

    def group_generate(self, tokenizer: Any = None) -> Optional[GroupGenerate]:
        """The per-group function bound to ``tokenizer`` (what the asynchronous producer calls per group), or
        None with a batch function."""
        if self.group_fn is None:
            return None
        return group_generate(self.group_fn, self.group_where, tokenizer=tokenizer, cfg=self.cfg,
                              vocab_size=self.vocab_size)

    def generate(self, rollout_id: int, requests: Sequence[GenerateRequest], sampling: SamplingParams,
                 engine_call: EngineCall, tokenizer: Any = None) -> list[Sample]:
        """The samples of ``requests`` (request-major), from the batch function or group by group."""
        if self.batch_fn is not None:
            fn = rollout_generate(self.batch_fn, self.batch_where, tokenizer=tokenizer, cfg=self.cfg,
                                  vocab_size=self.vocab_size)
            return fn(rollout_id, list(requests), sampling, engine_call)
        group = self.group_generate(tokenizer)
        assert group is not None
        if self.group_fn is not None and is_slime_function(self.group_fn):  # engine calls over HTTP: the gateway
            return [s for g in slime_generate_groups(group, requests, sampling, engine_call) for s in g]
        return generate_groups(group, requests, sampling, engine_call)


__all__ = ["CALL_SEED_STRIDE", "EngineCall", "EngineHandle", "Generation", "GroupGenerate", "RolloutFunctions",
           "check_samples",
           "generate_groups", "group_generate", "load_function", "load_object", "locked_tokenizer", "rollout_generate",
           "truncate", "vocab_size_of"]

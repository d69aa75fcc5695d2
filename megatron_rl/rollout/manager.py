"""RolloutManager: what the driver rank does to produce one rollout batch.

It owns the prompt iterator, the engine and the reward function, and nothing
about training. One call, ``generate(rollout_id)``, returns rewarded ``Sample``s
(request-major: the n samples of one prompt share a ``group_index``). Rollouts
can be saved and reloaded by id (``--save-debug-rollout-data`` /
``--load-debug-rollout-data``, and ``rollout_ckpts/`` for resume), so a resumed
or train-only run sees exactly the samples the original run trained on.

Scoring and the rollout metrics are the batch builder's (``rollout/batch_builder.py``), which
``--async-mode full``'s producer uses too; stale and mixed samples are kept for training and counted
there. What is this module's own: the prompt stream, the engine calls and what they abort.

Aborted samples (finish_reason "abort": cut short by an /abort_request or a pause in abort
mode; or every row of a ``/generate`` SGLang answered 503, which it does when it aborts a row
with a status: a decode retraction without a KV backup, "Retry later.") are not kept as stale
ones are: their response is not what the policy would have finished, so they are never trained
on. Their groups are generated again (``_generate_complete``, ``--rollout-abort-retries``), and
``rollout/aborted_samples`` / ``rollout/abort_retried_groups`` count what happened.
"""

from __future__ import annotations

import dataclasses
import io
import os
import time
from typing import Optional

import torch

from megatron_rl.data.types import GenerateRequest, Sample, SamplingParams, mark_prompt
from megatron_rl.errors import ConfigError, EngineError
from megatron_rl.infra.atomic import atomic_write_bytes
from megatron_rl.rollout.batch_builder import RolloutBatchBuilder
from megatron_rl.rollout.dynamic_sampling import DynamicSampler
from megatron_rl.rollout.generate_fn import RolloutFunctions, group_slices
from megatron_rl.rollout.rewards import RewardFn, reward_metrics
from megatron_rl.rollout.rollout_ckpt import capture_rng_state, restore_rng_state


def sampling_params(cfg, *, n: int, seed: int, temperature: Optional[float] = None) -> SamplingParams:
    r = cfg.rollout
    return SamplingParams(temperature=r.rollout_temperature if temperature is None else temperature,
                          top_p=r.rollout_top_p, top_k=r.rollout_top_k, max_new_tokens=r.rollout_max_response_len,
                          stop_token_ids=tuple(r.rollout_stop_token_ids), seed=seed, n=n)


def eval_sampling_params(cfg) -> SamplingParams:
    """Evaluation's sampling: --eval-* where given, else the rollout's (greedy unless --eval-temperature)."""
    d, r = cfg.data, cfg.rollout
    return SamplingParams(temperature=d.eval_temperature,
                          top_p=r.rollout_top_p if d.eval_top_p is None else d.eval_top_p,
                          top_k=r.rollout_top_k if d.eval_top_k is None else d.eval_top_k,
                          max_new_tokens=d.eval_max_response_len or r.rollout_max_response_len,
                          stop_token_ids=tuple(r.rollout_stop_token_ids), seed=r.rollout_seed,
                          n=d.n_samples_per_eval_prompt)


def save_rollout(path: str, rollout_id: int, samples: list[Sample]) -> None:
    buf = io.BytesIO()
    torch.save({"rollout_id": rollout_id, "samples": [vars(s) for s in samples]}, buf)
    atomic_write_bytes(path, buf.getvalue())


def load_rollout(path: str) -> list[Sample]:
    """The samples ``save_rollout`` wrote; a file from before a ``Sample`` field existed gets its default."""
    if not os.path.isfile(path):
        raise ConfigError(f"rollout file {path} does not exist (--load-debug-rollout-data expects files written by "
                          "--save-debug-rollout-data with the same {rollout_id} pattern)")
    data = torch.load(path, weights_only=False)
    return [Sample(**d) for d in data["samples"]]


def _still_aborted(requests, by_group: list[list[Sample]], groups: list[int], retries: int) -> str:
    """The error of groups still aborted after ``retries`` retries: which prompts, and what the server said."""
    parts = []
    for g in groups[:4]:
        req = requests[g]
        where = ", ".join(f"{k} {req.metadata[k]}" for k in ("prompt_index", "line") if k in req.metadata)
        messages = sorted({str(s.metadata.get("finish_message") or "no message")
                           for s in by_group[g] if s.finish_reason == "abort"})
        parts.append(f"group {req.group_index} ({where or 'no index'}; {len(req.prompt_ids)} prompt tokens): "
                     f"{'; '.join(messages)}")
    more = f" and {len(groups) - 4} more group(s)" if len(groups) > 4 else ""
    return (f"rollout: {len(groups)} prompt group(s) still had aborted samples after {retries} retr"
            f"{'y' if retries == 1 else 'ies'} (--rollout-abort-retries); aborted samples are never trained on. "
            + " | ".join(parts) + more + ". SGLang answers a row with finish_reason abort (HTTP 200) when "
            "someone aborts it (/abort_request, or /pause_generation in abort mode): another trainer, a router or "
            "an operator sharing the engine; and a whole request with 503 when it aborts a row with a status (a "
            "decode retraction under memory pressure, a request timeout): its log shows the aborts. Raise "
            "--rollout-abort-retries to ride them out (for retractions: a lower --sglang-mem-fraction-static or "
            "fewer concurrent rows)")


class RolloutManager:
    def __init__(self, cfg, engine, prompts, reward_fn: RewardFn, eval_dataset=None,
                 dynamic_sampler: Optional[DynamicSampler] = None,
                 rollout_functions: Optional[RolloutFunctions] = None):
        self.cfg = cfg
        self.engine = engine
        self.prompts = prompts  # a resumable data.prompts.PromptIterator
        # {name: PromptDataset} per --eval-prompt-data set (name None: the one unnamed set), or one dataset
        sets = eval_dataset if isinstance(eval_dataset, dict) else {None: eval_dataset} if eval_dataset else {}
        self.eval_datasets = sets
        self.eval_dataset = next(iter(sets.values())) if len(sets) == 1 else None
        # scoring (reward, --overlong-buffer-len / --reward-clip-range shaping) and the rollout metrics, shared with
        # --async-mode full's producer
        self.batch_builder = RolloutBatchBuilder.from_config(cfg, reward_fn, getattr(engine, "tokenizer", None))
        self.remax = cfg.algorithm.advantage_estimator == "remax"  # a greedy baseline response per prompt
        self.last_baseline_s = 0.0
        self.dynamic_sampler = dynamic_sampler  # --dynamic-sampling-filter-path: batches filled in rounds
        # --custom-generate-function-path / --rollout-function-path: generate in the engine's place
        self.rollout_functions = rollout_functions
        self.rollout_id = 0  # the rollout being generated (what a --rollout-function-path function is told)

    def _generate_requests(self, requests, sampling) -> list[Sample]:
        """``engine.generate``, or the user's rollout function in its place (``rollout/generate_fn.py``): same
        contract (request-major, ``sampling.n`` each), every engine call still ``engine.generate``."""
        if self.rollout_functions is None:
            return list(self.engine.generate(requests, sampling))
        return self.rollout_functions.generate(self.rollout_id, requests, sampling, self.engine.generate,
                                               tokenizer=getattr(self.engine, "tokenizer", None))

    def _generate_complete(self, requests, sampling) -> list[Sample]:
        """The engine's samples of ``requests`` (request-major, ``sampling.n`` each) with no aborted one.

        A group with an aborted sample (finish_reason "abort": cut short by an abort or a pause) is
        generated again, whole (its samples are compared with each other),
        with seeds of its own, up to ``--rollout-abort-retries`` times; a group still aborted then
        stops the rollout naming the prompt and the server's message. Training on a cut-short
        response would score it as if finished, and its reward would move its group's baseline.
        Sets ``last_aborted`` (aborted samples seen, retries included) and ``last_retried_groups``.
        """
        n, retries = sampling.n, self.cfg.rollout.rollout_abort_retries
        # per request, its group's samples (n, or more where an agent session split into branches)
        by_group = [samples[sl] for samples in [self._generate_requests(requests, sampling)]
                    for sl in group_slices(samples, len(requests), n)]
        self.last_aborted = self.last_retried_groups = 0
        for attempt in range(1, retries + 2):
            aborted = [sum(s.finish_reason == "abort" for s in g) for g in by_group]
            if not any(aborted):
                break
            self.last_aborted += sum(aborted)
            groups = [g for g, count in enumerate(aborted) if count]
            if attempt > retries:
                raise EngineError(_still_aborted(requests, by_group, groups, retries))
            seed = None if sampling.seed is None else sampling.seed + 1_000_003 * attempt
            again = self._generate_requests([requests[g] for g in groups], dataclasses.replace(sampling, seed=seed))
            for g, sl in zip(groups, group_slices(again, len(groups), n)):
                by_group[g] = again[sl]
            self.last_retried_groups += len(groups)
        for req, group in zip(requests, by_group):  # errors about a sample name its prompt, whatever engine made it
            for sample in group:
                mark_prompt(sample, req)
        return [s for group in by_group for s in group]

    def _run(self, requests, sampling, evaluation: bool = False, prompts: Optional[str] = None) -> list[Sample]:
        """``requests``' rewarded samples; ``prompts``: how errors name their prompt file (default: --prompt-data)."""
        samples = self._generate_complete(requests, sampling)
        t = time.perf_counter()
        self.batch_builder.score(samples, evaluation=evaluation, prompts=prompts)
        self.last_reward_s = time.perf_counter() - t  # reported as perf/reward_s by generate()
        if self.remax and not evaluation:
            self._attach_greedy_baselines(requests, samples, sampling)
        return samples

    def _attach_greedy_baselines(self, requests, samples: list[Sample], sampling) -> None:
        """ReMax (Li et al. 2023; verl's ``remax``): one GREEDY response per prompt of this round, generated with
        the same weights right after its group and scored by the same reward (shaping included), becomes each of
        the group's samples' ``reward_baseline``. Its aborts are retried as the samples' are and add to the
        round's counts; its time is ``perf/remax_baseline_s``."""
        t = time.perf_counter()
        counts = self.last_aborted, self.last_retried_groups  # _generate_complete restarts them
        greedy = dataclasses.replace(sampling, n=1, temperature=0.0, top_p=1.0, top_k=-1)
        base = self._generate_complete(list(requests), greedy)
        self.batch_builder.score(base)  # the training reward, as the samples got theirs
        self.last_aborted += counts[0]
        self.last_retried_groups += counts[1]
        by_group = {b.group_index: float(b.reward) for b in base}
        for s in samples:
            s.reward_baseline = by_group[s.group_index]
        self.last_baseline_s += time.perf_counter() - t

    def generate(self, rollout_id: int) -> tuple[list[Sample], dict[str, float]]:
        """Rollout ``rollout_id``: ``--rollout-batch-size`` rewarded groups and the rollout's metrics.

        With ``--dynamic-sampling-filter-path`` the batch is filled in rounds (``dynamic_sampling.py``):
        the prompt stream advances past every prompt drawn, the reward time and abort counts add up
        over the rounds, and the rollout metrics describe the kept batch."""
        t0 = time.perf_counter()
        self.rollout_id = rollout_id
        self.last_baseline_s = 0.0  # ReMax's greedy responses, over the rounds
        b = self.cfg.batching
        sampling = sampling_params(self.cfg, n=b.n_samples_per_prompt,
                                   seed=self.cfg.rollout.rollout_seed + rollout_id)
        extra: dict[str, float] = {}
        if self.dynamic_sampler is None:
            samples = self._run(next(self.prompts).requests, sampling)
        else:
            totals = {"last_reward_s": 0.0, "last_aborted": 0, "last_retried_groups": 0}

            def run_round(requests, round_sampling):
                out = self._run(requests, round_sampling)
                for name in totals:
                    totals[name] += getattr(self, name)
                return out

            samples, extra = self.dynamic_sampler.fill(lambda k: self.prompts.take(k).requests, run_round, sampling,
                                                       b.rollout_batch_size, args=self.cfg)
            for name, total in totals.items():  # reported below as for one round
                setattr(self, name, total)
        # measured against the engine's version now: in turn, the weights the next training starts from
        metrics = self.batch_builder.metrics(samples, trained_at=self.engine.weight_version,
                                             time_s=time.perf_counter() - t0, reward_s=self.last_reward_s)
        metrics["rollout/aborted_samples"] = float(self.last_aborted)  # generated again, never trained on
        metrics["rollout/abort_retried_groups"] = float(self.last_retried_groups)
        if self.remax:
            metrics["rollout/remax_baseline_mean"] = sum(s.reward_baseline or 0.0 for s in samples) / len(samples)
            metrics["perf/remax_baseline_s"] = self.last_baseline_s
        metrics.update(extra)
        return samples, metrics

    # ---- what generating a rollout advances (saved with it in rollout_ckpts/, see rollout_ckpt.py) ----
    def position(self) -> dict:
        """Where the prompt stream stands: a stored rollout is only valid when generated from here."""
        return self.prompts.state_dict()

    def state_dict(self) -> dict:
        """Everything ``generate`` advances: the prompt position and the driver's global RNG streams.

        The engine's sampling randomness is not in it: each call seeds its own generators from
        ``--rollout-seed`` + rollout id, so there is no engine RNG state to carry.
        """
        return {"prompts": self.prompts.state_dict(), "rng": capture_rng_state()}

    def load_state_dict(self, state: dict) -> None:
        self.prompts.load_state_dict(state["prompts"])
        restore_rng_state(state["rng"])

    def fingerprint(self) -> dict:
        """The flags that decide a rollout's content besides the weights and the prompt position."""
        r, b, d = self.cfg.rollout, self.cfg.batching, self.cfg.data
        return {"hf_checkpoint": self.cfg.model.hf_checkpoint, "rollout_backend": r.rollout_backend,
                "prompt_data": d.prompt_data, "input_key": d.input_key, "label_key": d.label_key,
                "apply_chat_template": d.apply_chat_template, "rm_type": d.rm_type,
                "custom_rm_path": d.custom_rm_path, "rollout_batch_size": b.rollout_batch_size,
                "n_samples_per_prompt": b.n_samples_per_prompt, "rollout_seed": r.rollout_seed,
                "rollout_temperature": r.rollout_temperature, "rollout_top_p": r.rollout_top_p,
                "rollout_top_k": r.rollout_top_k, "rollout_max_prompt_len": r.rollout_max_prompt_len,
                "rollout_max_response_len": r.rollout_max_response_len,
                "rollout_stop_token_ids": list(r.rollout_stop_token_ids),
                # only when set, so rollouts stored before these flags existed still match
                **{k: v for k, v in (("rm_url", d.rm_url),
                                     ("custom_reward_function_path", d.custom_reward_function_path),
                                     ("custom_reward_function_kwargs", d.custom_reward_function_kwargs),
                                     ("dynamic_sampling_filter_path", r.dynamic_sampling_filter_path),
                                     ("over_sampling_batch_size", r.over_sampling_batch_size),
                                     ("dynamic_sampling_max_rounds",
                                      r.dynamic_sampling_max_rounds if r.dynamic_sampling_filter_path else None))
                   if v is not None},
                **self._function_fingerprint()}

    def _function_fingerprint(self) -> dict:
        """The rollout-function flags, only when a function is set (rollouts stored before them still match)."""
        r = self.cfg.rollout
        if r.agent_function_path:
            return {"agent_function_path": r.agent_function_path}
        if not (r.custom_generate_function_path or r.rollout_function_path):
            return {}
        return {"custom_generate_function_path": r.custom_generate_function_path,
                "rollout_function_path": r.rollout_function_path, "tools": r.tools, "max_turns": r.max_turns}

    def evaluate(self, rollout_id: int) -> dict[str, float]:
        """Each --eval-prompt-data set: ``eval/reward_mean`` (one unnamed set) or ``eval/NAME/reward_mean``,
        the mean response length and a dict reward's metrics (``eval/reward/<key>``), sampled with
        :func:`eval_sampling_params`."""
        metrics = {}
        self.rollout_id = rollout_id
        paths = dict(self.cfg.data.eval_sets)
        for name, dataset in self.eval_datasets.items():
            requests = [GenerateRequest(prompt_ids=list(p.prompt_ids), group_index=i, label=p.label,
                                        prompt_text=p.prompt_text,
                                        metadata={**p.metadata, "prompt_index": i, "line": p.line})
                        for i, p in enumerate(dataset.prompts)]
            flag = "--eval-prompt-data" + (f" {name}" if name else "")
            samples = self._run(requests, eval_sampling_params(self.cfg), evaluation=True,
                                prompts=f"{flag} {paths.get(name, '')}".rstrip())
            prefix = "eval/" if name is None else f"eval/{name}/"
            metrics[prefix + "reward_mean"] = sum(s.reward for s in samples) / len(samples)
            metrics[prefix + "response_len_mean"] = sum(s.response_length for s in samples) / len(samples)
            metrics.update({prefix + key: value for key, value in reward_metrics(samples).items()})  # reward/<key>
        return metrics

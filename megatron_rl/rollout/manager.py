"""RolloutManager: what the driver rank does to produce one rollout batch.

It owns the prompt iterator, the engine and the reward function, and nothing
about training. One call, ``generate(rollout_id)``, returns rewarded ``Sample``s
(request-major: the n samples of one prompt share a ``group_index``). Rollouts
can be saved and reloaded by id (``--save-debug-rollout-data`` /
``--load-debug-rollout-data``, and ``rollout_ckpts/`` for resume), so a resumed
or train-only run sees exactly the samples the original run trained on.
"""

from __future__ import annotations

import io
import os
import time
from typing import Optional

import torch

from megatron_rl.data.types import GenerateRequest, Sample, SamplingParams
from megatron_rl.errors import ConfigError
from megatron_rl.infra.atomic import atomic_write_bytes
from megatron_rl.rollout.rewards import compute_rewards
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
    if not os.path.isfile(path):
        raise ConfigError(f"rollout file {path} does not exist (--load-debug-rollout-data expects files written by "
                          "--save-debug-rollout-data with the same {rollout_id} pattern)")
    data = torch.load(path, weights_only=False)
    return [Sample(**d) for d in data["samples"]]


class RolloutManager:
    def __init__(self, cfg, engine, prompts, reward_fn, eval_dataset=None):
        self.cfg = cfg
        self.engine = engine
        self.prompts = prompts  # a resumable data.prompts.PromptIterator
        # {name: PromptDataset} per --eval-prompt-data set (name None: the one unnamed set), or one dataset
        sets = eval_dataset if isinstance(eval_dataset, dict) else {None: eval_dataset} if eval_dataset else {}
        self.eval_datasets = sets
        self.eval_dataset = next(iter(sets.values())) if len(sets) == 1 else None
        self.reward_fn = reward_fn

    def _run(self, requests, sampling) -> list[Sample]:
        samples = self.engine.generate(requests, sampling)
        tok = getattr(self.engine, "tokenizer", None)
        for s in samples:
            if s.response_text is None and tok is not None:
                s.response_text = tok.decode(s.response_ids, skip_special_tokens=True)
        t = time.perf_counter()
        compute_rewards(samples, self.reward_fn, source=self.cfg.data.custom_rm_path or f"--rm-type {self.cfg.data.rm_type}")
        self.last_reward_s = time.perf_counter() - t  # reported as perf/reward_s by generate()
        return samples

    def generate(self, rollout_id: int) -> tuple[list[Sample], dict[str, float]]:
        t0 = time.perf_counter()
        b = self.cfg.batching
        requests = next(self.prompts).requests
        sampling = sampling_params(self.cfg, n=b.n_samples_per_prompt,
                                   seed=self.cfg.rollout.rollout_seed + rollout_id)
        samples = self._run(requests, sampling)
        rewards = torch.tensor([s.reward for s in samples])
        lengths = torch.tensor([float(s.response_length) for s in samples])
        metrics = {"rollout/reward_mean": rewards.mean().item(), "rollout/reward_std": rewards.std().item(),
                   "rollout/response_len_mean": lengths.mean().item(),
                   "rollout/response_len_max": lengths.max().item(),
                   "rollout/truncated_frac": sum(s.finish_reason == "length" for s in samples) / len(samples),
                   "rollout/time_s": time.perf_counter() - t0,
                   "perf/reward_s": self.last_reward_s,
                   "rollout/weight_version": float(samples[0].weight_version)}
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
                "rollout_stop_token_ids": list(r.rollout_stop_token_ids)}

    def evaluate(self, rollout_id: int) -> dict[str, float]:
        """Each --eval-prompt-data set: ``eval/reward_mean`` (one unnamed set) or ``eval/NAME/reward_mean``,
        and the mean response length, sampled with :func:`eval_sampling_params`."""
        metrics = {}
        for name, dataset in self.eval_datasets.items():
            requests = [GenerateRequest(prompt_ids=list(p.prompt_ids), group_index=i, label=p.label,
                                        prompt_text=p.prompt_text) for i, p in enumerate(dataset.prompts)]
            samples = self._run(requests, eval_sampling_params(self.cfg))
            prefix = "eval/" if name is None else f"eval/{name}/"
            metrics[prefix + "reward_mean"] = sum(s.reward for s in samples) / len(samples)
            metrics[prefix + "response_len_mean"] = sum(s.response_length for s in samples) / len(samples)
        return metrics

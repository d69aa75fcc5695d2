"""The reward-model role: a sequence-classification model scoring every sample on the trainer's ranks.

``--reward-model-path DIR`` (OpenRLHF's ``--reward_pretrain``, verl's ``reward_model.model.path``): an HF dir of
``AutoModelForSequenceClassification`` with one label (a Bradley-Terry RM such as Skywork-Reward, or any
``*ForSequenceClassification`` checkpoint). Between generation and training, the rollout batch goes to every
trainer rank, each rank scores its share (sample ``i`` on rank ``i % world``), and one all-reduce gives the driver
every score; the sample's reward becomes the score times ``--reward-model-weight``, plus the rule reward when
``--rm-type`` / ``--custom-rm-path`` / ``--rm-url`` also gives one (its value is kept as ``reward/rule``). The
rollout's reward metrics are then computed again (``rollout/reward_mean``/``_std``) and the scores' mean is
logged as ``reward/rm_score``.

What the RM reads: the policy's token ids themselves when the RM's tokenizer is the policy's (the same
vocabulary, or a dir without a tokenizer); otherwise ``prompt_text + response_text`` encoded by the RM's own
tokenizer (what a remote RM of another family receives in OpenRLHF; re-rendering the conversation in the RM's
chat template, as verl's RM worker can, is not built). The score is the head's output at the last token, as
``AutoModelForSequenceClassification`` reads it: this module runs HF's own module, so a score equals HF's on
the same ids (``tests/dist/test_reward_model_ranks.py``).

Where it lives: a whole copy per trainer rank (not sharded), in float32 (``--bf16``: bfloat16 on a GPU). With
``--offload-train`` / ``--colocate`` it stays in host memory and is on the device only while it scores.
"""

from __future__ import annotations

import logging
import os
from typing import Optional, Sequence

import torch

from megatron_rl.backends.base import broadcast_samples
from megatron_rl.data.types import Sample
from megatron_rl.errors import ConfigError

log = logging.getLogger(__name__)


class RewardModel:
    """One copy of the RM on this rank (module docstring)."""

    def __init__(self, cfg) -> None:
        import transformers  # lazy: only a run with a reward model loads one

        path = cfg.data.reward_model_path
        self.path, self.weight = path, float(cfg.data.reward_model_weight)
        d = cfg.data
        # a rule reward too: the score adds to it
        self.has_rule = bool(d.rm_type or d.custom_rm_path or d.rm_url or d.custom_reward_function_path)
        self.micro_batch_size = max(1, int(cfg.data.reward_model_micro_batch_size))
        cuda = torch.cuda.is_available()
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        self.resident = not (cuda and cfg.memory.effective_offload_train)  # colocated: on the device to score only
        dtype = torch.bfloat16 if cuda and cfg.precision.bf16 else torch.float32
        model = transformers.AutoModelForSequenceClassification.from_pretrained(path, dtype=dtype)
        if int(model.config.num_labels) != 1:
            raise ConfigError(f"--reward-model-path {path}: its head has {model.config.num_labels} labels; a reward "
                              "model scores with one (num_labels 1)")
        model.requires_grad_(False)
        model.eval()
        self.model = model.to(self.device if self.resident else torch.device("cpu"))
        self.pad_id = model.config.pad_token_id
        self.tokenizer = _own_tokenizer(path, cfg.model.hf_checkpoint)

    def encode(self, sample: Sample) -> list[int]:
        """The ids the RM reads for ``sample`` (module docstring)."""
        if self.tokenizer is None:
            return list(sample.prompt_ids) + list(sample.response_ids)
        if sample.prompt_text is None or sample.response_text is None:
            raise ConfigError(f"--reward-model-path {self.path} has a tokenizer of its own, so it reads the sample's "
                              "text, and a sample came without prompt_text/response_text (a custom generate "
                              "function must fill them, or give the RM dir the policy's tokenizer)")
        return list(self.tokenizer(sample.prompt_text + sample.response_text, add_special_tokens=False)["input_ids"])

    @torch.no_grad()
    def scores(self, samples: Sequence[Sample]) -> list[float]:
        """The RM's score of each sample, on this rank (micro-batches right-padded with the RM's pad id; one sample
        per forward when the RM has none, as HF reads the last token of a padded row by the pad id)."""
        ids = [self.encode(s) for s in samples]
        if not self.resident:
            self.model.to(self.device)
        try:
            size = self.micro_batch_size if self.pad_id is not None else 1
            out: list[float] = []
            for start in range(0, len(ids), size):
                chunk = ids[start:start + size]
                width = max(len(x) for x in chunk)
                pad = self.pad_id if self.pad_id is not None else 0
                batch = torch.tensor([x + [pad] * (width - len(x)) for x in chunk], device=self.device)
                mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in chunk], device=self.device)
                logits = self.model(input_ids=batch, attention_mask=mask).logits  # [b, 1]
                out.extend(float(v) for v in logits[:, 0].float().cpu())
            return out
        finally:
            if not self.resident:
                self.model.to("cpu")
                torch.cuda.empty_cache()


def _own_tokenizer(rm_dir: str, policy_dir: Optional[str]):
    """The RM's tokenizer when it is not the policy's, else None (the RM reads the policy's ids)."""
    if not any(os.path.isfile(os.path.join(rm_dir, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    import transformers  # lazy: only a run with a reward model loads one

    mine = transformers.AutoTokenizer.from_pretrained(rm_dir)
    if policy_dir is not None:
        policy = transformers.AutoTokenizer.from_pretrained(policy_dir)
        if mine.get_vocab() == policy.get_vocab():
            return None
    return mine


def score_batch(rm: RewardModel, samples: Optional[list[Sample]]) -> Optional[list[float]]:
    """Collective over the trainer's ranks: the RM's score of every sample of the driver's batch (``samples``;
    None on the other ranks, which get None back). Each rank scores samples ``rank, rank + world, ...``; one
    all-reduce of the scores (zeros elsewhere) gives the driver all of them."""
    import torch.distributed as dist

    batch = broadcast_samples(samples)
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    rank = dist.get_rank() if world > 1 else 0
    mine = list(range(rank, len(batch), world))
    scores = torch.zeros(len(batch), dtype=torch.float64)
    for i, score in zip(mine, rm.scores([batch[i] for i in mine])):
        scores[i] = score
    if world > 1:
        dist.all_reduce(scores)
    return scores.tolist() if samples is not None else None

"""A frozen log-prob role of other shapes than the actor's on megatron-core: the larger teacher of on-policy
distillation (``--opd-teacher-load`` of another hidden size or depth, same tokenizer), or a reference of
another model.

Why a model of its own: a weight tag (``base.WeightManager``) is a copy of the actor's parameter shards, so it
holds only weights of the actor's shapes; a teacher larger than the student, the usual distillation case, is a
second ``GPTModel``, built by its own bridge from its own ``config.json`` through ``role_model.RoleModel`` (no
DDP, no optimizer, no gradients). ``roles.needs_own_model`` decides from the two config files.

Layout: the actor's TP and PP, without virtual pipeline stages or context parallelism (``role_model.role_layout``).
When that equals the actor's layout the teacher runs over the actor's packed micro-batches of the pass (the
old-log-prob pass packed them already); otherwise it is a second layout on the same ranks (a ``LayoutScope``)
with its own share of the batch (``RoleShare``), and every rank gets every sample's log-probs.

Memory: its parameters are the model's only state. On a GPU, ``sleep`` moves them to host memory while a
colocated engine generates and ``wake`` brings them back (no optimizer or gradient buffers exist).
Checkpoints do not hold it: a resumed run loads it again from its flag, as it loads a weight tag.
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megatron_rl.backends.megatron.role_model import RoleModel, RoleShare, load_model_dir, role_layout
from megatron_rl.config.role_models import config_dir
from megatron_rl.data.packing import MicroBatchPlan
from megatron_rl.errors import CheckpointError
from megatron_rl.models import get_bridge
from megatron_rl.models.parallel import LayoutScope

log = logging.getLogger(__name__)


class MegatronFrozenRole:
    """A frozen model of other shapes (module docstring); ``roles.FrozenRole``."""

    def __init__(self, backend, name: str, path: str, flag: str) -> None:
        self.backend = backend
        self.name, self.path, self.flag = name, path, flag
        cfg = backend.cfg
        found = config_dir(path)
        if found is None:
            raise CheckpointError(f"{flag} {path}: no config.json (an HF dir) or hf_config/config.json (a torch_dist "
                                  "model dir) to build a model of its own shapes from")
        self.config_dir: str = found
        self.bridge = get_bridge(self.config_dir)
        self.scope = LayoutScope(role_layout(cfg, backend.layout), backend.layout)
        self.share: Optional[RoleShare] = None if self.scope.same else RoleShare(cfg, self.scope,
                                                                               backend.pad_token_id)
        self.role = RoleModel(name, cfg, self.bridge, self.scope, params_dtype=backend.params_dtype,
                              head="logprob", load=self._load, optimization=None)
        self._host: Optional[list[torch.Tensor]] = None
        if dist.get_rank() == 0:
            log.info("%s", self.role.describe(f"{flag} {path}", self.share.dp_size if self.share is not None else None))

    def _load(self, chunks: list) -> None:
        """Its weights with the checks of ``--load``'s loaders: an HF dir's marker and checksums, a model dir's
        marker, fingerprint and every tensor's shape."""
        from megatron_rl.models import model_dir  # lazy: checksums of the HF dir

        if self.config_dir == self.path:  # an HF dir
            model_dir.check_hf_marker_once(self.path, f"checking {self.flag} {self.path}")
            self.bridge.load_hf_weights(chunks, self.path)
            return
        load_model_dir(chunks, model_dir.resolve_dist_dir(self.path), self.bridge, self.config_dir)

    def log_probs(self, samples: Sequence, plan: Optional[MicroBatchPlan], owned_only: bool
                  ) -> list[Optional[torch.Tensor]]:
        """``TrainBackend.forward``'s contract under this model: over the actor's plan and micro-batches when the
        layouts are equal, else over its own plan, whole on every rank (which serves ``owned_only`` too)."""
        backend = self.backend
        if self.share is None:
            plan, mbs, _ = backend.preprocess_rollout_data(samples, plan=plan)
            return backend.gather_per_sample(self.role.forward_only(samples, mbs, backend.spec), samples, plan,
                                             owned_only)
        own, mbs, _ = self.share.preprocess_rollout_data(samples)
        return self.share.gather_per_sample(self.role.forward_only(samples, mbs, backend.spec), samples, own)

    # ---- memory ---------------------------------------------------------------

    def sleep(self) -> None:
        """GPU: the parameters to host memory (pinned), their device memory released; CPU: nothing to move."""
        if not torch.cuda.is_available() or self._host is not None:
            return
        params = [p for c in self.role.chunks for p in c.parameters()]
        self._host = [torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=True).copy_(p.data)
                      for p in params]
        for p in params:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    def wake(self) -> None:
        if self._host is None:
            return
        device = torch.device("cuda", torch.cuda.current_device())
        for p, host in zip((p for c in self.role.chunks for p in c.parameters()), self._host):
            p.data = host.to(device, non_blocking=True)
        torch.cuda.synchronize()
        self._host = None

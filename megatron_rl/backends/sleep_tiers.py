"""What the trainer's ``sleep()`` frees, chosen once per run and logged (tiers: docs/sglang.md, "Trainer sleep tiers").

The source design has three megatron tiers: (1) torch_memory_saver pauses every allocation and
the process groups are destroyed; (2) megatron's own offload (gradient buffers released,
optimizer state to host) plus the groups; (3) the groups only. Here:

* ``offload`` (megatron on a GPU): tier 2's offload; ``fsdp-offload``: FSDP2's sharded
  parameters, gradients and optimizer state to host;
* ``none``: a CPU run, where host memory is the only memory, so there is nothing to free;
* the groups (``--offload-train-groups``): destroyed while the engine generates and rebuilt
  before training (``infra/reloadable_groups.py``). Only on request (``on``): ``auto`` keeps
  them, on GPUs too, because the teardown has run over gloo only, never over NCCL; it stays
  off by default until scripts/gpu_check.sh (``benchmarks/gpu_steps.py``'s ``sleep_wake``
  check, which forces it on) has run it on a GPU.

Tier 1 is not built, and what it takes is known (read from slime and torch_memory_saver 0.0.10):
torch_memory_saver frees only what was allocated inside its region, so the whole trainer
process must allocate in it (slime preloads its allocator hook with ``TMS_INIT_ENABLE=1`` and
``TMS_INIT_ENABLE_CPU_BACKUP=1``); its pause then frees the parameters too, so the weight sync,
which runs while the trainer sleeps (runner/colocation.py's order), must export from the host
backups (``get_cpu_backup``) and allocate its buckets under ``disable()``. Over tier 2 it frees
the bf16 parameters (2 bytes each, beside the up to 16 of gradient, master weight and Adam
moments that tier 2 frees already), the allocator's cache and its fragmentation; none of that
can be measured without a GPU (``benchmarks/gpu_steps.py``'s ``memory_saver`` check does, when
scripts/gpu_check.sh is lent one). A run that has it installed is told so in the log and gets tier 2.
"""

from __future__ import annotations

from dataclasses import dataclass

#: what each tier frees, for the log line
TIERS = {
    "offload": "gradient buffers released, optimizer state to host memory (megatron-core's offload)",
    "fsdp-offload": "sharded parameters, gradients and optimizer state to host memory",
    "none": "nothing to free on a CPU run (host memory is the only memory)",
}


@dataclass(frozen=True)
class SleepPlan:
    tier: str  # a key of TIERS
    groups: bool  # process groups destroyed while the engine generates
    why_groups: str

    def describe(self) -> str:
        groups = ("process groups destroyed while the engine generates, rebuilt before training"
                  if self.groups else "process groups kept")
        return f"{self.tier}: {TIERS[self.tier]}; {groups} ({self.why_groups})"


def plan_sleep(groups_setting: str, *, backend: str, cuda: bool) -> SleepPlan:
    """The tier for ``backend`` on this device and whether the groups go (``--offload-train-groups``
    auto|on|off; validation already refused ``on`` for FSDP and without an offload)."""
    tier = ("offload" if backend == "megatron" else "fsdp-offload") if cuda else "none"
    if groups_setting == "on":
        return SleepPlan(tier, True, "--offload-train-groups on")
    if groups_setting == "off":
        return SleepPlan(tier, False, "--offload-train-groups off")
    if backend != "megatron":
        return SleepPlan(tier, False, "auto: FSDP2's device mesh keeps its groups")
    if not cuda:
        return SleepPlan(tier, False, "auto: gloo groups on CPU hold no device memory")
    return SleepPlan(tier, False, NCCL_TEARDOWN_UNVERIFIED)


#: why ``auto`` keeps the groups on a GPU (the log line of the sleep plan)
NCCL_TEARDOWN_UNVERIFIED = (
    "auto: off on GPUs until verified: the destroy/rebuild of the process groups has run over gloo only, never on "
    "NCCL (scripts/gpu_check.sh runs it); --offload-train-groups on turns it on, to free the NCCL communicators' "
    "GPU memory while the engine generates")


MEMORY_SAVER_NOTE = ("torch_memory_saver is installed but not used: its pause frees only allocations made inside "
                     "its region, and this version builds the model outside it (tier 1 of the design is not built); "
                     "the trainer's sleep uses megatron's offload instead")

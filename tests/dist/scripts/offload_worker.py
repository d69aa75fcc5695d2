"""Worker for tests/dist/test_optimizer_offload.py: ckpt_worker.py's jobs, plus where the optimizer state lives.

Job ``offload`` of tests/dist/harness.py: argv = HF_DIR OUT_DIR JOB_JSON [JOB_JSON ...], jobs exactly as
in ckpt_worker.py (train / save / load a MegatronBackend; same outputs).

Why a wrapper: the resume machinery is ckpt_worker's; only the per-rank optimizer dump
({tag}_opt_rank{r}.pt) gains an ``offload`` record, so the test can tell that megatron-core's
HybridDeviceOptimizer really ran its offload path (host copies of every shard, a CPU
sub-optimizer owning the state, parameters copied back) rather than the plain optimizer.
"""


import torch


import ckpt_worker  # noqa: E402

_plain_dump = ckpt_worker.optimizer_dump


def offload_layout(optimizer) -> list[dict]:
    """Per chained optimizer: how HybridDeviceOptimizer split its shards (``None`` for any other kind)."""
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    out = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = opt.optimizer
        if not isinstance(inner, HybridDeviceOptimizer):
            out.append(None)
            continue
        device = [p for g in inner.param_groups for p in g["params"]]
        copies = inner.gpu_params_map_cpu_copy
        host_params = {id(p) for sub in inner.cpu_optimizers for g in sub.param_groups for p in g["params"]}
        state_keys = {id(p) for sub in inner.cpu_optimizers for p in sub.state}
        out.append({
            "params": len(device),
            "offloaded": sum(1 for p in device if p in copies),
            "cpu_optimizers": len(inner.cpu_optimizers),
            "device_optimizer": inner.gpu_optimizer is not None,
            # a real copy: own storage, same values after the step's copy back
            "separate_storage": all(copies[p].untyped_storage().data_ptr() != p.untyped_storage().data_ptr()
                                    for p in device if p in copies),
            "host_equals_device": all(torch.equal(copies[p], p) for p in device if p in copies),
            "cpu_optimizer_owns_host_copies": host_params == {id(c) for c in copies.values()},
            "state_on_host_copies": bool(state_keys) and state_keys <= host_params,
        })
    return out


def optimizer_dump(optimizer):
    dump = _plain_dump(optimizer)
    dump["offload"] = offload_layout(optimizer)
    return dump


def main(argv):
    """ckpt_worker's jobs with this dump in place of the plain one (put back after: a launch runs other jobs)."""
    ckpt_worker.optimizer_dump = optimizer_dump
    try:
        ckpt_worker.main(argv)
    finally:
        ckpt_worker.optimizer_dump = _plain_dump

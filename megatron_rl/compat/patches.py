"""Labelled patches that let real megatron-core 0.16 run on CPU under gloo.

Each patch is one small function answering one megatron-core behaviour. Patches
are guarded by the megatron-core version they were written against
(:data:`SUPPORTED_VERSION_PREFIX`): on another version a patch whose target has
moved warns and is skipped instead of failing, so a version bump shows up as a
warning list, not a crash deep inside a forward pass. A patch that wraps or
replaces a megatron function also checks that the function still takes the
parameters it was written for (``inspect.signature`` names, from 0.16.1) and
refuses with :class:`SignatureChanged` otherwise: megatron may keep a name and
change what it means (Megatron-LM main already reshaped
``linear_with_grad_accumulation_and_async_allreduce``), and a wrapper passing
arguments by position would then be silently wrong.

Four groups:

* ``CPU_PATCHES``: only when ``torch.cuda.is_available()`` is False. On a GPU host
  megatron runs unchanged.
* ``CPU_SPEED_PATCHES``: speed only (the same values, fewer Python calls), so only
  where they were measured and needed: on CPU. A refused one is skipped with a
  warning on any version (megatron's own code then runs, slower, not wrong).
* ``ANY_HOST_PATCHES``: correctness gaps of 0.16.1 that hit GPU hosts too.
* ``NO_TE_PATCHES``: gaps of 0.16.1 that also hit GPU hosts *without*
  transformer-engine (e.g. the MoE router's ``te_general_gemm`` NameError).

Configuration beats patching: everything a ``TransformerConfig`` flag can switch
off (fusions, ``batch_p2p_comm``, ``gradient_accumulation_fusion``, CPU init) is
set in :func:`megatron_rl.compat.cpu_config_overrides` instead of here.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch

from megatron_rl.compat import cpu_torch
from megatron_rl.compat.memo import IdentityMemo

SUPPORTED_VERSION_PREFIX = "0.16."

# megatron.core modules the shim imports up front so that the module-level
# ``torch`` rebinding (cpu_torch.install) reaches every module we execute.
MEGATRON_MODULES = (
    "megatron.core.parallel_state",
    "megatron.core.utils",
    "megatron.core.tensor_parallel",
    "megatron.core.tensor_parallel.random",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.cross_entropy",
    "megatron.core.tensor_parallel.data",
    "megatron.core.transformer.utils",
    "megatron.core.transformer.attention",
    "megatron.core.transformer.dot_product_attention",
    "megatron.core.transformer.transformer_block",
    "megatron.core.transformer.transformer_layer",
    "megatron.core.transformer.mlp",
    "megatron.core.transformer.moe.moe_layer",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.experts",
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.transformer.moe.shared_experts",
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.models.common.embeddings.rope_utils",
    "megatron.core.models.common.language_module.language_module",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.distributed",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.distributed.finalize_model_grads",
    "megatron.core.optimizer",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.cpu_offloading.hybrid_optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.optimizer_param_scheduler",
    "megatron.core.rerun_state_machine",
    "megatron.core.fusions.fused_bias_swiglu",
    "megatron.core.fusions.fused_bias_dropout",
)


@dataclass(frozen=True)
class Patch:
    name: str
    answers: str  # the megatron-core behaviour this patch answers
    apply: Callable[[], None]
    speed_only: bool = False  # same values without it: refused -> skipped with a warning, on any version


class TargetMoved(Exception):
    """A patch target does not exist in this megatron-core version."""


class SignatureChanged(TargetMoved):
    """A patch target exists but no longer takes the parameters the patch was written for."""


def _require(module, attr: str, params: tuple[str, ...] | None = None):
    """``module.attr``; with ``params``, also check that the function's parameter names are exactly those (the
    signature the patch was written for). Our own wrapper (already applied) is not checked again."""
    if not hasattr(module, attr):
        raise TargetMoved(f"{module.__name__}.{attr}")
    target = getattr(module, attr)
    if params is not None and not getattr(target, "_megatron_rl_compat", False):
        got = tuple(inspect.signature(target).parameters)
        if got != params:
            raise SignatureChanged(
                f"{getattr(module, '__name__', module)}.{attr} takes ({', '.join(got)}), not the ({', '.join(params)}) "
                f"this patch was written for (megatron-core 0.16.1): refusing to wrap it")
    return target


def _mark(*fns: Callable[..., Any], **attrs: Any) -> None:
    """Tag our replacement functions: ``_megatron_rl_compat`` is how a repeated patch call recognises its
    own wrapper; ``attrs`` are what a wrapper keeps about itself (``original``, ``memo``, ``warned``)."""
    for fn in fns:
        for name, value in {"_megatron_rl_compat": True, **attrs}.items():
            setattr(fn, name, value)


def _megatron_modules():
    return [m for n, m in list(sys.modules.items())
            if m is not None and (n == "megatron.core" or n.startswith("megatron.core."))]


def _rebind_everywhere(original, replacement) -> int:
    """Point every megatron.core module global bound to ``original`` at ``replacement``.

    Needed because megatron imports helpers by name (``from x import f``), so
    patching ``x.f`` alone would miss the copies.
    """
    count = 0
    for module in _megatron_modules():
        for key, value in list(vars(module).items()):
            if value is original:
                setattr(module, key, replacement)
                count += 1
    return count


def import_megatron_modules() -> None:
    for name in MEGATRON_MODULES:
        importlib.import_module(name)


# --------------------------------------------------------------------------- CPU
def patch_module_torch() -> None:
    """``torch.cuda.current_device()``, ``device="cuda"``, streams, events, NVTX,
    ``synchronize`` and ``pin_memory=True`` at ~200 megatron call sites."""
    cpu_torch.install("megatron.core")


_MEGATRON_CALLER_PREFIX = "megatron.core"


def _called_from_megatron(depth: int = 2) -> bool:
    return sys._getframe(depth).f_globals.get("__name__", "").startswith(_MEGATRON_CALLER_PREFIX)


_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


def patch_tensor_methods() -> None:
    """Tensor methods megatron calls assuming CUDA: ``.cuda()`` / ``.pin_memory()``
    (return the CPU tensor) and ``param.type() == 'torch.cuda.FloatTensor'``
    checks in the optimizers and grad clipping (answer with the CUDA spelling).

    Scoped: the replacement looks at the caller's module and behaves exactly like
    torch for every caller outside ``megatron.core``.
    """
    if getattr(torch.Tensor.cuda, "_megatron_rl_compat", False):
        return
    orig_cuda, orig_pin, orig_type = torch.Tensor.cuda, torch.Tensor.pin_memory, torch.Tensor.type

    def cuda(self, *args, **kwargs):
        if _called_from_megatron():
            return self
        return orig_cuda(self, *args, **kwargs)

    def pin_memory(self, *args, **kwargs):
        if _called_from_megatron():
            return self
        return orig_pin(self, *args, **kwargs)

    def type_(self, *args, **kwargs):
        if not args and not kwargs and _called_from_megatron():
            name = orig_type(self)
            return _TYPE_NAMES.get(name, name)
        return orig_type(self, *args, **kwargs)

    _mark(cuda, pin_memory, type_)
    for name, fn in (("cuda", cuda), ("pin_memory", pin_memory), ("type", type_)):
        setattr(torch.Tensor, name, fn)


def patch_rng_tracker() -> None:
    """``CudaRNGStatesTracker`` / ``model_parallel_cuda_manual_seed`` read and write
    CUDA generator state; on CPU they fork the CPU default generator instead, so
    TP-region dropout/init still get per-rank streams."""
    from megatron.core.tensor_parallel import random as mrandom

    _require(mrandom, "_get_cuda_rng_state", ("device", "clone", "graph_safe"))
    _require(mrandom, "_set_cuda_rng_state", ("new_state", "device", "graph_safe"))
    if getattr(mrandom._get_cuda_rng_state, "_megatron_rl_compat", False):
        return

    def _get_rng_state(device="cuda", clone=False, graph_safe=False):
        return torch.get_rng_state()

    def _set_rng_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    _mark(_get_rng_state, _set_rng_state)
    _rebind_everywhere(mrandom._get_cuda_rng_state, _get_rng_state)
    _rebind_everywhere(mrandom._set_cuda_rng_state, _set_rng_state)


_JIT_UNWRAPPED: set[str] = set()  # megatron modules whose compiled functions were unwrapped


def patch_jit_fuser() -> None:
    """``jit_fuser`` is ``torch.compile``: tens of seconds of dynamo tracing per
    shape on CPU for no gain. Later decorations become no-ops, and functions
    already compiled at import time are unwrapped to their Python originals."""
    from megatron.core import jit

    _require(jit, "disable_jit_fuser")
    jit.disable_jit_fuser()
    for module in _megatron_modules():
        if module.__name__ in _JIT_UNWRAPPED:  # scanned already (each apply_cpu_compat re-runs this: ~50 ms a scan)
            continue
        _JIT_UNWRAPPED.add(module.__name__)
        for key, value in list(vars(module).items()):
            orig = getattr(value, "_torchdynamo_orig_callable", None)
            if callable(value) and orig is not None:
                setattr(module, key, orig)


def patch_moe_split_sizes() -> None:
    """MoE alltoall dispatcher: ``maybe_move_tensor_to_cpu`` only converts CUDA
    tensors, so on CPU the split sizes stay tensors and gloo's
    ``all_to_all_single`` rejects them. Convert CPU tensors to numpy too."""
    from megatron.core.transformer.moe import moe_utils

    original = _require(moe_utils, "maybe_move_tensor_to_cpu", ("tensor", "as_numpy", "record_stream"))
    if getattr(original, "_megatron_rl_compat", False):
        return

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor):
            tensor = tensor.detach().cpu()
            if as_numpy:
                tensor = tensor.numpy()
        return tensor

    _mark(maybe_move_tensor_to_cpu)
    _rebind_everywhere(original, maybe_move_tensor_to_cpu)


def patch_p2p_shape_exchange() -> None:
    """``P2PCommunicator._communicate_shapes`` (used with ``variable_seq_lengths``,
    i.e. every packed-sequence run) posts one ``batch_isend_irecv`` in the order
    send_prev, recv_prev, send_next, recv_next. With PP=2 both neighbours are the
    same rank, and gloo matches one pair's messages in posting order, so under the
    interleaved (VPP) schedule, which sends and receives in both directions at
    once, the shape messages cross and the next data exchange fails with
    "Received data size doesn't match expected size". Exchange shapes through
    megatron's own parity-ordered ``_p2p_ops`` (what it already uses for the data
    when ``batch_p2p_comm=False``)."""
    from megatron.core.pipeline_parallel import p2p_communication as p2p

    cls = _require(p2p, "P2PCommunicator")
    p2p_ops = _require(p2p, "_p2p_ops", ("tensor_send_prev", "tensor_recv_prev", "tensor_send_next",
                                         "tensor_recv_next", "group", "prev_pipeline_rank", "next_pipeline_rank"))
    original = _require(cls, "_communicate_shapes", ("self", "tensor_send_next", "tensor_send_prev", "recv_prev",
                                                     "recv_next"))
    if getattr(original, "_megatron_rl_compat", False):
        return

    def _communicate_shapes(self, tensor_send_next, tensor_send_prev, recv_prev, recv_next):
        if self.config.use_ring_exchange_p2p:
            return original(self, tensor_send_next, tensor_send_prev, recv_prev, recv_next)

        def shape_of(t):
            return None if t is None else torch.tensor(t.size(), dtype=torch.int64)

        recv_prev_shape = torch.empty(3, dtype=torch.int64) if recv_prev else None
        recv_next_shape = torch.empty(3, dtype=torch.int64) if recv_next else None
        reqs = p2p_ops(tensor_send_prev=shape_of(tensor_send_prev), tensor_recv_prev=recv_prev_shape,
                       tensor_send_next=shape_of(tensor_send_next), tensor_recv_next=recv_next_shape,
                       group=self.pp_group, prev_pipeline_rank=self.prev_rank, next_pipeline_rank=self.next_rank)
        for req in (reqs.values() if isinstance(reqs, dict) else reqs):
            req.wait()
        return ([0, 0, 0] if recv_prev_shape is None else recv_prev_shape.tolist(),
                [0, 0, 0] if recv_next_shape is None else recv_next_shape.tolist())

    _mark(_communicate_shapes)
    cls._communicate_shapes = _communicate_shapes


HYBRID_OPTIMIZER_MODULE = "megatron.core.optimizer.cpu_offloading.hybrid_optimizer"


@contextlib.contextmanager
def _device_tensors_for(module_name: str, device_ids: set[int]):
    """While active, ``t.is_cuda`` read from ``module_name`` is ``id(t) in device_ids``.

    Scoped twice: in time (the property is removed on exit, restoring torch's own
    descriptor) and by caller (every other module still gets torch's answer).
    """
    base = torch._C.TensorBase.is_cuda
    if "is_cuda" in torch.Tensor.__dict__:  # nested: keep the outer scope
        yield
        return

    def is_cuda(t):
        if sys._getframe(1).f_globals.get("__name__") == module_name:
            return id(t) in device_ids
        return base.__get__(t)

    setattr(torch.Tensor, "is_cuda", property(is_cuda))
    try:
        yield
    finally:
        del torch.Tensor.is_cuda


def patch_hybrid_optimizer_devices() -> None:
    """``HybridDeviceOptimizer`` (``--optimizer-cpu-offload``) picks what to offload by
    ``param.is_cuda``. With no GPU every tensor is a CPU tensor: nothing is copied to
    the host, and its CPU sub-optimizer then looks up host copies that do not exist
    (KeyError on the first step). On a CPU host the tensors handed to it (the
    distributed optimizer's shards) play the device: while it splits its parameters,
    ``is_cuda`` asked from its module is True for exactly those. megatron's own code
    then makes the host copies, steps them with its CPU optimizer, copies gradients
    "D2H" and parameters "H2D" (plain copies; streams/events/pinning are the no-op
    shims of ``module_torch``) exactly as on a GPU. Its ``state.to("cuda")`` for the
    non-offloaded part is answered by ``tensor_methods``.
    """
    hybrid = importlib.import_module(HYBRID_OPTIMIZER_MODULE)
    cls = _require(hybrid, "HybridDeviceOptimizer")
    original = _require(cls, "_get_sub_optimizer_param_groups", ("self", "offload_fraction"))
    if getattr(original, "_megatron_rl_compat", False):
        return

    def _get_sub_optimizer_param_groups(self, offload_fraction):
        device_ids = {id(p) for group in self.param_groups for p in group["params"]}
        with _device_tensors_for(HYBRID_OPTIMIZER_MODULE, device_ids):
            return original(self, offload_fraction)

    _mark(_get_sub_optimizer_param_groups)
    cls._get_sub_optimizer_param_groups = _get_sub_optimizer_param_groups


# --------------------------------------------------------------------- any host
def patch_hybrid_optimizer_fp32_shards() -> None:
    """Two gaps of 0.16.1's ``HybridDeviceOptimizer`` (``--optimizer-cpu-offload``) with
    fp32 parameters, on any host:

    * the distributed optimizer hands it fp32 shards as views of the model parameters
      (``model_param.view(-1)[a:b]``, non-leaf tensors); torch's ``add_param_group``
      refuses those ("can't optimize a non-leaf Tensor"; the plain path assigns
      ``param_groups`` directly and never sees the check). ``retain_grad()`` makes torch
      accept them and changes nothing else: the views are not in any forward graph, and
      the distributed optimizer sets their gradients by hand as before;
    * after loading state it copies ``master_param`` into ``param_to_fp32_param[p]`` for
      EVERY parameter, but only non-fp32 parameters have such a copy (KeyError on
      resume). fp32 parameters are skipped: they are their own master weights.
    """
    hybrid = importlib.import_module(HYBRID_OPTIMIZER_MODULE)
    cls = _require(hybrid, "HybridDeviceOptimizer")
    init = _require(cls, "__init__", ("self", "params", "offload_fraction", "cpu_optimizer_cls", "gpu_optimizer_cls",
                                      "param_update_in_fp32", "pin_cpu_grads", "pin_cpu_params",
                                      "overlap_cpu_optimizer_d2h_h2d", "kwargs"))
    _require(cls, "_update_fp32_params_by_new_state", ("self",))  # replaced whole below: only its signature matters
    if getattr(init, "_megatron_rl_compat", False):
        return

    def __init__(self, params, *args, **kwargs):
        params = list(params)
        for group in params:
            for p in (group["params"] if isinstance(group, dict) else [group]):
                if isinstance(p, torch.Tensor) and p.requires_grad and not p.is_leaf and not p.retains_grad:
                    p.retain_grad()
        init(self, params, *args, **kwargs)

    def _update_fp32_params_by_new_state(self):
        if not self.param_update_in_fp32:
            return
        for param, v in self.state.items():
            fp32_param = self.param_to_fp32_param.get(param)
            if fp32_param is not None:
                fp32_param.data.copy_(v["master_param"])

    _mark(__init__, _update_fp32_params_by_new_state)
    cls.__init__ = __init__
    cls._update_fp32_params_by_new_state = _update_fp32_params_by_new_state


def patch_hybrid_optimizer_safe_globals() -> None:
    """``HybridDeviceOptimizer`` keeps its sub-optimizer classes (``cpu_optimizer_cls``,
    ``gpu_optimizer_cls``) in every param group, so they are pickled into a checkpoint's
    ``common.pt``; megatron-core's ``register_safe_globals`` does not list them and the
    ``weights_only`` load of every offloaded checkpoint fails ("Unsupported global:
    torch.optim.adamw.AdamW"). Allow exactly the classes ``get_megatron_optimizer`` can
    put there (torch's AdamW/SGD and whatever Adam/SGD megatron imported: TE, apex or
    torch); unpickling a class reference runs no code."""
    optim = importlib.import_module("megatron.core.optimizer")
    classes: set[type] = {torch.optim.AdamW, torch.optim.SGD, _require(optim, "Adam"), _require(optim, "SGD")}
    ordered = sorted(classes, key=lambda c: f"{c.__module__}.{c.__qualname__}")
    torch.serialization.add_safe_globals([*ordered])  # a new list: the parameter is an invariant list[Callable | tuple]



def thd_rope_positions(cu_seqlens: torch.Tensor, cp_size: int, cp_rank: int, with_offsets: bool) -> torch.Tensor:
    """For every token this CP rank holds of a packed (THD) batch, the row of ``freqs`` megatron's
    ``_get_thd_freqs_on_this_cp_rank`` gives it: its position in its sequence (under CP: in the
    rank's two load-balanced chunks), plus the sequence's start when ``freqs`` covers every
    packed position (``with_offsets``)."""
    full = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    local = full // cp_size
    seq = torch.repeat_interleave(torch.arange(local.numel(), device=local.device), local)
    within = torch.arange(seq.numel(), device=local.device) - (torch.cumsum(local, 0) - local)[seq]
    if cp_size > 1:
        seg = (local // 2)[seq]
        within = torch.where(within < seg, cp_rank * seg + within, full[seq] - (cp_rank + 1) * seg + within - seg)
    return within + cu_seqlens[:-1].long()[seq] if with_offsets else within


def patch_thd_rope_gather() -> None:
    """``_apply_rotary_pos_emb_thd`` (the unfused packed-sequence RoPE) slices ``freqs`` once
    per sequence in a Python loop and concatenates the slices, for q and k of every layer of
    every forward: ~3 tensor ops per sequence (a 256-sample batch: ~13 ms per step on CPU).
    The same rows are gathered here in one indexing op; the values are copies of the same
    ``freqs`` rows, so the result is bitwise the original's (tests/compat/test_thd_rope.py).
    The rows and their cos/sin (megatron's ``_apply_rotary_pos_emb_bshd`` recomputes both per
    call) are derived once per (cu_seqlens, freqs) and reused by q and k of every layer; the
    rotation itself is megatron's expression, op for op."""
    rope_utils = importlib.import_module("megatron.core.models.common.embeddings.rope_utils")
    original = _require(rope_utils, "_apply_rotary_pos_emb_thd", ("t", "cu_seqlens", "freqs", "rotary_interleaved",
                                                                  "multi_latent_attention", "mscale", "cp_group"))
    rotate_half = _require(rope_utils, "_rotate_half", ("x", "rotary_interleaved"))
    if getattr(original, "_megatron_rl_compat", False):
        return
    memo = IdentityMemo()

    def cos_sin(cu_seqlens, freqs, cp_size, cp_rank, mscale, dtype, tokens):
        local = (cu_seqlens[1:] - cu_seqlens[:-1]) // cp_size
        if int(local.sum()) != tokens or (cp_size > 1 and bool((local % 2).any())):
            return None  # shapes megatron's loop would reject or handle differently: let it say so
        with_offsets = freqs.dim() >= 1 and freqs.size(0) == cu_seqlens[-1]
        rows = thd_rope_positions(cu_seqlens, cp_size, cp_rank, bool(with_offsets)).to(freqs.device)
        picked = freqs[rows]
        cos_, sin_ = (torch.cos(picked) * mscale).to(dtype), (torch.sin(picked) * mscale).to(dtype)
        half = sin_.size(-1) // 2  # the length of torch.chunk's second half
        # rotate_half(t) * sin = cat(-t2, t1) * sin = cat(t2, t1) * cat(-sin1, sin2), bit for bit (a
        # negation is exact and commutes with the product's rounding): one op fewer per q/k per layer
        return cos_, sin_, torch.cat((-sin_[..., :half], sin_[..., half:]), dim=-1)

    def _apply_rotary_pos_emb_thd(t, cu_seqlens, freqs, rotary_interleaved=False, multi_latent_attention=False,
                                  mscale=1.0, cp_group=None):
        if cp_group is None:
            return original(t, cu_seqlens, freqs, rotary_interleaved, multi_latent_attention, mscale, cp_group)
        cp_size, cp_rank = cp_group.size(), cp_group.rank()
        rotation = memo.get((cu_seqlens, freqs), (cp_size, cp_rank, mscale, t.dtype, t.size(0)),
                            lambda: cos_sin(cu_seqlens, freqs, cp_size, cp_rank, mscale, t.dtype, t.size(0)))
        if rotation is None:
            return original(t, cu_seqlens, freqs, rotary_interleaved, multi_latent_attention, mscale, cp_group)
        cos_, sin_, signed_sin = rotation
        # megatron's _apply_rotary_pos_emb_bshd on [t, 1, h, d] with the cos/sin above
        rot_dim = freqs.shape[-1]
        t = t.unsqueeze(1)
        t, t_pass = t[..., :rot_dim], t[..., rot_dim:]
        if multi_latent_attention:
            t = torch.cat((t[..., 0::2], t[..., 1::2]), dim=-1)
        if rotary_interleaved:
            t = (t * cos_) + (rotate_half(t, rotary_interleaved) * sin_)
        else:
            first = rot_dim - rot_dim // 2  # torch.chunk's first half (rot_dim is even for RoPE)
            t = (t * cos_) + (torch.cat((t[..., first:], t[..., :first]), dim=-1) * signed_sin)
        if t_pass.numel():
            t = torch.cat((t, t_pass), dim=-1)
        return t.squeeze(1)

    _mark(_apply_rotary_pos_emb_thd, original=original, memo=memo)
    setattr(rope_utils, "_apply_rotary_pos_emb_thd", _apply_rotary_pos_emb_thd)


def patch_tp1_region_identity() -> None:
    """``ColumnParallelLinear`` / ``RowParallelLinear`` wrap their input and output in the TP-region
    autograd Functions (``copy_to_...`` forward copy, backward all-reduce; ``reduce_from_...`` the
    reverse) even when the tensor-parallel group has one rank, where both directions return the
    tensor unchanged (``mappings._reduce`` bypasses a 1-rank group). Each is still a Python autograd
    node: about 20 us forward + 20 us backward per linear layer per micro-batch, ~1% of the CPU
    demo's step. At one rank the tensor is returned as is, with no node; the values and gradients
    are the same tensors (tests/compat/test_tp1_region_identity.py); at more ranks megatron's
    functions run unchanged."""
    layers = importlib.import_module("megatron.core.tensor_parallel.layers")
    mappings = importlib.import_module("megatron.core.tensor_parallel.mappings")
    for name in ("copy_to_tensor_model_parallel_region", "reduce_from_tensor_model_parallel_region"):
        original = _require(layers, name, ("input_", "group"))
        if getattr(original, "_megatron_rl_compat", False):
            continue

        def region(input_, group=None, _original=original):
            tp = group if group is not None else mappings.get_tensor_model_parallel_group_if_none(None)
            if tp is not None and tp.size() == 1:
                return input_
            return _original(input_, group=group)

        _mark(region, original=original)
        region.__name__ = name
        setattr(layers, name, region)


def patch_sp1_reduce_scatter() -> None:
    """``RowParallelLinear`` under sequence parallelism reduce-scatters its output over its TP group even
    when that group has one rank, as an expert's ``linear_fc2`` has with expert-TP 1 and EP 1 beside
    TP > 1 (explicit expert communication is off then). megatron's ``_ReduceScatterToSequenceParallelRegion``
    returns its input as is for one rank, so autograd marks the output a view made inside a custom
    Function, and ``MLP.forward`` adding an expert's fc2 bias in place (``output += output_bias *
    per_token_scale``: experts with biases, as gpt-oss) dies with "a view ... is being modified
    inplace". At one rank the tensor is returned without the Function: the same values and
    gradients (the backward all-gather over one rank is the identity); at more ranks megatron's
    function runs unchanged."""
    layers = importlib.import_module("megatron.core.tensor_parallel.layers")
    mappings = importlib.import_module("megatron.core.tensor_parallel.mappings")
    name = "reduce_scatter_to_sequence_parallel_region"
    original = _require(layers, name, ("input_", "group", "input_split_sizes", "use_global_buffer"))
    if getattr(original, "_megatron_rl_compat", False):
        return

    def reduce_scatter_to_sequence_parallel_region(input_, group=None, input_split_sizes=None,
                                                   use_global_buffer=False):
        tp = mappings.get_tensor_model_parallel_group_if_none(group)
        if tp is not None and tp.size() == 1:
            return input_
        return original(input_, group=group, input_split_sizes=input_split_sizes,
                        use_global_buffer=use_global_buffer)

    _mark(reduce_scatter_to_sequence_parallel_region, original=original)
    setattr(layers, name, reduce_scatter_to_sequence_parallel_region)


def patch_expert_bias_sp() -> None:
    """``RowParallelLinear`` marks its bias ``sequence_parallel`` under sequence parallelism, and
    ``finalize_model_grads`` then sums that gradient over the dense TP group. For an expert's
    ``linear_fc2`` (experts with biases, as gpt-oss) that sum is wrong: the expert's gradient is
    already complete for the tokens dispatched to it (the token dispatcher gathered them over TP),
    and the DDP reduction over the expert data-parallel group combines the rest, so the extra sum
    multiplied the fc2 bias gradient by the TP size (measured at TP2 x EP2 + SP against HF). An
    expert's bias is marked not sequence-parallel; dense layers keep megatron's marking."""
    layers = importlib.import_module("megatron.core.tensor_parallel.layers")
    cls = layers.RowParallelLinear
    original = _require(cls, "__init__", ("self", "input_size", "output_size", "config", "init_method", "bias",
                                           "input_is_parallel", "skip_bias_add", "stride",
                                           "keep_master_weight_for_test", "is_expert", "tp_comm_buffer_name",
                                           "tp_group"))
    if getattr(original, "_megatron_rl_compat", False):
        return

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if getattr(self, "is_expert", False) and getattr(self, "bias", None) is not None:
            self.bias.sequence_parallel = False

    _mark(__init__, original=original)
    cls.__init__ = __init__


class _PlainLinear(torch.autograd.Function):
    """``LinearWithGradAccumulationAndAsyncCommunication`` for the case with no communication and no fused
    weight-gradient accumulation: the same tensor ops in the same order (forward ``matmul(input, weight.t())``
    then ``+ bias``; backward ``grad_output.matmul(weight)``, the wgrad on contiguous 2-D views,
    ``grad_output.sum(0)`` for the bias), without the per-call bookkeeping of the general Function."""

    @staticmethod
    def forward(ctx, input, weight, bias):
        ctx.save_for_backward(input, weight)
        ctx.use_bias = bias is not None
        output = torch.matmul(input, weight.t())
        if bias is not None:
            output = output + bias
        return output

    @staticmethod
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        grad_input = grad_output.matmul(weight)
        grad_output = grad_output.contiguous()  # megatron's prepare_input_tensors_for_wgrad_compute
        total_input = input.contiguous()
        if grad_output.dim() == 3:
            grad_output = grad_output.view(grad_output.shape[0] * grad_output.shape[1], grad_output.shape[2])
            total_input = total_input.view(total_input.shape[0] * total_input.shape[1], total_input.shape[2])
        grad_weight = grad_output.t().matmul(total_input)
        grad_bias = grad_output.sum(dim=0) if ctx.use_bias else None
        return grad_input, grad_weight, grad_bias


def patch_plain_linear() -> None:
    """Every ``ColumnParallelLinear`` / ``RowParallelLinear`` call goes through megatron's general autograd
    Function (sequence parallelism, async all-reduce of the input gradient, deferred and fused
    weight-gradient accumulation), whose Python bookkeeping costs ~40 us per call and as much per
    backward, even when none of that applies, as at one TP rank without sequence parallelism on CPU:
    ~54 calls per step of the CPU demo, ~1.5% of it. When the call asks for none of those features (and
    autocast is off, which megatron's ``custom_fwd`` would record), the same ops run in ``_PlainLinear``
    (under ``no_grad``: the forward's two ops alone); values and gradients are bitwise megatron's
    (tests/compat/test_plain_linear.py); every other call reaches megatron's function unchanged."""
    layers = importlib.import_module("megatron.core.tensor_parallel.layers")
    original = _require(layers, "linear_with_grad_accumulation_and_async_allreduce", (
        "input", "weight", "bias", "gradient_accumulation_fusion", "allreduce_dgrad", "sequence_parallel",
        "grad_output_buffer", "wgrad_deferral_limit", "async_grad_allreduce", "tp_group"))
    if getattr(original, "_megatron_rl_compat", False):
        return

    def linear_with_grad_accumulation_and_async_allreduce(input, weight, bias, gradient_accumulation_fusion,
                                                          allreduce_dgrad, sequence_parallel, grad_output_buffer=None,
                                                          wgrad_deferral_limit=0, async_grad_allreduce=None,
                                                          tp_group=None):
        if (gradient_accumulation_fusion or allreduce_dgrad or sequence_parallel or grad_output_buffer is not None
                or async_grad_allreduce is not None or torch.is_autocast_enabled("cuda")
                or torch.is_autocast_enabled("cpu")):
            return original(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
                            grad_output_buffer, wgrad_deferral_limit, async_grad_allreduce, tp_group)
        if not torch.is_grad_enabled():
            output = torch.matmul(input, weight.t())
            return output + bias if bias is not None else output
        return _PlainLinear.apply(input, weight, bias)

    _mark(linear_with_grad_accumulation_and_async_allreduce, original=original,
          warned=getattr(original, "warned", False))
    setattr(layers, "linear_with_grad_accumulation_and_async_allreduce",
            linear_with_grad_accumulation_and_async_allreduce)


# ------------------------------------------------------------------------ no-TE
def patch_router_gemm() -> None:
    """``moe_utils.te_general_gemm`` is only defined when transformer-engine
    imports; the router's fp32 gemm then dies with NameError. Define it as None
    so the router takes its torch matmul path."""
    from megatron.core.transformer.moe import moe_utils

    if "te_general_gemm" not in vars(moe_utils):
        moe_utils.te_general_gemm = None


def patch_mla_have_te() -> None:
    """``multi_latent_attention`` sets ``HAVE_TE`` from an import of megatron's TE extension, which
    succeeds without transformer-engine (its classes are placeholders), so ``MLASelfAttention``'s
    ``isinstance(self.linear_proj, TELinear)`` raises TypeError. Without TE there is no TE layer:
    answer ``HAVE_TE = False`` there, as megatron does when the import fails."""
    from megatron.core.transformer import multi_latent_attention

    _require(multi_latent_attention, "HAVE_TE")
    multi_latent_attention.HAVE_TE = False


def patch_te_min_version() -> None:
    """``is_te_min_version`` compares ``None >= Version`` (TypeError) when transformer-engine
    is missing; ``OptimizerConfig.__post_init__`` calls it for every
    ``use_precision_aware_optimizer`` config (to decide TE's ``store_param_remainders``).
    In the optimizer modules it answers False without TE: the minimum TE is not installed."""
    from megatron.core import utils
    from megatron.core.optimizer import optimizer_config

    original = _require(utils, "is_te_min_version", ("version", "check_equality"))
    if getattr(original, "_megatron_rl_compat", False):
        return

    def is_te_min_version(version, check_equality=True):
        if utils.get_te_version() is None:
            return False
        return original(version, check_equality)

    _mark(is_te_min_version)
    for module in (optimizer_config, importlib.import_module("megatron.core.optimizer")):
        if getattr(module, "is_te_min_version", None) is original:
            setattr(module, "is_te_min_version", is_te_min_version)


CPU_PATCHES: tuple[Patch, ...] = (
    Patch("module_torch", "torch.cuda.* / device='cuda' / pin_memory at allocation, "
          "stream, event, nvtx and synchronize sites", patch_module_torch),
    Patch("tensor_methods", "Tensor.cuda(), Tensor.pin_memory(), Tensor.type()=='torch.cuda.*' "
          "checks in optimizer / clip_grads", patch_tensor_methods),
    Patch("rng_tracker", "CudaRNGStatesTracker and model_parallel_cuda_manual_seed use CUDA "
          "generator state", patch_rng_tracker),
    Patch("jit_fuser", "jit_fuser = torch.compile (slow dynamo tracing on CPU)", patch_jit_fuser),
    Patch("moe_split_sizes", "MoE alltoall split sizes stay tensors on CPU; gloo "
          "all_to_all_single rejects them", patch_moe_split_sizes),
    Patch("hybrid_optimizer_devices", "HybridDeviceOptimizer (--optimizer-cpu-offload) offloads only "
          "tensors with is_cuda; on CPU it copied nothing and failed at its first step",
          patch_hybrid_optimizer_devices),
    Patch("p2p_shape_exchange", "batched shape exchange crosses messages between the two "
          "directions of one rank pair under gloo (PP=2 with VPP)", patch_p2p_shape_exchange),
)

ANY_HOST_PATCHES: tuple[Patch, ...] = (
    Patch("hybrid_optimizer_fp32_shards", "HybridDeviceOptimizer refuses the distributed optimizer's "
          "non-leaf fp32 shard views and KeyErrors on resume with fp32 params",
          patch_hybrid_optimizer_fp32_shards),
    Patch("hybrid_optimizer_safe_globals", "checkpoints of HybridDeviceOptimizer pickle its sub-optimizer "
          "classes, which megatron's weights_only safe-globals list lacks", patch_hybrid_optimizer_safe_globals),
    Patch("sp1_reduce_scatter", "RowParallelLinear's sequence-parallel reduce-scatter over a 1-rank group "
          "(an expert's fc2 at expert-TP 1, EP 1, TP > 1) returns a view that MLP.forward's in-place expert "
          "fc2 bias add refuses", patch_sp1_reduce_scatter),
    Patch("expert_bias_sp", "an expert linear_fc2 bias is marked sequence_parallel, so finalize_model_grads "
          "sums its already complete gradient over TP once more", patch_expert_bias_sp),
)

# Speed only, measured on CPU (the CPU demo's step); on a GPU megatron's own code runs: these never ran there.
CPU_SPEED_PATCHES: tuple[Patch, ...] = (
    Patch("thd_rope_gather", "the unfused packed-sequence RoPE slices freqs in a Python loop per sequence "
          "(q and k, every layer, every forward); one gather gives the same rows", patch_thd_rope_gather,
          speed_only=True),
    Patch("tp1_region_identity", "the TP-region autograd Functions around every linear layer run even for a "
          "1-rank tensor-parallel group, where they return their input unchanged", patch_tp1_region_identity,
          speed_only=True),
    Patch("plain_linear", "every linear layer call goes through megatron's general communicating autograd "
          "Function even when it asks for no communication or fused gradient accumulation", patch_plain_linear,
          speed_only=True),
)

NO_TE_PATCHES: tuple[Patch, ...] = (
    Patch("router_gemm", "moe_utils.te_general_gemm undefined without transformer-engine",
          patch_router_gemm),
    Patch("te_min_version", "is_te_min_version raises TypeError without transformer-engine "
          "(OptimizerConfig with use_precision_aware_optimizer)", patch_te_min_version),
    Patch("mla_have_te", "MLASelfAttention isinstance-checks a TE placeholder (TypeError) without "
          "transformer-engine", patch_mla_have_te),
)


def run_patches(patches, applied: dict[str, str]) -> None:
    """Apply ``patches`` in order, recording each outcome in ``applied``.

    Values: ``"applied"`` or ``"skipped: <reason>"``. Patches are individually
    idempotent, so re-running (e.g. after more megatron modules were imported)
    only reaches the new modules. A target that moved or changed its signature
    raises on the version we target, except for a speed-only patch, which is
    skipped with a warning on any version.
    """
    from megatron.core import package_info

    version = package_info.__version__
    for patch in patches:
        try:
            patch.apply()
            applied[patch.name] = "applied"
        except (TargetMoved, ImportError) as exc:
            if version.startswith(SUPPORTED_VERSION_PREFIX) and not patch.speed_only:
                raise  # on the version we target a moved target is a bug here
            what = f"{type(exc).__name__}: {exc}" if isinstance(exc, SignatureChanged) else f"target {exc} not found"
            warnings.warn(f"megatron_rl.compat: patch {patch.name!r} ({patch.answers}) skipped on "
                          f"megatron-core {version}: {what}", RuntimeWarning, stacklevel=2)
            applied[patch.name] = f"skipped: {what}"

"""Checkpoint conversion between HF safetensors and megatron-core torch_dist, and fsdp checkpoints to HF.

* :func:`megatron_rl.convert.hf_to_dist.convert_hf_to_dist` - HF dir -> torch_dist
  dir (model sharded state dict exactly as ``GPTModel.sharded_state_dict()``
  writes it, so training can load it and a training checkpoint's model part can
  be exported back);
* :func:`megatron_rl.convert.dist_to_hf.convert_dist_to_hf` - torch_dist dir (ours
  or a training ``iter_NNNNNNN`` dir) -> HF dir (config, tokenizer files,
  ``--max-shard-size`` safetensors shards with ``model.safetensors.index.json``);
* :func:`megatron_rl.convert.fsdp_to_hf.convert_fsdp_to_hf` - a ``--train-backend fsdp``
  checkpoint (DCP, read offline by :mod:`megatron_rl.convert.dcp_model`) -> HF dir, in
  one process and without megatron-core;
* :class:`megatron_rl.convert.safetensors_writer.ShardedSafetensorsWriter` -
  writes HF shards as tensors stream in (one shard in memory at a time);
* the byte paths both directions share: :mod:`~megatron_rl.convert.file_writer` (output
  files filled through a pipe, CRC-32 as written), :mod:`~megatron_rl.convert.mapped_checkpoint`
  (HF tensors as views of the files' pages), :mod:`~megatron_rl.convert.distcp_reader`
  (torch_dist chunks read from mapped pages).

The torch_dist conversions run in one process or under torchrun with a parallel layout;
the name/shape maps and the load/export code are the bridges' own
(:mod:`megatron_rl.models`), never a second copy. CLI: ``tools/convert_ckpt.py``;
guide and measured figures: ``docs/convert.md``.

Layering: this package builds on the core (:mod:`megatron_rl.models.model_dir`,
:mod:`megatron_rl.models.dist_io`, :mod:`megatron_rl.models.parallel`,
:mod:`megatron_rl.models.hf_module` for the fsdp format), ``infra`` (publication,
rank helpers) and ``errors``; training reads the same dirs through the core, so nothing
outside ``convert/`` imports it and it imports no backend.
"""

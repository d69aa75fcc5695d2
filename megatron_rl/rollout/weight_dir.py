"""Versioned HF safetensors directories: how weights travel by disk (``--update-weight-transport disk``).

``VersionedWeightDir(root)`` publishes one update as ``<root>/v<version>/`` holding
``model.safetensors`` (+ ``config.json`` / ``generation_config.json`` copied from the HF
checkpoint, so an SGLang server can load the dir as a model). With ``shard_bytes`` the tensors
are written as they arrive, one shard file per ``shard_bytes`` (HF's sharded layout:
``model-00001-of-0000N.safetensors`` + ``model.safetensors.index.json``), so the writer holds one
shard, not the whole model, in host memory; tensors an engine loads together (``models.fused_loads``)
share a shard; a single shard keeps the one-file name. A version is written under a
hidden temporary name (``.v<version>.*.tmp``) and renamed into place only when complete
(``infra.atomic.publish_dir``), so a reader never sees a half-written version; a failure
while writing removes the temporary dir and publishes nothing. ``prune`` keeps the newest
``keep_versions`` up to the one just loaded.

The one writer of such dirs: the disk transport (``weight_sync.disk``) and
``SGLangEngine.update_weights`` both call it.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from typing import Any, Callable, Iterable, Optional

from megatron_rl.errors import ConfigError, SyncError
from megatron_rl.infra.atomic import publish_dir
from megatron_rl.models.fused_loads import load_units

CONFIG_FILES = ("config.json", "generation_config.json")
_VERSION = re.compile(r"^v(\d+)$")


ADAPTER_BASE_DIR = "base"  # a --lora-sync adapter version's base weights (the first sync's), beside the PEFT files

class VersionedWeightDir:
    """``<root>/v<version>/`` dirs of HF safetensors, published atomically, pruned to ``keep_versions``."""

    def __init__(self, root: Optional[str], *, hf_checkpoint: Optional[str] = None, keep_versions: int = 2):
        if not root:
            raise ConfigError("weights on disk need a directory (--update-weight-disk-dir DIR, readable by "
                              "every server that loads them)")
        if keep_versions < 1:
            raise ConfigError(f"keep_versions={keep_versions}: keep at least the loaded version (1)")
        self.root = os.path.abspath(root)
        self.hf_checkpoint = hf_checkpoint
        self.keep_versions = keep_versions

    def path(self, version: int) -> str:
        return os.path.join(self.root, f"v{int(version)}")

    def versions(self) -> list[int]:
        """Published versions, ascending (temporary dirs are not versions)."""
        if not os.path.isdir(self.root):
            return []
        return sorted(int(m.group(1)) for m in map(_VERSION.match, os.listdir(self.root)) if m)

    def write(self, named_tensors: Iterable[tuple[str, Any]], version: int,
              shard_bytes: Optional[int] = None, adapter: Any = None,
              extra_files: Optional[Callable[[], dict[str, str]]] = None) -> str:
        """Publish ``v<version>`` (model.safetensors, or shards of ``shard_bytes`` + index, and the config
        files) atomically; return its path.

        ``adapter`` (``--lora-sync adapter``: a ``models.peft_adapter.AdapterExport``): the version is a PEFT dir,
        ``adapter_model.safetensors`` + ``adapter_config.json``, with ``named_tensors`` (the base weights, sent
        with the first adapter only; may be empty) in its subdir ``base`` (``ADAPTER_BASE_DIR``): SGLang's
        ``/load_lora_adapter`` reads every safetensors file of the dir it is given, and dies on a base weight.
        ``extra_files``: called once the tensors are written, file name -> text written beside them in the same
        version (``--update-weight-mode delta``: the delta's ``delta.json``; such a version may hold no tensor).
        Consumes ``named_tensors`` to the end unless it fails; on any error nothing is published.
        """
        import torch  # lazy: importing this module (SGLang's engine does) needs no torch
        from safetensors.torch import save_file

        final = self.path(version)
        os.makedirs(self.root, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".v{int(version)}.", suffix=".tmp", dir=self.root)
        try:
            shard: dict[str, Any] = {}
            storages: set[int] = set()  # of the shard's tensors
            shard_size = total = 0
            shards: list[list[str]] = []  # tensor names per shard file written, in order
            names: set[str] = set()

            def flush() -> None:
                nonlocal shard, shard_size
                save_file(shard, os.path.join(tmp, f".shard-{len(shards):05d}"), metadata={"format": "pt"})
                shards.append(list(shard))
                shard, shard_size = {}, 0
                storages.clear()

            # whole load units (models.fused_loads): a shard file never splits tensors the engine fuses
            for unit in load_units(named_tensors):
                cpu = []
                for name, tensor in unit:
                    if name in names:
                        raise SyncError(f"weight update to version {version} sends {name!r} twice; each HF "
                                        "tensor once")
                    names.add(name)
                    cpu.append((name, torch.as_tensor(tensor).detach().to("cpu").contiguous()))
                nbytes = sum(t.numel() * t.element_size() for _, t in cpu)
                if shard and shard_bytes and shard_size + nbytes > shard_bytes:
                    flush()
                for name, t in cpu:
                    if t.untyped_storage().data_ptr() in storages:
                        t = t.clone()  # tied weights share storage: safetensors refuses shared tensors in one file
                    storages.add(t.untyped_storage().data_ptr())
                    shard[name] = t
                shard_size += nbytes
                total += nbytes
            if not names and adapter is None and extra_files is None:
                raise SyncError(f"weight update to version {version} carries no tensors")
            if shard:
                flush()
            model_dir = tmp
            if shards and adapter is not None:  # the base apart: SGLang's LoRA loader reads every file of its dir
                model_dir = os.path.join(tmp, ADAPTER_BASE_DIR)
                os.mkdir(model_dir)
                for i in range(len(shards)):
                    os.rename(os.path.join(tmp, f".shard-{i:05d}"), os.path.join(model_dir, f".shard-{i:05d}"))
            if shards:
                self._name_shards(model_dir, shards, total)
            if adapter is not None:
                adapter.save(tmp, base_model=self.hf_checkpoint or "")
            for fname, text in (extra_files() if extra_files is not None else {}).items():
                with open(os.path.join(tmp, fname), "w") as fh:
                    fh.write(text)
            if self.hf_checkpoint:
                for fname in CONFIG_FILES:
                    src = os.path.join(self.hf_checkpoint, fname)
                    if os.path.exists(src):
                        shutil.copyfile(src, os.path.join(tmp, fname))
                        if model_dir != tmp:
                            shutil.copyfile(src, os.path.join(model_dir, fname))
            publish_dir(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return final

    @staticmethod
    def _name_shards(tmp: str, shards: list[list[str]], total: int) -> None:
        """One shard: ``model.safetensors``. Several: HF's ``model-0000i-of-0000N.safetensors`` and
        ``model.safetensors.index.json`` (what SGLang's and transformers' loaders read)."""
        import json

        if len(shards) == 1:
            os.rename(os.path.join(tmp, ".shard-00000"), os.path.join(tmp, "model.safetensors"))
            return
        weight_map = {}
        for i, names in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            os.rename(os.path.join(tmp, f".shard-{i:05d}"), os.path.join(tmp, fname))
            weight_map.update({n: fname for n in names})
        with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as fh:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh, indent=1)

    def prune(self, current: int) -> None:
        """Keep ``v<current>`` and the newest ``keep_versions - 1`` below it; delete every other version
        (those above ``current`` are left from a run that went further before a resume)."""
        older = [v for v in self.versions() if v < current][::-1][:self.keep_versions - 1]
        for v in self.versions():
            if v != current and v not in older:
                shutil.rmtree(self.path(v), ignore_errors=True)

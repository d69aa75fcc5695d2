"""The host-local checkpoint that lets ``--update-weight-mode delta`` reach SGLang servers.

SGLang 0.5.23 cannot patch its weights in place; what it can do is load a directory of safetensors with
``/update_weights_from_disk``, replacing exactly the tensors in it. So the patch is applied on the engine's
host: :class:`HostCheckpoint` keeps, beside the server, the weights the server holds (in the server's dtype,
stamped with their version), applies each delta version the disk transport publishes (``rollout.weight_delta``:
``delta.json`` naming its base version, sparse ``xor`` / ``overwrite`` patches or dense tensors) to those
weights, and writes the tensors that changed, whole, into a patch directory the server then loads.

Layout under ``root``:

* ``state-v<N>/``: the weights at version N, as hard links to safetensors files (a full sync's files, then the
  patch files that superseded some of their tensors) and ``state.json`` (the version and, per tensor, the file
  that holds its current value). Built under a hidden temporary name and renamed into place complete
  (``infra.atomic.publish_dir``): after a crash the newest ``state-v*`` is a whole, consistent version, and
  temporary dirs are removed when the checkpoint is opened again. Older states are deleted once a newer one is
  in place (their files live on through the links the new state holds).
* ``patches/v<N>/``: the tensors version N changed, whole, in HF safetensors with the model's config files
  (``rollout.weight_dir.VersionedWeightDir``: written under a temporary name, renamed complete, the newest two
  kept). Only such a complete directory is ever named to a server.

Invariants: a delta whose base is not the state's version is refused (``DeltaBaseMismatch``) before anything is
written; each patched tensor is checked against the checksum the delta carries (when it carries one) before it is
written, and a mismatch (a patch applied onto other bits than its base) publishes nothing. The state moves to N
only once the patch dir of N is complete.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import shutil
import tempfile
from typing import Any, Iterator, Optional

from megatron_rl.errors import SyncError
from megatron_rl.infra.atomic import publish_dir
from megatron_rl.rollout.weight_delta import DeltaBaseMismatch, WeightChecksumMismatch, read_delta_dir, tensor_checksum
from megatron_rl.rollout.weight_dir import VersionedWeightDir

log = logging.getLogger(__name__)

STATE_FILE = "state.json"
_STATE = re.compile(r"^state-v(\d+)$")
PATCH_FILE = "patch.json"  # in each patch dir: its base version and the tensors it replaces


def safetensors_files(path: str) -> list[str]:
    """The safetensors files a loader reads from ``path``: those its ``model.safetensors.index.json`` lists,
    else every ``*.safetensors`` (SGLang's rule)."""
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    index = os.path.join(path, "model.safetensors.index.json")
    if files and os.path.isfile(index):
        with open(index) as fh:
            listed = {os.path.join(path, f) for f in json.load(fh)["weight_map"].values()}
        files = [f for f in files if f in listed]
    return files


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another filesystem, or links not allowed: a copy (the same bytes, more disk)
        shutil.copyfile(src, dst)


class HostCheckpoint:
    """The weights one host's SGLang servers hold, kept as safetensors to patch (see the module docstring)."""

    def __init__(self, root: str, *, hf_checkpoint: Optional[str] = None, shard_bytes: Optional[int] = None):
        self.root = os.path.abspath(root)
        self.shard_bytes = shard_bytes
        self.patches = VersionedWeightDir(os.path.join(self.root, "patches"), hf_checkpoint=hf_checkpoint)
        os.makedirs(self.root, exist_ok=True)
        self.version: Optional[int] = None  # the version the newest complete state holds (None: none yet)
        self._files: dict[str, str] = {}  # tensor name -> file name in the state dir
        self._recover()

    # ---------------------------------------------------------------- state
    def state_dir(self, version: int) -> str:
        return os.path.join(self.root, f"state-v{int(version)}")

    def _states(self) -> list[int]:
        return sorted(int(m.group(1)) for m in map(_STATE.match, os.listdir(self.root)) if m)

    def _recover(self) -> None:
        """Open what a previous process left: temporary dirs (a write it never finished) are removed, the newest
        complete state is the checkpoint's."""
        for name in os.listdir(self.root):
            if name.startswith(".state-v") and name.endswith(".tmp"):
                shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
        for version in reversed(self._states()):
            try:
                with open(os.path.join(self.state_dir(version), STATE_FILE)) as fh:
                    raw = json.load(fh)
                self.version, self._files = int(raw["version"]), dict(raw["tensors"])
                return
            except (OSError, ValueError, KeyError, TypeError) as e:
                log.warning("host checkpoint %s: ignoring %s (%s)", self.root, self.state_dir(version), e)

    def _publish_state(self, version: int, files: dict[str, str], sources: dict[str, str]) -> None:
        """``state-v<version>``: ``sources`` (file name in the new state -> path to link) and ``state.json``,
        renamed into place complete; older states deleted after."""
        tmp = tempfile.mkdtemp(prefix=f".state-v{int(version)}.", suffix=".tmp", dir=self.root)
        try:
            for fname, src in sources.items():
                _link_or_copy(src, os.path.join(tmp, fname))
            with open(os.path.join(tmp, STATE_FILE), "w") as fh:
                json.dump({"version": int(version), "tensors": files}, fh, indent=1)
            publish_dir(tmp, self.state_dir(version))
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self.version, self._files = int(version), files
        for older in self._states():
            if older != version:
                shutil.rmtree(self.state_dir(older), ignore_errors=True)

    def forget(self) -> None:
        """No usable state (the server's weights are not the state's): the next delta is refused until a full
        sync is adopted."""
        self.version, self._files = None, {}

    # ------------------------------------------------------------ the syncs
    def adopt_full(self, path: str, version: int) -> None:
        """After the server loaded the full version ``path``: its files become the state of ``version`` (linked,
        not rewritten)."""
        from safetensors import safe_open

        files: dict[str, str] = {}
        sources: dict[str, str] = {}
        for src in safetensors_files(path):
            fname = f"v{int(version)}-{os.path.basename(src)}"
            sources[fname] = src
            with safe_open(src, framework="pt") as st:
                files.update({name: fname for name in st.keys()})
        if not files:
            raise SyncError(f"host checkpoint: the full version {version} in {path} holds no safetensors")
        self._publish_state(version, files, sources)

    def patch(self, delta_dir: str) -> tuple[str, list[str]]:
        """Apply the delta version ``delta_dir`` to the state; return the complete patch dir the server loads and
        the tensors in it (none: nothing changed, and no dir: the server only moves its version)."""
        from safetensors import safe_open

        header, deltas = read_delta_dir(delta_dir)
        if self.version is None or header.base_version != self.version:
            held = "no version (no full sync adopted yet)" if self.version is None else f"version {self.version}"
            raise DeltaBaseMismatch(f"the delta to version {header.version} ({delta_dir}) is based on version "
                                    f"{header.base_version}, but the host checkpoint in {self.root} holds {held}; "
                                    "it needs a full sync")
        state = self.state_dir(self.version)
        opened: dict[str, Any] = {}
        changed: list[str] = []

        def base(name: str) -> Any:
            if name not in self._files:
                raise SyncError(f"delta version {header.version}: {name} is not in the host checkpoint "
                                f"{state} (version {self.version}); the delta is of another model")
            fname = self._files[name]
            if fname not in opened:
                opened[fname] = safe_open(os.path.join(state, fname), framework="pt")
            return opened[fname].get_tensor(name).clone()  # never written through to the (linked) file

        def patched() -> Iterator[tuple[str, Any]]:
            for d in deltas:
                tensor = base(d.name)
                d.apply_to(tensor)
                if d.checksum and d.checksum_algorithm:
                    got = tensor_checksum(tensor, d.checksum_algorithm)
                    if got != d.checksum:
                        raise WeightChecksumMismatch(
                            f"delta version {header.version}: {d.name} patched onto the host checkpoint's version "
                            f"{self.version} has {d.checksum_algorithm} {got}, the trainer's is {d.checksum}: the "
                            "base bits differ from the trainer's; nothing was loaded, the next sync is full")
                changed.append(d.name)
                yield d.name, tensor

        if not header.kinds:
            patch_dir = ""
        else:
            patch_dir = self.patches.write(
                patched(), header.version, shard_bytes=self.shard_bytes,
                extra_files=lambda: {PATCH_FILE: json.dumps({"base_version": header.base_version,
                                                             "version": header.version, "tensors": changed})})
        files = dict(self._files)
        sources = {f: os.path.join(state, f) for f in set(files.values())}
        if patch_dir:
            for src in safetensors_files(patch_dir):
                fname = f"v{header.version}-{os.path.basename(src)}"
                with safe_open(src, framework="pt") as st:
                    files.update({name: fname for name in st.keys()})
                sources[fname] = src
        used = set(files.values())
        self._publish_state(header.version, files, {f: s for f, s in sources.items() if f in used})
        if patch_dir:
            self.patches.prune(header.version)
        return patch_dir, changed

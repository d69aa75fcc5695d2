"""An optional package that is installed but raises on import (or whose start-up call fails) is a
ConfigError naming the package and the flag that asked for it (it was a traceback)."""

from __future__ import annotations

import sys

import pytest

from megatron_rl.errors import ConfigError
from megatron_rl.infra.tracking import Tracker


def _broken_package(monkeypatch, tmp_path, name, body="raise RuntimeError('broken on purpose')\n"):
    pkg = tmp_path / "pkgs" / name
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path / "pkgs"))
    _forget(monkeypatch, name)


def _forget(monkeypatch, name):
    """Drop ``name`` (and submodules) from sys.modules for this test; afterwards the real entries
    come back and the fake ones go (setitem records the original, or its absence, for undo)."""
    for mod in {name, *(m for m in sys.modules if m.startswith(name + "."))}:
        monkeypatch.setitem(sys.modules, mod, None)
        del sys.modules[mod]


def test_wandb_raising_on_import_names_package_and_flag(monkeypatch, tmp_path):
    _broken_package(monkeypatch, tmp_path, "wandb")
    with pytest.raises(ConfigError, match=r"--wandb-project p needs the wandb package, which is installed but fails "
                                          r"to import \(RuntimeError: broken on purpose\); .* or drop --wandb-project"):
        Tracker(str(tmp_path / "run"), wandb_project="p", wandb_mode="offline")


def test_wandb_init_failing_is_a_config_error(monkeypatch, tmp_path):
    _broken_package(monkeypatch, tmp_path, "wandb", "def init(**kw):\n    raise ValueError('no API key')\n")
    with pytest.raises(ConfigError, match=r"--wandb-project p: wandb.init failed \(ValueError: no API key\); .*"
                                          "--wandb-mode offline"):
        Tracker(str(tmp_path / "run"), wandb_project="p")


def test_tensorboard_raising_on_import_names_package_and_flag(monkeypatch, tmp_path):
    _broken_package(monkeypatch, tmp_path, "tensorboard")
    _forget(monkeypatch, "torch.utils.tensorboard")
    with pytest.raises(ConfigError, match=r"--tensorboard-dir .*tb needs the tensorboard package, which is installed "
                                          r"but fails to import \(RuntimeError: broken on purpose\)"):
        Tracker(str(tmp_path / "run"), tensorboard_dir=str(tmp_path / "tb"))

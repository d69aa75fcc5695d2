"""Ctrl-C at any point of tools/convert_ckpt.py: one line on stderr, exit 130, no traceback, nothing written.

Mid-conversion: tests/convert/test_convert.py (a pause point in the publish). Here the two moments before
it: while torch is imported (it used to print one line, then re-import torch in the clean-up: a traceback,
exit 1) and while the tool's own first imports run. Each is reached by a module that announces itself
(a marker file) and blocks, put first on PYTHONPATH: the signal arrives at that state, not after a sleep.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from _util import REPO

TOOL = os.path.join(REPO, "tools", "convert_ckpt.py")
BLOCKING_IMPORT = """\
import os, time
open(os.environ["IMPORT_MARKER"], "w").close()
time.sleep(600)  # an import that takes long: the Ctrl-C arrives in it
"""


def _interrupt_during_import(tmp_path, module: str) -> tuple[int, str]:
    fake = tmp_path / "site" / module
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(BLOCKING_IMPORT)
    marker = tmp_path / f"importing_{module}"
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site"), "IMPORT_MARKER": str(marker)}
    proc = subprocess.Popen([sys.executable, TOOL, "hf-to-dist", "--input", str(tmp_path / "in"), "--output",
                             str(tmp_path / "out")], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.monotonic() + 120  # a hang bound on python's start-up only
        while not marker.exists():
            assert proc.poll() is None, f"exited ({proc.returncode}) before importing {module}: {proc.stderr.read()}"
            assert time.monotonic() < deadline, f"hung: {module} was not imported within 120 s"
            time.sleep(0.01)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)  # a hang bound: the clean-up must not import torch again
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, err


def test_ctrl_c_while_torch_is_imported_exits_130_with_one_line(tmp_path):
    rc, err = _interrupt_during_import(tmp_path, "torch")
    out = tmp_path / "out"
    assert (rc, err) == (130, f"convert_ckpt.py hf-to-dist: interrupted; --output {out} was not written or changed "
                              "(the partial temp dir was removed)\n")
    assert not out.exists() and not (tmp_path / ".out.tmp").exists()


def test_ctrl_c_while_the_tool_starts_exits_130_with_one_line(tmp_path):
    rc, err = _interrupt_during_import(tmp_path, "json")  # the tool's own first imports (json: stdlib, shadowed)
    assert (rc, err) == (130, "convert_ckpt.py: interrupted while starting; nothing was written\n")
    assert not (tmp_path / "out").exists()

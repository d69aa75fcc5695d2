"""What each rank of a test's torchrun launch runs: the worker script given as ``argv[1]``, then an end
without the interpreter's finalization.

Why: a rank can abort at interpreter exit ("terminate called without an active exception", SIGABRT) after
its work was done and its results written, when a gloo worker thread that drops the last reference to a
finished collective's tensors takes the GIL in finalization (a known teardown race of torch's gloo).
torchrun then reports the whole launch failed. So, after the script returns (or exits 0) on every rank:
a barrier (no rank closes its sockets while a peer still reads the last collective), the default group
destroyed, the streams flushed, ``os._exit(0)``. A script that raises or exits non-zero ends as it would
alone: the traceback and the exit code are torchrun's report.
"""

import os
import runpy
import sys


def main() -> None:
    script = os.path.abspath(sys.argv[1])
    sys.argv = [script, *sys.argv[2:]]
    sys.path[0] = os.path.dirname(script)  # as `python script.py` puts it: its sibling modules import
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

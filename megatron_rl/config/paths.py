"""Path checks shared by the validation rules (``validate.py``, ``rollout_rules.py``): stdlib only."""

from __future__ import annotations

import os
import stat


def within(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip(os.sep) + os.sep)


def dir_problem(path: str) -> str | None:
    """Why ``path`` cannot be used (created if absent, then written) as a directory, or None.

    Found here instead of at the first save or log line, where it used to surface after a save
    interval of work, or as a PermissionError / FileExistsError traceback.
    """
    if os.path.isdir(path):
        return None if os.access(path, os.W_OK | os.X_OK) else "is a directory this user cannot write to"
    if os.path.lexists(path):
        return "is a dangling symlink" if os.path.islink(path) else "exists and is not a directory"
    base = os.path.abspath(path)
    while not os.path.lexists(base) and os.path.dirname(base) != base:
        base = os.path.dirname(base)
    if not os.path.isdir(base):
        return f"cannot be created: {base} is a file, not a directory"
    if not os.access(base, os.W_OK | os.X_OK):
        return f"cannot be created: {base} is not writable by this user"
    return None


def file_problem(path: str, read_more_than_once: str = "") -> str | None:
    """Why ``path`` is not a regular file to read, in words after the path, or None.

    Was: every case read "no such file", a FIFO too (``--prompt-data <(...)``, ``mkfifo``): the file was
    there, only not regular. ``read_more_than_once``: why a pipe cannot serve (what reads it again)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        if os.path.islink(path):
            return f"is a dangling symlink (to {os.readlink(path)})"
        return "no such file"
    except OSError as exc:
        return f"cannot be examined ({exc.strerror})"
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return "is a directory, not a file"
    kind = ("a FIFO (named pipe)" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else
            "a character device" if stat.S_ISCHR(mode) else "a block device" if stat.S_ISBLK(mode) else
            "not a regular file")
    why = f": {read_more_than_once}, which a pipe cannot give" if read_more_than_once else ""
    return f"is {kind}, not a regular file{why}; write its content to a file first (cat {path} > FILE.jsonl)"


#: why a prompt file must be a regular file (``file_problem``'s ``read_more_than_once``)
PROMPTS_READ_TWICE = ("the prompts are read more than once (checked before the run starts, then loaded, and "
                      "again each epoch)")

"""Path checks shared by the validation rules (``validate.py``, ``rollout_rules.py``): stdlib only."""

from __future__ import annotations

import os


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

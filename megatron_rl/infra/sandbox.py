"""A local sandbox for code a model wrote: one program in fresh Linux namespaces under resource limits.

Why local and why namespaces: code and shell tools and code rewards run model output, which may loop, fork,
allocate, print or write without end, or reach for the network and the host's secrets; peers send it to a
sandbox service (E2B, Daytona, Modal), and a training machine here has no network to one. So each call is
``setpriv`` (to ``nobody`` when the caller is root) + ``unshare --user --map-root-user --net --pid --fork
--kill-child --mount --mount-proc`` + ``sandbox_init.py`` as the namespaces' PID 1 (its docstring: how it
seals the file system, drops every capability and sets the limits), then the program. What that gives,
each named in the result (``SandboxResult.contained``) when the program runs into it:

======================  ====================================================================================
``wall_time``           the call's wall-clock bound (``--sandbox-wall-seconds``): the process group is
                        killed, and with the namespace's PID 1 every process inside it
``cpu_time``            ``RLIMIT_CPU`` (``--sandbox-cpu-seconds``): SIGXCPU, then SIGKILL a second later
``output``              more than ``--sandbox-output-bytes`` of stdout + stderr: killed, the first bytes kept
``memory``              ``RLIMIT_AS`` (``--sandbox-memory-mb``): allocations fail (Python: ``MemoryError``)
``file_size``           ``RLIMIT_FSIZE`` (``--sandbox-file-size-mb``): a longer write fails (``EFBIG``)
``disk``                the work directory is a tmpfs of ``--sandbox-disk-mb``: ``ENOSPC``
``processes``           ``RLIMIT_NPROC`` (``--sandbox-processes``), counted in the sandbox's own user
                        namespace: a fork bomb's forks fail (``EAGAIN``), a root caller included
``open_files``          ``RLIMIT_NOFILE`` (``--sandbox-open-files``): ``EMFILE``
``network``             a network namespace with only a loopback that is down: ``ENETUNREACH``
``read_only``           the whole file system is read-only except the work directory (``EROFS``)
``left_running``        processes still running when the program exited (a daemonised grandchild): killed
                        with the PID namespace
======================  ====================================================================================

The environment is scrubbed: the program sees ``PATH``, ``HOME`` and ``TMPDIR`` (the work directory) and
``LANG``, nothing of the caller's. Not contained: reading files the ``nobody`` user may read (the sandbox is
for limits and isolation of effects, not for secrets on disk), the CPU the program uses before its limits
(at most ``--sandbox-processes`` x ``--sandbox-cpu-seconds``, within the wall bound).

Where the namespaces are unavailable (no ``unshare``, user namespaces disabled, a kernel before 5.12 without
``mount_setattr``), ``check_sandbox`` raises ``SandboxUnavailable`` naming what failed: the sandbox never
runs a program with less isolation than it claims. It is called at start-up by whatever uses the sandbox.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pwd
import selectors
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from megatron_rl.errors import ConfigError

__all__ = ["LIMIT_FLAGS", "SandboxLimits", "SandboxResult", "SandboxUnavailable", "check_sandbox", "run_python",
           "run_sandboxed"]

WORK_DIR = "/tmp/work"  # the program's work directory, as the program sees it (sandbox_init.WORK)
_PATH = "/usr/local/bin:/usr/bin:/bin"
_BOOT = Path(__file__).with_name("sandbox_init.py").read_text()
_KILL_WAIT_S = 10.0  # a killed sandbox's processes are gone within this (the kernel tears the namespace down)

#: SandboxLimits field -> the flag that sets it (config field rollout.sandbox_<field>)
LIMIT_FLAGS = {"wall_seconds": "--sandbox-wall-seconds", "cpu_seconds": "--sandbox-cpu-seconds",
               "memory_mb": "--sandbox-memory-mb", "file_size_mb": "--sandbox-file-size-mb",
               "disk_mb": "--sandbox-disk-mb", "processes": "--sandbox-processes",
               "open_files": "--sandbox-open-files", "output_bytes": "--sandbox-output-bytes",
               "python": "--sandbox-python"}


class SandboxUnavailable(ConfigError):
    """This machine cannot give the sandbox's isolation (or its Python); the message names what failed."""


@dataclass(frozen=True)
class SandboxLimits:
    """One call's bounds (the ``--sandbox-*`` flags; module docstring: what each contains)."""

    wall_seconds: float = 10.0
    cpu_seconds: int = 10
    memory_mb: int = 512
    file_size_mb: int = 16
    disk_mb: int = 64
    processes: int = 32
    open_files: int = 64
    output_bytes: int = 16384
    python: Optional[str] = None  # the interpreter run_python uses; None: this one, else python3 on PATH

    @classmethod
    def from_config(cls, cfg: Any) -> "SandboxLimits":
        r = cfg.rollout
        return cls(wall_seconds=r.sandbox_wall_seconds, cpu_seconds=r.sandbox_cpu_seconds,
                   memory_mb=r.sandbox_memory_mb, file_size_mb=r.sandbox_file_size_mb, disk_mb=r.sandbox_disk_mb,
                   processes=r.sandbox_processes, open_files=r.sandbox_open_files,
                   output_bytes=r.sandbox_output_bytes, python=r.sandbox_python)

    def flag(self, name: str) -> str:
        """``--sandbox-memory-mb 512``: how messages name a limit."""
        return f"{LIMIT_FLAGS[name]} {getattr(self, name):g}" if name == "wall_seconds" else \
            f"{LIMIT_FLAGS[name]} {getattr(self, name)}"


# what a program's stderr says when it ran into a limit: (what it says, the name, the limit's field or None);
# the C library's strerror texts (Python's OSError and the shell print them alike), Python's MemoryError, and
# how Python, dash and bash say a fork failed
_SIGNS = (("MemoryError", "memory", "memory_mb"), ("Cannot allocate memory", "memory", "memory_mb"),
          ("File too large", "file_size", "file_size_mb"), ("No space left on device", "disk", "disk_mb"),
          ("[Errno 11] Resource temporarily unavailable", "processes", "processes"),
          ("Cannot fork", "processes", "processes"), ("fork: retry", "processes", "processes"),
          ("fork: Resource temporarily unavailable", "processes", "processes"),
          ("Too many open files", "open_files", "open_files"), ("Network is unreachable", "network", None),
          ("Read-only file system", "read_only", None))
_WHAT = {"wall_time": "wall-clock limit", "cpu_time": "CPU-time limit", "output": "output limit",
         "memory": "memory limit", "file_size": "file-size limit", "disk": "work-directory size limit",
         "processes": "process limit", "open_files": "open-files limit", "network": "no network in the sandbox",
         "read_only": "only the work directory is writable", "left_running": "processes left running were killed"}
_FIELD = {"wall_time": "wall_seconds", "cpu_time": "cpu_seconds", "output": "output_bytes"}


@dataclass(frozen=True)
class SandboxResult:
    """What one program did. ``exit_code``: its exit status (negative: the signal that ended it), None when
    the sandbox killed it before it ended (``contained`` then starts with ``wall_time`` or ``output``)."""

    stdout: str
    stderr: str
    exit_code: Optional[int]
    contained: tuple[str, ...]  # the names of the limits it ran into (module docstring), in a fixed order
    cpu_seconds: float
    seconds: float  # wall time of the call, the sandbox's start included
    truncated: bool  # stdout + stderr were cut at --sandbox-output-bytes

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and "wall_time" not in self.contained and "output" not in self.contained

    def status_line(self, limits: SandboxLimits) -> str:
        """One line: how it ended and every limit it ran into, each with its flag."""
        ended = ("killed" if self.exit_code is None else f"exit {self.exit_code}" if self.exit_code >= 0 else
                 f"killed by {_signal_name(-self.exit_code)}")
        notes = []
        for name in self.contained:
            field = _FIELD.get(name) or next((f for _, n, f in _SIGNS if n == name), None)
            notes.append(f"{_WHAT[name]} ({limits.flag(field)})" if field else _WHAT[name])
        return f"[sandbox: {ended}" + (f"; {'; '.join(notes)}" if notes else "") + "]"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _sandbox_user() -> Optional[int]:
    """The uid the sandbox runs as outside its namespace: ``nobody`` for a root caller, else the caller's."""
    if os.geteuid() != 0:
        return None
    try:
        return pwd.getpwnam("nobody").pw_uid
    except KeyError:
        return 65534


def _command(python: str) -> list[str]:
    path = os.environ.get("PATH", "") + ":" + _PATH
    unshare = shutil.which("unshare", path=path)
    if unshare is None:
        raise SandboxUnavailable("the sandbox needs util-linux's unshare (user, PID, mount and network "
                                 "namespaces) and this machine has none on PATH: install util-linux")
    prefix: list[str] = []
    uid = _sandbox_user()
    if uid is not None:
        setpriv = shutil.which("setpriv", path=path)
        if setpriv is None:
            raise SandboxUnavailable("running as root, the sandbox drops to the user nobody with util-linux's "
                                     "setpriv, which this machine lacks: install util-linux")
        prefix = [setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]
    return prefix + [unshare, "--user", "--map-root-user", "--net", "--pid", "--fork", "--kill-child", "--mount",
                     "--mount-proc", "--", python, "-I", "-S", "-c", _BOOT]


def _job(argv: list[str], files: dict[str, str], limits: SandboxLimits) -> bytes:
    env = {"PATH": _PATH, "HOME": WORK_DIR, "TMPDIR": WORK_DIR, "LANG": "C.UTF-8"}
    fields = {f.name: getattr(limits, f.name) for f in dataclasses.fields(limits) if f.name != "python"}
    return json.dumps({"argv": argv, "env": env, "files": files, "limits": fields}).encode()


def _namespace_init(proc: subprocess.Popen) -> Optional[int]:
    """The host pid of the namespaces' PID 1: ``unshare``'s one child (None before it forked or after it ended)."""
    try:
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    except OSError:
        return None
    return int(children[0]) if children else None


def _kill(proc: subprocess.Popen) -> None:
    """End the sandbox and return once nothing of it runs. PID 1 is killed first: the kernel kills every other
    process of its PID namespace before PID 1 ends, and ``unshare`` exits only after PID 1 ended, so once
    ``unshare`` is reaped the program and all it forked are gone. Then the whole process group, for a sandbox
    still starting (``unshare`` kills a PID 1 it forks after that: ``--kill-child``)."""
    if proc.poll() is not None:
        return
    init = _namespace_init(proc)
    if init is not None:
        try:
            pidfd = os.pidfd_open(init)
        except OSError:  # it ended meanwhile
            pidfd = None
        if pidfd is not None:
            try:  # still unshare's child after the pidfd was taken: the pidfd is PID 1, not a reused pid
                if _namespace_init(proc) == init:
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                    proc.wait(timeout=_KILL_WAIT_S)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
            finally:
                os.close(pidfd)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_sandboxed(argv: list[str], limits: SandboxLimits, *, files: Optional[dict[str, str]] = None,
                  stdin: bytes = b"", python: Optional[str] = None) -> SandboxResult:
    """Run ``argv`` (an absolute path first) in a fresh sandbox whose work directory holds ``files`` (name ->
    text), with ``stdin``; never waits past ``limits.wall_seconds`` (+ the kill). ``python``: the interpreter
    of the sandbox's PID 1 (``check_sandbox``'s). Raises ``SandboxUnavailable`` only when the sandbox itself
    could not start; everything the program does is in the result."""
    python = python or check_sandbox(limits)
    return _run(_command(python), argv, limits, files or {}, stdin)


def _run(command: list[str], argv: list[str], limits: SandboxLimits, files: dict[str, str],
         stdin: bytes) -> SandboxResult:
    start = time.monotonic()
    job_fd = os.memfd_create("megatron_rl-sandbox-job")
    status_r, status_w = os.pipe()
    try:
        os.write(job_fd, _job(argv, files, limits))
        os.lseek(job_fd, 0, os.SEEK_SET)
        proc = subprocess.Popen(command + [str(job_fd), str(status_w)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(job_fd, status_w),
                                env={"PATH": _PATH, "LANG": "C.UTF-8"}, cwd="/", start_new_session=True)
    finally:
        os.close(job_fd)
        os.close(status_w)
    try:
        out, err, status, killed = _collect(proc, status_r, stdin, limits, start)
    finally:
        _kill(proc)  # a no-op after a clean exit
        os.close(status_r)
        try:
            proc.wait(timeout=_KILL_WAIT_S)
        except subprocess.TimeoutExpired:
            raise SandboxUnavailable(f"a sandbox (pid {proc.pid}) did not end within {_KILL_WAIT_S:g} s of "
                                     "SIGKILL") from None
    stdout, stderr = out.decode("utf-8", "replace"), err.decode("utf-8", "replace")
    if status is None and killed is None:  # PID 1 never reported: the sandbox did not start
        said = stderr.strip()[-600:] or "no message"
        fix = "" if "failed to execute" in said else (
            "; it needs user, PID, mount and network namespaces for an unprivileged user (util-linux unshare, "
            "sysctl user.max_user_namespaces > 0, no seccomp or LSM policy refusing unshare) and Linux 5.12+")
        raise SandboxUnavailable(f"the sandbox did not start (exit {proc.returncode}): {said}{fix}")
    if status is not None and "setup_error" in status:
        raise SandboxUnavailable(f"the sandbox could not seal itself: {status['setup_error']}")
    code = None if killed else status["exit"] if status else None
    cpu = float(status.get("cpu_seconds", 0.0)) if status else 0.0
    contained = [killed] if killed else []
    if code is not None and (code == -signal.SIGXCPU or (code == -signal.SIGKILL and cpu >= limits.cpu_seconds)):
        contained.append("cpu_time")
    contained += sorted({name for sign, name, _ in _SIGNS if sign in stderr}, key=list(_WHAT).index)
    if status and status.get("left_running"):
        contained.append("left_running")
    return SandboxResult(stdout, stderr, code, tuple(contained), cpu, time.monotonic() - start,
                         truncated=killed == "output")


def _collect(proc: subprocess.Popen, status_r: int, stdin: bytes, limits: SandboxLimits,
             start: float) -> tuple[bytes, bytes, Optional[dict], Optional[str]]:
    """Read stdout, stderr and PID 1's report until all close, at most ``output_bytes`` kept in all and
    never past the wall bound; ``killed``: "output" or "wall_time" when the sandbox was killed for it."""
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    out_fd, err_fd, in_fd = proc.stdout.fileno(), proc.stderr.fileno(), proc.stdin.fileno()
    chunks: dict[int, bytearray] = {out_fd: bytearray(), err_fd: bytearray(), status_r: bytearray()}
    kept = 0
    sel = selectors.DefaultSelector()
    for fd in chunks:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    pending = memoryview(stdin)
    if pending:
        os.set_blocking(in_fd, False)
        sel.register(in_fd, selectors.EVENT_WRITE)
    else:
        proc.stdin.close()
    deadline = start + limits.wall_seconds
    killed: Optional[str] = None
    try:
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                killed = "wall_time"
                break
            for key, _ in sel.select(timeout=left):
                fd = key.fd
                if fd == in_fd:
                    try:
                        pending = pending[os.write(fd, pending[:65536]):]
                    except BrokenPipeError:
                        pending = pending[:0]
                    if not pending:
                        sel.unregister(fd)
                        proc.stdin.close()
                    continue
                data = os.read(fd, 65536)
                if not data:
                    sel.unregister(fd)
                    continue
                if fd == status_r:
                    chunks[fd] += data[:65536 - len(chunks[fd])]
                    continue
                room = limits.output_bytes - kept
                chunks[fd] += data[:max(room, 0)]
                kept += min(len(data), max(room, 0))
                if len(data) > room:
                    killed = "output"
                    break
            if killed:
                break
        if killed is None:  # the pipes closed: the program and PID 1 are ending
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                killed = "wall_time"
    finally:
        sel.close()
        if not proc.stdin.closed:
            proc.stdin.close()
        proc.stdout.close()
        proc.stderr.close()
    report = bytes(chunks[status_r])
    status = json.loads(report) if report and killed is None else None
    return bytes(chunks[out_fd]), bytes(chunks[err_fd]), status, killed


_CHECKED: dict[tuple, str] = {}
_CHECK_LOCK = threading.Lock()


def check_sandbox(limits: SandboxLimits) -> str:
    """The interpreter the sandbox runs Python with, after starting it once in a sandbox under ``limits``
    (cached per limits): ``limits.python`` when given, else this interpreter, else ``python3`` on PATH (the
    sandbox's user must be able to run it: a root caller's ``nobody`` cannot enter ``/root``). Raises
    ``SandboxUnavailable`` naming what failed."""
    key = dataclasses.astuple(limits)
    with _CHECK_LOCK:
        if key in _CHECKED:
            return _CHECKED[key]
        tried, started = [], False
        candidates = [limits.python] if limits.python else \
            [sys.executable, shutil.which("python3", path=_PATH) or "/usr/bin/python3"]
        for python in dict.fromkeys(c for c in candidates if c):
            command = _command(python)  # no unshare / setpriv: no candidate helps
            try:
                result = _run(command, [python, "-I", "-S", "-c", "print('ok')"], limits, {}, b"")
            except SandboxUnavailable as exc:
                if "failed to execute" not in str(exc):  # the namespaces themselves (unshare said why)
                    raise
                tried.append(f"{python}: {exc}")
                continue
            if result.ok and result.stdout.strip() == "ok":
                _CHECKED[key] = python
                return python
            started = True
            tried.append(f"{python}: {result.status_line(limits)} {result.stderr.strip()[-300:]}")
        if started:  # an interpreter ran but could not start under the limits
            fix = ("raise the limit its error names (" +
                   ", ".join(limits.flag(f) for f in ("memory_mb", "open_files", "processes", "file_size_mb")) + ")")
        elif limits.python is None:
            fix = "give --sandbox-python PATH, an interpreter the sandbox's user can run"
        else:
            fix = "give --sandbox-python an interpreter the sandbox's user (nobody, for a root run) can run"
        where = "under these limits" if started else "on this machine"
        raise SandboxUnavailable(f"the sandbox cannot run Python {where} ({'; '.join(tried)}); {fix}")


def run_python(source: str, limits: SandboxLimits, *, files: Optional[dict[str, str]] = None,
               stdin: bytes = b"") -> SandboxResult:
    """``source`` as ``main.py`` of a fresh sandbox, run by ``python -I -u main.py`` (isolated: no
    ``PYTHONPATH``, no user site; unbuffered: what it printed before a kill is kept)."""
    python = check_sandbox(limits)
    return run_sandboxed([python, "-I", "-u", "main.py"], limits, files={**(files or {}), "main.py": source},
                         stdin=stdin, python=python)

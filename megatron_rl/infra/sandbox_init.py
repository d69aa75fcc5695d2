"""The sandbox's first process: PID 1 of the namespaces ``infra.sandbox`` starts, standard library only.

Never imported by the package: ``sandbox.py`` runs this file's text with ``python -I -S -c``, inside
``unshare --user --map-root-user --net --pid --fork --kill-child --mount --mount-proc`` (as the unprivileged
``nobody`` when the caller is root), so it holds every capability of its own user namespace and none outside.
What it does with them, in order, and why:

1. the whole mount tree becomes read-only (``mount_setattr(AT_RECURSIVE, MOUNT_ATTR_RDONLY)``): the program
   can write nowhere it could otherwise (the ``nobody`` user can write world-writable ``/tmp``, ``/dev/shm``;
   a non-root caller's own files);
2. a fresh read-only tmpfs hides the host's ``/tmp``, and a size-bounded writable tmpfs on ``/tmp/work`` is
   the work directory (it and everything in it vanish with the mount namespace: nothing to clean up, even
   when the caller is killed); the job's files are written into it;
3. every capability is dropped for good (the bounding set, ``SECBIT_NOROOT`` so that executing a program as
   the namespace's uid 0 grants none, then ``capset`` to empty, then ``no_new_privs``): nothing in the
   sandbox can undo a mount or raise a limit;
4. it forks the program (``RLIMIT_CPU``, ``_AS``, ``_FSIZE``, ``_NOFILE``, ``_NPROC``, ``_CORE`` set in
   the child, then ``execve`` with the job's scrubbed environment), reaps whatever the program leaves, and
   when the program exits, writes its status to the status descriptor and exits: the kernel then kills
   every other process of the PID namespace (a daemonised grandchild included).

``RLIMIT_NPROC`` counts the processes of one user in one user namespace, so the limit holds per sandbox
and for a root caller too (the sandbox's user is not root outside); ``unshare`` (which entered the user
namespace) and this PID 1 count too, so the limit is ``--sandbox-processes`` + 2.
Arguments: the descriptor of the job (JSON: argv, env, files, limits) and of the status pipe.
"""

import ctypes
import json
import os
import resource
import signal
import sys

AT_FDCWD = -100
AT_RECURSIVE = 0x8000
MOUNT_ATTR_RDONLY = 0x1
SYS_MOUNT_SETATTR = 442  # the same number on every architecture (the unified syscall table, Linux 5.12+)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT = 0x1, 0x2, 0x4, 0x20
PR_CAPBSET_DROP, PR_SET_SECUREBITS, PR_SET_NO_NEW_PRIVS = 24, 28, 38
SECBIT_NOROOT, SECBIT_NOROOT_LOCKED, SECBIT_NO_SETUID_FIXUP, SECBIT_NO_SETUID_FIXUP_LOCKED = 1, 2, 4, 8
CAP_VERSION_3 = 0x20080522
WORK = "/tmp/work"

libc = ctypes.CDLL(None, use_errno=True)


class MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64), ("propagation", ctypes.c_uint64),
                ("userns_fd", ctypes.c_uint64)]


class CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(source: str, target: str, fstype: str, flags: int, data: str = "") -> None:
    check(libc.mount(source.encode(), target.encode(), fstype.encode(), ctypes.c_ulong(flags), data.encode()),
          f"mount {fstype} on {target}")


def seal_filesystem(disk_mb: int) -> None:
    attr = MountAttr(MOUNT_ATTR_RDONLY, 0, 0, 0)
    check(libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, b"/", AT_RECURSIVE, ctypes.byref(attr), ctypes.sizeof(attr)),
          "mount_setattr / read-only")
    mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=755")
    os.mkdir(WORK)
    mount("tmpfs", WORK, "tmpfs", MS_NOSUID | MS_NODEV, f"size={disk_mb}m,mode=700")
    mount("tmpfs", "/tmp", "tmpfs", MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, "size=64k,mode=755")


def drop_capabilities() -> None:
    bits = SECBIT_NOROOT | SECBIT_NOROOT_LOCKED | SECBIT_NO_SETUID_FIXUP | SECBIT_NO_SETUID_FIXUP_LOCKED
    check(libc.prctl(PR_SET_SECUREBITS, bits, 0, 0, 0), "securebits")
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last = int(f.read())
    for cap in range(last + 1):
        check(libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), f"drop capability {cap}")
    header, data = CapHeader(CAP_VERSION_3, 0), (CapData * 2)()
    check(libc.capset(ctypes.byref(header), data), "capset")
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")


def run_program(job: dict) -> None:
    """The child: limits, then the program (never returns)."""
    limits = job["limits"]
    mib = 1024 * 1024
    for which, value in ((resource.RLIMIT_CPU, (limits["cpu_seconds"], limits["cpu_seconds"] + 1)),
                         (resource.RLIMIT_AS, (limits["memory_mb"] * mib,) * 2),
                         (resource.RLIMIT_FSIZE, (limits["file_size_mb"] * mib,) * 2),
                         (resource.RLIMIT_NOFILE, (limits["open_files"],) * 2),
                         (resource.RLIMIT_NPROC, (limits["processes"] + 2,) * 2),  # + PID 1, unshare
                         (resource.RLIMIT_CORE, (0, 0))):
        resource.setrlimit(which, value)
    for sig in (signal.SIGPIPE, signal.SIGXFSZ):  # as a fresh process has them, not as Python left them
        signal.signal(sig, signal.SIG_DFL)
    os.chdir(WORK)
    argv = job["argv"]
    os.execve(argv[0], argv, job["env"])


def zombie(pid: str) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in "ZX"
    except OSError:  # it ended meanwhile
        return True


def main() -> None:
    job_fd, status_fd = int(sys.argv[1]), int(sys.argv[2])
    with os.fdopen(job_fd, "rb") as f:
        job = json.loads(f.read())
    os.set_inheritable(status_fd, False)
    try:
        seal_filesystem(job["limits"]["disk_mb"])
        for name, text in job["files"].items():
            with open(os.path.join(WORK, name), "w", encoding="utf-8") as out:
                out.write(text)
        drop_capabilities()
    except OSError as exc:
        os.write(status_fd, json.dumps({"setup_error": str(exc)}).encode())
        sys.exit(70)
    pid = os.fork()
    if pid == 0:
        try:
            os.close(status_fd)
            run_program(job)
        except BaseException as exc:  # noqa: BLE001 - the program did not start: say why, as its stderr
            os.write(2, f"sandbox: cannot start {job['argv'][0]}: {exc}\n".encode())
        finally:
            os._exit(127)
    while True:  # PID 1 reaps every orphan; the program's own status is the one reported
        reaped, status, usage = os.wait3(0)
        if reaped == pid:
            break
    left = [p for p in os.listdir("/proc") if p.isdigit() and int(p) != 1 and not zombie(p)]
    report = {"exit": os.waitstatus_to_exitcode(status), "cpu_seconds": usage.ru_utime + usage.ru_stime,
              "max_rss_kb": usage.ru_maxrss, "left_running": len(left)}
    os.write(status_fd, json.dumps(report).encode())


if __name__ == "__main__":
    main()

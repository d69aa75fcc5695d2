"""The local sandbox against the escapes a model's code tries: each is contained, named in the result, and
leaves nothing behind (no process, no file outside); the test process stays unharmed.

Stray processes are found by state: every program here carries a marker in its argv (inherited by whatever
it forks), and after the call no process on the machine has it in its command line. Limits are small so the
file runs in a few seconds; the wall bound is large (a minute) wherever another limit must be the one that
acts, so a loaded machine changes no outcome. A machine without the namespaces skips these visibly (the refusal is tested in
``test_the_sandbox_refuses_where_it_cannot_isolate``)."""

import os
import secrets
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.infra import sandbox
from megatron_rl.infra.sandbox import (SandboxLimits, SandboxUnavailable, check_sandbox, run_python,
                                       run_sandboxed)

LIMITS = SandboxLimits(wall_seconds=60.0, cpu_seconds=1, memory_mb=128, file_size_mb=1, disk_mb=2, processes=8,
                       open_files=32, output_bytes=4096)


@pytest.fixture(scope="module")
def python():
    try:
        return check_sandbox(LIMITS)
    except SandboxUnavailable as exc:
        pytest.skip(f"no sandbox on this machine: {exc}")


def marked(python, source, limits=LIMITS, **kw):
    """Run ``source`` with a marker in its argv; the result and the processes still carrying the marker after
    the call returned (none, when the sandbox cleaned up)."""
    marker = f"megatron-rl-sandbox-test-{secrets.token_hex(6)}"
    result = run_sandboxed([python, "-I", "-u", "main.py", marker], limits, files={"main.py": source},
                           python=python, **kw)
    return result, _carrying(marker)


def _carrying(marker):
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(int(pid))
        except OSError:
            continue
    return found


def test_a_program_runs_and_its_output_comes_back(python):
    result, stray = marked(python, "import os, sys\nprint('hi', os.getcwd())\nprint('err', file=sys.stderr)\n"
                                   "open('note.txt', 'w').write('x')\nprint(sorted(os.listdir('.')))")
    assert result.ok and result.contained == () and not stray
    assert result.stdout == "hi /tmp/work\n['main.py', 'note.txt']\n" and result.stderr == "err\n"
    assert result.status_line(LIMITS) == "[sandbox: exit 0]"
    again = run_python("import os; print(os.listdir('.'))", LIMITS)  # a fresh work directory each call
    assert again.stdout == "['main.py']\n"


def test_a_fork_bomb_hits_the_process_limit_and_leaves_nothing(python):
    result, stray = marked(python, "import os\nwhile True:\n    os.fork()")
    assert "processes" in result.contained and "BlockingIOError" in result.stderr and not stray
    assert "process limit (--sandbox-processes 8)" in result.status_line(LIMITS)
    assert subprocess.run([sys.executable, "-c", "pass"]).returncode == 0  # this process can still start one


def test_the_process_limit_counts_the_program_and_what_it_forks(python):
    result, stray = marked(python, "import os, time\nn = 1\ntry:\n    while True:\n        if os.fork() == 0:\n"
                                   "            time.sleep(600)\n        n += 1\nexcept BlockingIOError:\n    print(n)")
    assert result.stdout == f"{LIMITS.processes}\n" and not stray  # the program itself + 7 children


def test_endless_output_is_cut_and_the_program_killed(python):
    result, stray = marked(python, "while True:\n    print('y' * 100)")
    assert result.contained == ("output",) and result.exit_code is None and result.truncated and not stray
    assert result.stdout.startswith("y" * 100 + "\n")  # what it printed before the kill is kept
    assert len(result.stdout.encode()) + len(result.stderr.encode()) <= LIMITS.output_bytes
    assert result.status_line(LIMITS) == "[sandbox: killed; output limit (--sandbox-output-bytes 4096)]"


def test_an_endless_loop_hits_the_cpu_limit(python):
    result, stray = marked(python, "while True:\n    pass")
    assert "cpu_time" in result.contained and result.exit_code == -24 and not stray  # SIGXCPU
    assert result.status_line(LIMITS) == ("[sandbox: killed by SIGXCPU; CPU-time limit "
                                          "(--sandbox-cpu-seconds 1)]")


def test_sleeping_past_the_wall_bound_is_killed(python):
    short = SandboxLimits(**{**LIMITS.__dict__, "wall_seconds": 1.0})
    result, stray = marked(python, "import time\ntime.sleep(600)", limits=short)
    assert result.contained == ("wall_time",) and result.exit_code is None and not stray
    assert result.status_line(short) == "[sandbox: killed; wall-clock limit (--sandbox-wall-seconds 1)]"


def test_a_huge_allocation_fails_with_memory_error(python):
    result, stray = marked(python, "x = bytearray(1 << 30)")
    assert result.contained == ("memory",) and "MemoryError" in result.stderr and not stray
    assert "memory limit (--sandbox-memory-mb 128)" in result.status_line(LIMITS)


@pytest.mark.parametrize("source, name", [
    ("open('big', 'wb').write(b'x' * (2 << 20))", "file_size"),
    ("for i in range(4):\n    open(f'f{i}', 'wb').write(b'x' * (900 << 10))", "disk"),
    ("fs = [open('main.py') for _ in range(64)]", "open_files"),
])
def test_file_size_disk_and_open_files_are_bounded(python, source, name):
    result, stray = marked(python, source)
    assert result.contained == (name,) and result.exit_code == 1 and not stray


def test_writing_outside_the_work_directory_fails(python, tmp_path):
    elsewhere = f"/tmp/megatron-rl-elsewhere-{secrets.token_hex(4)}"
    repo_file = Path(__file__).resolve().parent / f"written-{secrets.token_hex(4)}"
    targets = [elsewhere, "/dev/shm/megatron-rl-x", f"/var/tmp/megatron-rl-elsewhere-{secrets.token_hex(4)}"]
    if str(repo_file).startswith("/tmp/"):  # a clone under /tmp (CI's fresh clone): hidden behind the empty /tmp
        result, _ = marked(python, f"open({str(repo_file)!r}, 'w').write('escaped')")
        assert result.exit_code == 1 and "No such file or directory" in result.stderr, result.stderr
        assert not repo_file.exists()
    else:
        targets.append(str(repo_file))
    for target in targets:
        result, _ = marked(python, f"open({target!r}, 'w').write('escaped')")
        assert result.contained == ("read_only",) and "Read-only file system" in result.stderr, target
        assert not os.path.exists(target)
    assert "only the work directory is writable" in result.status_line(LIMITS)
    (tmp_path / "host.txt").write_text("host")  # the host's /tmp is hidden behind an empty read-only one
    result, _ = marked(python, f"print(open({str(tmp_path / 'host.txt')!r}).read())")
    assert result.exit_code == 1 and "host" not in result.stdout  # not found (under /tmp) or not readable


def test_no_socket_reaches_a_listener_on_this_machine(python):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.setblocking(False)
        port = listener.getsockname()[1]
        result, _ = marked(python, f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)")
        assert result.contained == ("network",) and "Network is unreachable" in result.stderr
        with pytest.raises(BlockingIOError):  # nothing ever connected
            listener.accept()


def test_the_environment_is_scrubbed(python, monkeypatch):
    monkeypatch.setenv("MEGATRON_RL_TEST_SECRET", "s3cret-token")
    result, _ = marked(python, "import os\nprint(sorted(os.environ.items()))\n"
                               "print(open('/proc/1/environ').read())")
    assert "s3cret" not in result.stdout + result.stderr
    assert result.stdout.splitlines()[0] == str(sorted({"HOME": "/tmp/work", "LANG": "C.UTF-8", "PATH":
                                                        "/usr/local/bin:/usr/bin:/bin", "TMPDIR": "/tmp/work"}
                                                       .items()))


def test_a_daemonised_grandchild_is_killed_with_the_program(python):
    result, stray = marked(python, "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
                                   "        time.sleep(600)\n    os._exit(0)\nprint('parent exits')")
    assert result.exit_code == 0 and "left_running" in result.contained and not stray
    assert result.stdout == "parent exits\n"


def test_the_program_cannot_undo_its_limits(python):
    result, _ = marked(python, "import resource, ctypes\n"
                               "try:\n    resource.setrlimit(resource.RLIMIT_AS, (-1, -1))\n"
                               "except ValueError as e:\n    print('rlimit:', e)\n"
                               "libc = ctypes.CDLL(None, use_errno=True)\n"
                               "print('umount:', libc.umount2(b'/tmp', 2), ctypes.get_errno())\n"
                               "print('caps:', [l for l in open('/proc/self/status') if l.startswith('CapEff')])")
    lines = result.stdout.splitlines()
    assert lines[0] == "rlimit: not allowed to raise maximum limit"
    assert lines[1] == "umount: -1 1"  # EPERM
    assert "CapEff:\\t0000000000000000" in lines[2]


def test_the_sandbox_refuses_where_it_cannot_isolate(monkeypatch):
    monkeypatch.setattr(sandbox.shutil, "which", lambda name, path=None: None)
    with pytest.raises(SandboxUnavailable, match="needs util-linux's unshare"):
        run_sandboxed(["/bin/true"], LIMITS, python=sys.executable)
    monkeypatch.undo()
    monkeypatch.setattr(sandbox, "_command", lambda python: ["/bin/sh", "-c", "echo 'unshare: unshare failed: "
                                                             "Operation not permitted' >&2; exit 1", "sh"])
    with pytest.raises(SandboxUnavailable, match="did not start.*Operation not permitted"):
        run_sandboxed(["/bin/true"], LIMITS, python=sys.executable)
    monkeypatch.setattr(sandbox, "_CHECKED", {})
    with pytest.raises(SandboxUnavailable, match="^the sandbox did not start .exit 1.: unshare: unshare failed"):
        check_sandbox(LIMITS)  # user namespaces refused: no interpreter would help, so none is blamed
    monkeypatch.setattr(sandbox, "_command", lambda python: ["/bin/sh", "-c", f"echo 'unshare: failed to execute "
                                                             f"{python}: Permission denied' >&2; exit 126", "sh"])
    with pytest.raises(SandboxUnavailable, match="cannot run Python on this machine.*give --sandbox-python"):
        check_sandbox(LIMITS)


def test_limits_too_small_for_python_are_named(python):
    with pytest.raises(SandboxUnavailable, match="cannot run Python under these limits.*raise the limit its error "
                                                 "names .--sandbox-memory-mb 8"):
        check_sandbox(SandboxLimits(memory_mb=8, python=python))

"""tools/check_env.py: JSON shape on this CPU machine, broken/hanging/unrelated packages, human output."""

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

from _util import REPO

TOOL = REPO / "tools" / "check_env.py"


def _run(*args, pythonpath=None, timeout=300, env=None):
    env = {**os.environ, **(env or {})}
    if pythonpath:
        env["PYTHONPATH"] = str(pythonpath) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)


@pytest.fixture(scope="module")
def full_report():
    proc = _run("--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_json_shape_and_content_on_cpu_machine(full_report):
    r = full_report
    assert set(r) == {"python", "platform", "torch", "accelerators", "backends", "exit_code"}
    assert r["exit_code"] == 0
    assert r["python"]["version"] == ".".join(map(str, sys.version_info[:3]))
    assert r["platform"]["cpu_count"] == os.cpu_count()
    import importlib.metadata
    assert r["torch"]["status"] == "ok" and r["torch"]["version"] == importlib.metadata.version("torch")
    assert r["torch"]["cuda_build"] is False and r["torch"]["cuda_version"] is None
    assert r["accelerators"] == {"kind": "none", "count": 0, "devices": []}
    b = r["backends"]
    assert set(b) >= {"megatron-core", "transformer-engine", "apex", "flash-attn", "triton", "sglang",
                      "vllm", "torch_memory_saver", "ray", "wandb", "tensorboard", "deepspeed",
                      "liger-kernel", "mbridge"}
    for entry in b.values():
        assert set(entry) == {"status", "module", "version", "enables", "note", "error", "seconds"}
        assert entry["status"] in {"ok", "missing", "broken", "timeout", "unrelated"}
    assert b["megatron-core"]["status"] == "ok" and b["megatron-core"]["version"] == "0.16.1"
    te = b["transformer-engine"]
    assert te["status"] == "missing" and te["version"] is None
    assert te["note"] == "not installed -> FP8 and TE layer specs unavailable; local spec is used"
    assert b["tensorboard"]["status"] == "ok" and b["tensorboard"]["version"]


def test_human_table_from_full_report(full_report):
    spec = importlib.util.spec_from_file_location("check_env_tool", TOOL)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["check_env_tool"] = mod  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(mod)
    text = mod.format_report(full_report)
    assert "accelerators  none" in text and "CPU-only build" in text
    row = next(line for line in text.splitlines() if line.startswith("megatron-core"))
    assert " ok " in row and "0.16.1" in row
    assert any(line.startswith("transformer-engine") and "local spec is used" in line for line in text.splitlines())


def test_human_output_from_cli():
    proc = _run("--only", "tensorboard")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("python ")
    assert "backend" in proc.stdout and "tensorboard" in proc.stdout and "megatron-core" not in proc.stdout


def _write(root, rel, body):
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(body))


def test_broken_and_dying_packages_are_reported_not_fatal(tmp_path):
    """Each ends on its own: --timeout (generous) only bounds a hang (a 4 s one timed out a slow start-up)."""
    _write(tmp_path, "ray/__init__.py", "raise RuntimeError('ray is broken on purpose')\n")
    _write(tmp_path, "deepspeed/__init__.py", "import os\nos._exit(3)\n")
    _write(tmp_path, "mbridge/__init__.py", "import not_a_real_dependency_xyz\n")
    proc = _run("--json", "--timeout", "150", "--only", "ray,deepspeed,mbridge", pythonpath=tmp_path)
    assert proc.returncode == 0, proc.stderr
    b = json.loads(proc.stdout)["backends"]
    assert b["ray"]["status"] == "broken"
    assert b["ray"]["error"] == "RuntimeError: ray is broken on purpose"
    assert b["ray"]["note"] == "broken on import -> placement uses torchrun only"
    assert b["deepspeed"]["status"] == "broken" and "import process died" in b["deepspeed"]["error"]
    assert b["mbridge"]["status"] == "broken" and "not_a_real_dependency_xyz" in b["mbridge"]["error"]


def test_a_hanging_import_is_cut_at_the_timeout_and_its_process_group_killed(tmp_path):
    """The import never ends (it waits for a file nobody writes): only the cut can answer, whatever the load.
    Its process group is gone afterwards (the pid it wrote is no longer alive)."""
    pid_file = tmp_path / "wandb.pid"
    _write(tmp_path, "wandb/__init__.py", f"""\
        import os, threading
        open({str(pid_file)!r}, "w").write(str(os.getpid()))
        threading.Event().wait()
        """)
    proc = _run("--json", "--timeout", "2", "--only", "wandb", pythonpath=tmp_path)
    assert proc.returncode == 0, proc.stderr
    b = json.loads(proc.stdout)["backends"]["wandb"]
    assert b["status"] == "timeout" and "within 2s" in b["error"] and "raise --timeout" in b["error"], b
    if pid_file.exists():  # the cut may come before the import even started, on a busy machine
        with pytest.raises(ProcessLookupError):
            os.kill(int(pid_file.read_text()), 0)


RENDEZVOUS = """\
    import os, time
    meeting = os.environ["RENDEZVOUS_DIR"]
    open(os.path.join(meeting, "{me}"), "w").close()
    while not os.path.exists(os.path.join(meeting, "{other}")):  # the other probe is importing too
        time.sleep(0.01)
    """


def test_probes_run_concurrently(tmp_path):
    """ray's import waits for deepspeed's to start and the other way round: both ok only if they run at once
    (one after the other, the first would wait until the --timeout cut it)."""
    _write(tmp_path, "ray/__init__.py", RENDEZVOUS.format(me="ray", other="deepspeed"))
    _write(tmp_path, "deepspeed/__init__.py", RENDEZVOUS.format(me="deepspeed", other="ray"))
    proc = _run("--json", "--timeout", "150", "--only", "ray,deepspeed", pythonpath=tmp_path,
                env={"RENDEZVOUS_DIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    b = json.loads(proc.stdout)["backends"]
    assert "timeout" not in (b["ray"]["status"], b["deepspeed"]["status"]), b  # imported, whatever their checks say
    assert (tmp_path / "ray").exists() and (tmp_path / "deepspeed").exists()


def test_pypi_apex_is_unrelated_and_nvidia_apex_is_recognised(tmp_path):
    pypi = tmp_path / "pypi"
    _write(pypi, "apex/__init__.py", "__version__ = '0.9.10dev'\n")
    b = json.loads(_run("--json", "--only", "apex", pythonpath=pypi).stdout)["backends"]["apex"]
    assert b["status"] == "unrelated" and b["version"] == "0.9.10dev"
    assert "unrelated project" in b["note"]
    nvidia = tmp_path / "nvidia"
    _write(nvidia, "apex/__init__.py", "")
    _write(nvidia, "apex/optimizers/__init__.py", "class FusedAdam: pass\n")
    _write(nvidia, "amp_C.py", "")
    b = json.loads(_run("--json", "--only", "apex", pythonpath=nvidia).stdout)["backends"]["apex"]
    assert b["status"] == "ok" and "NVIDIA apex: apex.optimizers, amp_C" in b["note"]


def test_unknown_only_name_is_a_clear_error():
    proc = _run("--only", "tensorflow")
    assert proc.returncode != 0 and "unknown --only name(s) ['tensorflow']" in proc.stderr


def test_package_printing_without_newline_is_ok(tmp_path):
    """a package that writes to stdout without a newline on import was reported broken."""
    _write(tmp_path, "wandb/__init__.py", "import sys\n__version__ = '9.9'\nsys.stdout.write('hello from wandb')\n")
    b = json.loads(_run("--json", "--only", "wandb", pythonpath=tmp_path).stdout)["backends"]["wandb"]
    assert b["status"] == "ok" and b["version"] == "9.9", b


@pytest.mark.parametrize("args", [("--timeout", "-1"), ("--timeout", "0"), ("--timeout", "nan"), ("--jobs", "0")])
def test_non_positive_timeout_or_jobs_is_refused(args):
    proc = _run(*args, "--only", "wandb")
    assert proc.returncode == 2 and f"argument {args[0]}: {args[1]} must be > 0" in proc.stderr and not proc.stdout


@pytest.mark.parametrize("value", ["inf", "1e10", "86401"])
def test_an_infinite_or_huge_timeout_is_refused_by_name(value):
    """--timeout inf raised OverflowError from the wait (a traceback); 1e10 overflowed select()."""
    proc = _run("--timeout", value, "--only", "wandb")
    assert proc.returncode == 2 and not proc.stdout, proc.stderr
    assert f"argument --timeout: {value} must be finite and at most 86400; give the seconds each optional import " \
           "may take, e.g. --timeout 60" in proc.stderr and "Traceback" not in proc.stderr

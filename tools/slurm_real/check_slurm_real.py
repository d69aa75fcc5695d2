"""The Slurm route (tools/launch_job.py slurm) against a REAL Slurm on this machine: one node, 2 CPUs.

Not part of the suite's quick tiers (it starts a cluster and trains twice, 2.5-4 min): ``bash
scripts/test_slurm_real.sh`` runs it (installing Debian's slurm-wlm and munge first when they are missing), and
tests/tools/test_slurm_real.py runs that script wherever Slurm is installed and this is root. Steps:

1. a private one-node cluster: munged (unless one runs already), slurmctld and slurmd, each in the foreground
   as a child of this process, with a conf under ``OUT/slurm`` (free ports, a random FirstJobId, the state
   there, slurmd's spool in a short /tmp dir: a step's socket path must fit in 108 bytes). Stopped by pid at
   the end, whatever happened: jobs cancelled first, then slurmd, slurmctld, munged (only if started here). The conf sets ``AuthInfo=cred_expire=10`` and short scheduler intervals so
   a requeued job starts within seconds: a stock Slurm 22.05 holds a requeued job for cred_expire + 1 = 121 s
   and its main scheduler may take 60 s more to notice (measured; docs/launch.md). The route does not
   depend on either.
2. the job written by the demo's own launch script: ``JOB=slurm bash scripts/run_demo_cpu.sh`` (its flags,
   NPROC 2 on the one node), then ``sbatch --test-only`` against the controller.
3. ``requeue``: submitted; once step 3 is logged (every rank paused there), ``scancel --batch --signal=USR1``
   -- the signal ``#SBATCH --signal=B:USR1@<lead>`` sends at the time limit. Attempt 1 must save and exit 3;
   the job requeues itself; attempt 2 resumes from that checkpoint and finishes: exit 0, the job COMPLETED
   with one restart, every step 1..N in metrics.jsonl, run_status.json "finished".
4. ``time_limit``: ``--time 3 --signal-lead 90`` and more rollouts than fit: Slurm's own warning must stop
   attempt 1 (exit 3, requeued) and attempt 2 resume past the checkpoint. Then a plain ``scancel``: the run is
   asked to stop like any SIGTERM, and the job is not requeued (a cancelled job is the user's decision).

Writes figures.json, the job scripts, their logs and the daemons' logs under --out. Exit 0 when every check
passed, 1 when one failed, 2 when the cluster could not be set up.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from megatron_rl.infra.pause_points import PAUSE_AT_ENV, PAUSE_DIR_ENV, marker_path  # noqa: E402 - path set above
from megatron_rl.infra.ports import free_port  # noqa: E402

NPROC = 2
REQUEUE_STEPS = 12  # the requeue phase's --num-rollout; the stop comes once STOP_AFTER steps are logged
STOP_AFTER = 3
ATTEMPT_LINE = re.compile(r"\] job (\d+) attempt (\d+): (.*)$")


class SetupError(RuntimeError):
    """The cluster could not be started (exit 2)."""


class CheckFailed(AssertionError):
    """A check of the route failed (exit 1)."""


def _wait(cond: Callable[[], object], what: str, timeout: float, poll: float = 1.0) -> object:
    """Poll ``cond`` until it returns something truthy; the timeout only bounds a hang and names it."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise CheckFailed(f"no {what} within {timeout:.0f} s")
        time.sleep(poll)


def _stop_child(proc: Optional[subprocess.Popen], grace_s: float = 20.0) -> None:
    """SIGTERM one process this harness started, SIGKILL it after ``grace_s``; reaped either way."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


class LocalSlurm:
    """A one-node Slurm whose daemons are this process's children (``-D``), stopped by pid in :meth:`stop`."""

    def __init__(self, root: Path, cpus: int):
        self.root = root
        self.cpus = cpus
        self.conf = root / "slurm.conf"
        self.first_job_id = random.SystemRandom().randrange(100_000, 900_000)
        self.procs: dict[str, subprocess.Popen] = {}
        self.spool: Optional[Path] = None
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    def _write_conf(self) -> None:
        ctld_port, slurmd_port = free_port(), free_port()
        for sub in ("state", "log"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        # slurmd puts each step's Unix socket in its spool dir, and a socket path holds 108 bytes at most (a
        # pytest tmp_path is too long: "Unix socket path ... is too long", the job's launch fails and it is held)
        self.spool = Path(tempfile.mkdtemp(prefix="mrl-slurmd-", dir="/tmp"))
        self.conf.write_text("\n".join([
            "ClusterName=mrlcheck", "SlurmctldHost=localhost", "SlurmUser=root", "SlurmdUser=root",
            f"SlurmctldPort={ctld_port}", f"SlurmdPort={slurmd_port}", "AuthType=auth/munge",
            f"StateSaveLocation={self.root / 'state'}", f"SlurmdSpoolDir={self.spool}",
            f"SlurmctldPidFile={self.root / 'slurmctld.pid'}", f"SlurmdPidFile={self.root / 'slurmd.pid'}",
            f"SlurmctldLogFile={self.root / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={self.root / 'log' / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU", "MpiDefault=none", "ReturnToService=2", "MailProg=/bin/true",
            "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
            f"FirstJobId={self.first_job_id}", "KillWait=30", "JobRequeue=1", "MinJobAge=600",
            # a requeued job waits cred_expire + 1 s (stock: 121 s), then for the next scheduling pass
            "AuthInfo=cred_expire=10", "SchedulerParameters=sched_interval=5,bf_interval=5",
            f"NodeName=localhost CPUs={self.cpus} RealMemory=4000 State=UNKNOWN",
            "PartitionName=check Nodes=localhost Default=YES MaxTime=INFINITE State=UP", ""]))

    def _munge_ok(self) -> bool:
        enc = subprocess.run(["munge", "-n"], capture_output=True, timeout=10)
        return enc.returncode == 0 and subprocess.run(["unmunge"], input=enc.stdout, capture_output=True,
                                                      timeout=10).returncode == 0

    def _daemon(self, name: str, cmd: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.stdout", "w")
        self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        log.close()

    def start(self) -> None:
        if os.geteuid() != 0:
            raise SetupError("slurmd and munged are started here as root: run as root")
        for tool in ("munged", "munge", "unmunge", "slurmctld", "slurmd", "sbatch", "scontrol"):
            if shutil.which(tool) is None:
                raise SetupError(f"{tool} is not installed: apt-get install slurm-wlm munge "
                                 "(scripts/test_slurm_real.sh does it)")
        self._write_conf()
        if not self._munge_ok():
            run_dir = Path("/run/munge")
            run_dir.mkdir(parents=True, exist_ok=True)
            shutil.chown(run_dir, "munge", "munge")
            self._daemon("munged", ["munged", "--foreground", "--force",
                                    f"--log-file={self.root / 'log' / 'munged.log'}"])
            try:
                _wait(self._munge_ok, "munge credential round trip", 30, poll=0.5)
            except CheckFailed as exc:
                raise SetupError(f"{exc}: see {self.root / 'log'}") from exc
        self._daemon("slurmctld", ["slurmctld", "-D", "-c", "-f", str(self.conf)])
        self._daemon("slurmd", ["slurmd", "-D", "-f", str(self.conf), "-N", "localhost"])

        def idle() -> bool:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise SetupError(f"{name} exited with {proc.returncode}: see {self.root / 'log'}")
            out = self.run(["sinfo", "-h", "-N", "-o", "%T"], check=False)
            return out.strip() == "idle"

        try:
            _wait(idle, "idle node in sinfo", 60, poll=1.0)
        except CheckFailed as exc:
            raise SetupError(f"{exc}: see {self.root / 'log'}") from exc

    def run(self, cmd: list[str], *, check: bool = True, timeout: float = 60) -> str:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=self.env, timeout=timeout)
        if check and proc.returncode != 0:
            raise CheckFailed(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.strip()}")
        return proc.stdout

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, Restarts, ExitCode ...); {} once the record is gone."""
        out = self.run(["scontrol", "show", "job", "-o", str(job_id)], check=False)
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def running_or_pending(self, job_id: int) -> dict[str, str]:
        """The job's record, failing at once when Slurm could not launch it (held: the slurmd log says why)."""
        info = self.job(job_id)
        if "held" in info.get("Reason", "").lower() or "launch_failed" in info.get("Reason", "").lower():
            raise CheckFailed(f"Slurm could not launch job {job_id} ({info.get('Reason')}): see "
                              f"{self.root / 'log' / 'slurmd.log'}")
        return info

    def stop(self) -> None:
        """Cancel what runs, wait for the node to drain, then end the daemons this harness started, by pid."""
        if self.procs.get("slurmctld") is not None and self.procs["slurmctld"].poll() is None:
            try:
                jobs = self.run(["squeue", "-h", "-o", "%i"], check=False).split()
                if jobs:
                    self.run(["scancel", *jobs], check=False)
                _wait(lambda: not self.run(["squeue", "-h", "-o", "%i"], check=False).split(), "empty queue", 90)
            except (CheckFailed, subprocess.TimeoutExpired, OSError) as exc:
                print(f"stop: {exc}; ending the daemons anyway", file=sys.stderr)
        for name in ("slurmd", "slurmctld", "munged"):
            _stop_child(self.procs.get(name))
        for pid in _our_step_daemons(self.first_job_id):  # a slurmstepd outliving its slurmd: ours, by pid
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.spool is not None:
            shutil.rmtree(self.spool, ignore_errors=True)


def _our_step_daemons(first_job_id: int) -> list[int]:
    """pids of slurmstepd processes of jobs in this cluster's id range (FirstJobId .. +1000)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        m = re.match(r"slurmstepd: \[(\d+)\.", cmdline)
        if m and first_job_id <= int(m.group(1)) < first_job_id + 1000:
            pids.append(int(entry.name))
    return pids


# ------------------------------------------------------------------------------------------------- the run

def _metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            pass  # a line being written
    return records


def _train_steps(records: list[dict], attempt: Optional[int] = None) -> list[int]:
    return [r["step"] for r in records if "train/pg_loss" in r and (attempt is None or r.get("attempt") == attempt)]


def _attempt_lines(log: Path) -> list[tuple[int, str]]:
    if not log.exists():
        return []
    return [(int(m.group(2)), m.group(3)) for m in map(ATTEMPT_LINE.search, log.read_text().splitlines()) if m]


def _write_job(out: Path, py: str, num_rollout: int, job_args: list[str]) -> Path:
    """The job file, written by the demo's launch script with JOB=slurm (its flags; the data prepared there)."""
    script = out / "job.sbatch"
    env = {**os.environ, "PY": py, "OUT": str(out / "run"), "NPROC": str(NPROC), "NUM_ROLLOUT": str(num_rollout),
           "JOB": "slurm", "JOB_ARGS": " ".join([*job_args, "--gpus-per-node", "0", "--cpus-per-task", str(NPROC),
                                                "--output", str(out / "job.log"), "--out", str(script),
                                                "--python", py, "--workdir", str(REPO)])}
    proc = subprocess.run(["bash", "scripts/run_demo_cpu.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    if proc.returncode != 0 or not script.exists():
        raise CheckFailed(f"JOB=slurm scripts/run_demo_cpu.sh exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return script


def phase_requeue(cluster: LocalSlurm, out: Path, py: str, figures: dict) -> None:
    script = _write_job(out, py, REQUEUE_STEPS, ["--time", "30", "--signal-lead", "120", "--job-name", "requeue"])
    test_only = subprocess.run(["sbatch", "--test-only", str(script)], capture_output=True, text=True,
                               env=cluster.env, timeout=60)
    if test_only.returncode != 0 or "to start at" not in test_only.stderr:
        raise CheckFailed(f"sbatch --test-only: exit {test_only.returncode}: {test_only.stderr.strip()}")
    figures["sbatch_test_only"] = test_only.stderr.strip().splitlines()[-1]
    run_dir, log = out / "run", out / "job.log"
    # every rank pauses once step STOP_AFTER is logged (megatron_rl/infra/pause_points.py) and the signal ends the
    # pause: the stop comes after that step however fast the machine runs the demo's 12 steps (sbatch passes the
    # environment on; the requeued attempt starts past that step, so it never pauses)
    pause_dir, spec = out / "pause", f"step_logged:{STOP_AFTER}"
    pause_dir.mkdir()
    pause_env = {**cluster.env, PAUSE_AT_ENV: spec, PAUSE_DIR_ENV: str(pause_dir)}
    t0 = time.monotonic()
    job_id = int(subprocess.run(["sbatch", "--parsable", str(script)], env=pause_env, capture_output=True,
                                text=True, check=True, timeout=60).stdout.strip().split(";")[0])
    figures["job_id"] = job_id
    _wait(lambda: cluster.running_or_pending(job_id) and all(
        os.path.exists(marker_path(str(pause_dir), spec, rank)) for rank in range(NPROC)),
          f"every rank paused at {spec}", 420, poll=0.2)
    figures["first_steps_s"] = round(time.monotonic() - t0, 1)
    cluster.run(["scancel", "--batch", "--signal=USR1", str(job_id)])  # what --signal=B:USR1@lead sends
    t_signal = time.monotonic()
    _wait(lambda: int(cluster.running_or_pending(job_id).get("Restarts", "0")) >= 1, "requeue after USR1", 300)
    figures["signal_to_requeue_s"] = round(time.monotonic() - t_signal, 1)
    done = _wait(lambda: (lambda j: j if j.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT",
                                                                "NODE_FAIL", "OUT_OF_MEMORY") else None)(
        cluster.running_or_pending(job_id)), "the requeued job's end", 600)
    figures["total_s"] = round(time.monotonic() - t0, 1)
    assert isinstance(done, dict)
    figures.update(final_state=done.get("JobState"), exit_code=done.get("ExitCode"), restarts=done.get("Restarts"))
    lines = _attempt_lines(log)
    figures["attempt_lines"] = [f"{a}: {text}" for a, text in lines]
    text = log.read_text() if log.exists() else ""
    records = _metrics(run_dir)
    status = json.loads((run_dir / "run_status.json").read_text()) if (run_dir / "run_status.json").exists() else {}
    starts = [r for r in records if r.get("attempt_start")]
    figures["attempt_starts"] = [(r.get("attempt"), r["step"]) for r in starts]
    figures["steps_by_attempt"] = {a: _train_steps(records, a) for a in sorted({r.get("attempt") for r in records})}
    figures["run_status"] = status
    problems = []
    if done.get("JobState") != "COMPLETED" or done.get("ExitCode") != "0:0" or done.get("Restarts") != "1":
        problems.append(f"job ended {done.get('JobState')} exit {done.get('ExitCode')} after {done.get('Restarts')} "
                        "restart(s); expected COMPLETED 0:0 after 1")
    if not any(a == 1 and "got SIGUSR1" in t for a, t in lines):
        problems.append("attempt 1 did not log the USR1 it was sent")
    if not any(a == 1 and "stopped early and saved (exit 3): requeued" in t for a, t in lines):
        problems.append("attempt 1 did not end with exit 3 and a requeue")
    if not re.search(r"stopped early \(received signal SIGTERM\) after rollout \d+; exit 3", text):
        problems.append("the launcher's 'stopped early (received signal SIGTERM) ... exit 3' line is missing")
    if not any(a == 2 and "finished (exit 0)" in t for a, t in lines):
        problems.append("attempt 2 did not finish with exit 0")
    if any(a == 2 and "requeued" in t for a, t in lines):
        problems.append("the finished attempt requeued the job")
    resumed = [step for attempt, step in figures["attempt_starts"] if attempt and step > 0]
    if not resumed:
        problems.append(f"no attempt started past step 0 (attempt starts {figures['attempt_starts']}): not resumed")
    final_steps = sorted(set(_train_steps([r for r in records if not r.get("superseded")])))
    if final_steps != list(range(1, REQUEUE_STEPS + 1)):  # metrics.jsonl numbers the steps 1..--num-rollout
        problems.append(f"train steps {final_steps}, expected 1..{REQUEUE_STEPS}")
    if status.get("status") != "finished":
        problems.append(f"run_status.json says {status}")
    if problems:
        raise CheckFailed("requeue phase: " + "; ".join(problems))


def phase_time_limit(cluster: LocalSlurm, out: Path, py: str, figures: dict) -> None:
    script = _write_job(out, py, 5000, ["--time", "3", "--signal-lead", "90", "--job-name", "timelimit"])
    run_dir, log = out / "run", out / "job.log"
    t0 = time.monotonic()
    job_id = int(cluster.run(["sbatch", "--parsable", str(script)]).strip().split(";")[0])
    figures["job_id"] = job_id
    _wait(lambda: int(cluster.running_or_pending(job_id).get("Restarts", "0")) >= 1,
          "requeue at the time-limit warning", 420)
    figures["warning_requeue_s"] = round(time.monotonic() - t0, 1)

    def resumed_step():
        records = _metrics(run_dir)
        # metrics.jsonl numbers attempts from 1: the second launch's start record
        start = next((r["step"] for r in records if r.get("attempt_start") and r.get("attempt", 0) >= 2), None)
        later = [s for s in _train_steps(records) if start is not None and s > start]
        return (start, later[-1]) if later else None

    resumed = _wait(resumed_step, "a step of attempt 2 past its resume point", 420)
    assert isinstance(resumed, tuple)
    figures["attempt2_resumed_at"] = resumed[0]
    cluster.run(["scancel", str(job_id)])  # the user's cancel: the run stops, the job is not requeued
    t_cancel = time.monotonic()
    gone = _wait(lambda: (lambda j: j if j.get("JobState") in ("CANCELLED", "COMPLETED", "FAILED") else None)(
        cluster.job(job_id)), "the cancelled job's end", 180)
    _wait(lambda: any(a == 2 and ("not requeued" in t or "requeued" in t or "ended with exit" in t)
                      for a, t in _attempt_lines(log)) or None, "attempt 2's last line", 60)
    figures["cancel_to_end_s"] = round(time.monotonic() - t_cancel, 1)
    figures["total_s"] = round(time.monotonic() - t0, 1)
    assert isinstance(gone, dict)
    lines = _attempt_lines(log)
    figures["attempt_lines"] = [f"{a}: {t}" for a, t in lines]
    figures.update(final_state=gone.get("JobState"), restarts=gone.get("Restarts"))
    problems = []
    if not any(a == 1 and "got SIGUSR1" in t for a, t in lines):
        problems.append("attempt 1 got no USR1 from Slurm's time-limit warning")
    if not any(a == 1 and "stopped early and saved (exit 3): requeued" in t for a, t in lines):
        problems.append("attempt 1 did not end with exit 3 and a requeue")
    if gone.get("Restarts") != "1":
        problems.append(f"{gone.get('Restarts')} restarts; expected 1 (the cancel must not requeue)")
    if gone.get("JobState") != "CANCELLED":
        problems.append(f"the cancelled job ended {gone.get('JobState')}")
    if any(a == 2 and ": requeued" in t for a, t in lines):
        problems.append("the cancelled attempt requeued the job")
    if problems:
        raise CheckFailed("time-limit phase: " + "; ".join(problems))


PHASES = {"requeue": phase_requeue, "time_limit": phase_time_limit}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="/tmp/slurm_real", help="figures.json, jobs and logs (emptied first)")
    ap.add_argument("--phases", nargs="+", choices=sorted(PHASES), default=["requeue", "time_limit"])
    ap.add_argument("--python", default=sys.executable, help="the interpreter the jobs run (default: this one)")
    args = ap.parse_args(argv)
    out = Path(args.out).resolve()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    figures: dict = {"date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "nproc": NPROC}
    cluster = LocalSlurm(out / "slurm", cpus=max(NPROC, os.cpu_count() or NPROC))
    code = 0
    t0 = time.monotonic()
    try:
        cluster.start()
        figures["slurm"] = cluster.run(["sinfo", "-V"]).strip()
        figures["cluster_start_s"] = round(time.monotonic() - t0, 1)
        for name in args.phases:
            phase: dict = {}
            figures[name] = phase
            print(f"== {name}", flush=True)
            try:
                PHASES[name](cluster, out / name, args.python, phase)
                phase["ok"] = True
            except CheckFailed as exc:
                phase.update(ok=False, error=str(exc))
                print(f"FAILED: {exc}", file=sys.stderr, flush=True)
                code = 1
                for jid in ([phase["job_id"]] if "job_id" in phase else []):
                    cluster.run(["scancel", str(jid)], check=False)
            print(json.dumps(phase, indent=1), flush=True)
    except SetupError as exc:
        figures["setup_error"] = str(exc)
        print(f"error: {exc}", file=sys.stderr)
        code = 2
    finally:
        cluster.stop()
        figures["wall_s"] = round(time.monotonic() - t0, 1)
        figures["daemons_left"] = [name for name, p in cluster.procs.items() if p.poll() is None]
        (out / "figures.json").write_text(json.dumps(figures, indent=1))
    print(f"figures: {out / 'figures.json'} ({figures['wall_s']} s)")
    return code


if __name__ == "__main__":
    sys.exit(main())

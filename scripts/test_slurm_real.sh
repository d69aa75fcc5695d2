#!/usr/bin/env bash
# Our Slurm route (tools/launch_job.py slurm, docs/launch.md) against a REAL Slurm on this machine, not part
# of the quick tiers (it starts a cluster and trains the CPU demo twice: 2.5-4 min on 2 cores).
#   bash scripts/test_slurm_real.sh [--out DIR] [--phases requeue time_limit]
# 1. installs Debian's slurm-wlm and munge with apt-get when sbatch/slurmctld are missing (root; ~1 min);
# 2. runs tools/slurm_real/check_slurm_real.py with the project's .venv: a private one-node cluster (munged,
#    slurmctld, slurmd as its children, conf and logs under --out), the job written by
#    `JOB=slurm scripts/run_demo_cpu.sh` (NPROC 2), sbatch --test-only, then
#    requeue:    USR1 to the batch shell (what --signal=B:USR1@lead sends) -> save, exit 3, requeue -> resume,
#                finish (exit 0, COMPLETED, one restart, every step in metrics.jsonl);
#    time_limit: Slurm's own time-limit warning (--time 3 --signal-lead 90) -> exit 3, requeue -> resume;
#                then scancel -> the run stops and the job is not requeued.
#    The daemons are stopped by pid at the end, whatever happened.
# Writes figures.json, the job scripts, their logs and the daemons' logs under --out (default /tmp/slurm_real).
# Exit: 0 all checks passed, 1 a check failed, 2 Slurm could not be installed or started.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || { echo "error: $PY missing; run scripts/setup_cpu.sh first" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "error: run as root (slurmd and munged are started here)" >&2; exit 2; }
if ! command -v sbatch >/dev/null || ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
  echo "installing slurm-wlm and munge (apt-get) ..." >&2
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge; } >/dev/null ||
    { echo "error: apt-get install slurm-wlm munge failed" >&2; exit 2; }
fi
export OMP_NUM_THREADS=1
# an absolute path to the same interpreter (a venv's python is a symlink: resolving it would leave the venv)
PY_ABS="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")"
exec "$PY_ABS" tools/slurm_real/check_slurm_real.py --python "$PY_ABS" "$@"

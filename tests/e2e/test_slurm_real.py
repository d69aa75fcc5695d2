"""``scripts/test_slurm_real.sh`` collected as a test: the Slurm route against the real Slurm of this machine.

Where Slurm (slurm-wlm + munge) is installed and the suite runs as root, this starts a private one-node cluster
and runs the CPU demo through the batch script ``tools/launch_job.py slurm`` writes (2.5-4 min on 2 cores): the
time-limit signal makes it save and exit 3, the job requeues itself and the next attempt resumes to the end; a
real time-limit warning does the same; a cancelled job is not requeued (tools/slurm_real/check_slurm_real.py).
Elsewhere it is skipped, saying so and naming the command that installs Slurm and runs it. The generator's
text and its exit-code logic (against stand-ins for srun and scontrol) are tests/tools/test_launch_job.py, on
every commit.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from _util import REPO

pytestmark = pytest.mark.e2e

MISSING = [tool for tool in ("slurmctld", "slurmd", "sbatch", "munged") if shutil.which(tool) is None]


@pytest.mark.skipif(bool(MISSING), reason=f"Slurm is not installed ({', '.join(MISSING)} missing): "
                    "bash scripts/test_slurm_real.sh installs slurm-wlm + munge with apt-get and runs this check")
@pytest.mark.skipif(os.geteuid() != 0, reason="Slurm is installed, but its daemons are started here as root: "
                    "run bash scripts/test_slurm_real.sh as root")
def test_slurm_requeue_and_resume_against_real_slurm(tmp_path):
    out = tmp_path / "slurm_real"
    proc = subprocess.run(["bash", "scripts/test_slurm_real.sh", "--out", str(out)], cwd=REPO, capture_output=True,
                          text=True, timeout=1500, env={**os.environ, "PY": sys.executable})
    figures_path = out / "figures.json"
    assert figures_path.exists(), f"exit {proc.returncode}, no figures:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    figures = json.loads(figures_path.read_text())
    assert figures["daemons_left"] == [], figures
    assert proc.returncode == 0, json.dumps(figures, indent=1) + proc.stderr[-3000:]
    requeue, time_limit = figures["requeue"], figures["time_limit"]
    assert requeue["ok"] and (requeue["final_state"], requeue["exit_code"], requeue["restarts"]) == \
        ("COMPLETED", "0:0", "1")
    assert time_limit["ok"] and (time_limit["final_state"], time_limit["restarts"]) == ("CANCELLED", "1")

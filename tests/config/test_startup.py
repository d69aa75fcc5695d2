"""Start-up: flag parsing (--help, refusals) answers before torch is imported (~2 s saved on each)."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e


def test_help_and_flag_errors_do_not_import_torch(tmp_path):
    code = ("import sys\n"
            "from megatron_rl.train import main\n"
            "try:\n"
            "    main(['--help'])\n"
            "except SystemExit as exc:\n"
            "    assert exc.code == 0\n"
            f"assert main(['--hf-checkpoint', {str(tmp_path)!r}, '--use-rollout-logprobs', '--use-tis']) == 2\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n"
            "print('ok')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout[-1500:] + proc.stderr[-1500:]
    assert "--use-rollout-logprobs with --use-tis" in proc.stderr

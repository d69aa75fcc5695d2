"""A test double of the ``sglang`` package: only ``python -m sglang.launch_server`` (CPU test stand-in).

Put ``tests/rollout/sglang_double`` on PYTHONPATH and the launcher's real command line starts the
protocol stand-in (``tests/rollout/sglang_standin.py``) instead of SGLang. Never installed.
"""

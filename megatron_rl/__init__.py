"""megatron_rl: RL post-training of LLMs on real megatron-core.

Importing the package is cheap: megatron-core (~15 s to import) is only pulled in
by the modules that need it (``backends.megatron``, ``models``, ``compat``).
"""

__version__ = "0.1.0"

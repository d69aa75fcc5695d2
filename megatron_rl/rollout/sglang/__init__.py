"""SGLang rollout: an HTTP client per server and ``SGLangEngine`` over servers given by URL.

First slice of issue 14 (see docs/sglang.md): no launcher and no flags yet, so
``--rollout-backend sglang`` stays refused; build ``SGLangEngine(urls=[...])``
directly. ``protocol`` is SGLang's wire format, shared with the test stand-in.
"""

from megatron_rl.rollout.sglang.client import SGLangClient, SGLangEngineError, SGLangSyncError
from megatron_rl.rollout.sglang.engine import SGLangEngine

__all__ = ["SGLangClient", "SGLangEngine", "SGLangEngineError", "SGLangSyncError"]

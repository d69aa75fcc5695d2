"""SGLang rollout: an HTTP client per server and ``SGLangEngine`` over servers given by URL.

Issue 14, slices 1-2 (see docs/sglang.md): ``--rollout-backend sglang --rollout-engine-urls URL ...``
uses servers you run yourself, weights through ``--update-weight-transport disk`` or
``distributed``; no launcher yet. ``protocol`` is SGLang's wire format, shared with the test stand-in.
"""

from megatron_rl.rollout.sglang.client import SGLangClient, SGLangEngineError, SGLangSyncError
from megatron_rl.rollout.sglang.engine import SGLangEngine

__all__ = ["SGLangClient", "SGLangEngine", "SGLangEngineError", "SGLangSyncError"]

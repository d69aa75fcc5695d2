"""SGLang rollout: an HTTP client per server (``client``), ``SGLangEngine`` over a set of servers
(``engine``), the engines' health monitor (``health``) and the launcher of the engines a run starts
itself (``launcher``); servers you run yourself come by ``--rollout-engine-urls`` (docs/sglang.md).
``protocol`` is SGLang's wire format, shared with the test stand-in.
"""

from megatron_rl.rollout.sglang.client import SGLangClient, SGLangEngineError, SGLangSyncError
from megatron_rl.rollout.sglang.engine import SGLangEngine

__all__ = ["SGLangClient", "SGLangEngine", "SGLangEngineError", "SGLangSyncError"]

"""One exception family per failure domain.

Errors are part of the interface: each message names the flag, file or value at
fault and the fix. Callers that want "any megatron_rl refusal" catch
``MegatronRLError``; tools turn it into exit code 2 with the message on stderr.
"""


class MegatronRLError(Exception):
    """Base of every error megatron_rl raises on purpose."""


class ConfigError(MegatronRLError, ValueError):
    """A flag or config-file value is invalid or inconsistent with another."""


class PlanError(MegatronRLError, ValueError):
    """An allocation string or placement does not parse or does not fit."""


class BridgeError(MegatronRLError, ValueError):
    """An HF model/config cannot be mapped to megatron-core (or back)."""


class CheckpointError(MegatronRLError):
    """A checkpoint is missing, incomplete, corrupt or does not match the model."""


class SyncError(MegatronRLError):
    """A weight update between trainer and rollout engine failed or diverged."""


class EngineError(MegatronRLError):
    """A rollout engine is unreachable, unhealthy or answered out of protocol."""


class BackendError(MegatronRLError):
    """A training backend cannot do what was asked on this machine."""

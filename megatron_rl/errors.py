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


class UserFunctionError(ConfigError):
    """A user's function named by a flag (``--custom-generate-function-path``, ``--custom-rm-path``, ...) did
    not return within its timeout or raised; the message names the flag, what happened and the function's own
    line. ``kind``: "timeout" or "raised"; ``cause``: what it raised (None for a timeout)."""

    def __init__(self, message: str, *, kind: str = "raised", cause: "BaseException | None" = None):
        super().__init__(message)
        self.kind, self.cause = kind, cause


class CollectiveTimeout(MegatronRLError):
    """A training rank did not answer a collective of a step's phase within ``--distributed-timeout-minutes``
    (``infra.collective_watch``): the message names the phase, the ranks and the bound. ``missing_ranks``: those
    ranks (empty when every rank answered the roll call after the timeout). Exit code 1: a failure, not a
    refusal of the flags."""

    exit_code = 1
    missing_ranks: "tuple[int, ...]" = ()

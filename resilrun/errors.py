"""The one error hierarchy of resilrun and the one list of exit codes.

Libraries raise these; only ``resilrun.cli`` renders them. Every error carries a message that quotes
the offending value, an optional hint that tells the user what to do, and the exit code the process
ends with.
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    """Exit status of the ``resilrun`` command (documented in the man page)."""

    OK = 0
    WORKERS_FAILED = 1
    USAGE = 2
    RENDEZVOUS = 3
    CHECKPOINT = 4
    STORAGE = 5
    INTERRUPTED = 130
    TERMINATED = 143


EXIT_CODE_MEANINGS: dict[ExitCode, str] = {
    ExitCode.OK: "the job finished and every worker exited 0",
    ExitCode.WORKERS_FAILED: "workers failed and the restart budget (--max-restarts) was spent",
    ExitCode.USAGE: "bad flags, environment variables or input files; nothing was started",
    ExitCode.RENDEZVOUS: "the rendezvous could not be reached, timed out, or was closed",
    ExitCode.CHECKPOINT: "a checkpoint was missing, corrupt or could not be written",
    ExitCode.STORAGE: "persistent storage (S3 or a directory) failed",
    ExitCode.INTERRUPTED: "stopped by SIGINT (Ctrl-C); workers were stopped",
    ExitCode.TERMINATED: "stopped by SIGTERM; workers were stopped",
}


class ResilrunError(Exception):
    """Base of every error resilrun raises on purpose."""

    exit_code: ExitCode = ExitCode.WORKERS_FAILED

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint


class ConfigError(ResilrunError):
    """A flag, environment variable or value is invalid; raised before anything starts."""

    exit_code = ExitCode.USAGE


class RendezvousError(ResilrunError):
    """The nodes of the job could not agree on a membership."""

    exit_code = ExitCode.RENDEZVOUS


class RendezvousTimeoutError(RendezvousError):
    """Not enough nodes joined before the join deadline."""


class RendezvousClosedError(RendezvousError):
    """The job was closed by another node (finished, failed or stopped)."""

    def __init__(self, message: str, *, outcome: str, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.outcome = outcome


class StoreConnectionError(RendezvousError):
    """The rendezvous store was unreachable or an operation on it timed out."""


class WorkerGroupFailed(ResilrunError):  # noqa: N818 - the name is the contract in STYLE.md
    """Workers failed and no restart is left; ``report`` names the root cause."""

    exit_code = ExitCode.WORKERS_FAILED

    def __init__(self, message: str, *, report: str, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.report = report


class CheckpointError(ResilrunError):
    """A checkpoint could not be found, read, verified or written."""

    exit_code = ExitCode.CHECKPOINT


class CheckpointNotFoundError(CheckpointError):
    """No checkpoint (or not the requested step or rank) exists where one was looked for."""


class StateLostError(CheckpointError):
    """Some ranks' state is in no tier at all (e.g. two adjacent nodes lost with --replicas 1 and no
    persistent tier): resuming is impossible and starting over would silently drop every step."""


class StateRefusedError(StateLostError):
    """The only copy of some rank's state fails its checksums or its MACs (a damaged or forged
    persisted step): training on it, or quietly on an older step, would hide that."""


class CheckpointCorruptError(CheckpointError):
    """A snapshot's bytes do not match its header or its checksums (or were forged)."""


class StorageError(ResilrunError):
    """Persistent storage failed; messages never carry credentials."""

    exit_code = ExitCode.STORAGE


class StorageNotFoundError(StorageError):
    """The object (key) does not exist; callers that expect absence catch exactly this."""


class StorageAuthError(StorageError):
    """Storage refused the caller: missing or wrong credentials, access denied, or the bucket's
    owner is not the expected one."""


class ShutdownRequested(BaseException):  # noqa: N818 - control flow, not an error
    """The agent received SIGTERM or SIGINT; workers have been stopped."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum

    @property
    def exit_code(self) -> ExitCode:
        import signal

        return ExitCode.INTERRUPTED if self.signum == signal.SIGINT else ExitCode.TERMINATED

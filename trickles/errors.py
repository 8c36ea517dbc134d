"""Errors that end a command with a one-line message instead of a traceback, and the exit statuses of ``trickles
train`` (one table, :data:`EXIT_STATUSES`; ``docs/checkpoints.md`` shows the same table, and a test holds them equal).

:class:`UserError` means "what you asked for cannot be done" (:data:`EXIT_USER`); :class:`TrainingStopped` means
"training cannot usefully go on" (:data:`EXIT_STOPPED`, or a subclass's own status). Both messages say what to change.
Everything else is a bug and keeps its traceback (:data:`EXIT_ERROR`).
"""

EXIT_OK = 0  # every step ran and the final checkpoint is complete and verified
EXIT_ERROR = 1  # an error during training (a traceback), or a rank that died
EXIT_USER = 2  # bad input, refused before any process group exists
EXIT_STOPPED = 3  # training stopped on purpose (the loss stayed non-finite)
EXIT_HANG = 4  # a communication call was stuck past parallel.timeout_s (trickles.watchdog)
EXIT_SAVES_FAILED = 5  # checkpoint saves failed: the final one, or train.max_failed_saves in a row
EXIT_TERM_UNSAVED = 6  # SIGTERM, but the stopping step's checkpoint was not saved (failed, or ranks killed)
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT)
EXIT_TERMINATED = 143  # SIGTERM, the stopping step's checkpoint saved and verified (128 + SIGTERM)

#: status -> (constant name, whether ``--max-restarts`` restarts a run that ended so, what it means)
EXIT_STATUSES = {
    EXIT_OK: ("EXIT_OK", False, "every step ran and the final checkpoint is complete and verified"),
    EXIT_ERROR: ("EXIT_ERROR", True, "an error during training (traceback), or a rank that died"),
    EXIT_USER: ("EXIT_USER", False, "bad input (config, data, checkpoint), refused before any process group exists"),
    EXIT_STOPPED: ("EXIT_STOPPED", False, "training stopped on purpose: the loss or gradients stayed non-finite"),
    EXIT_HANG: ("EXIT_HANG", True, "a communication call was stuck past parallel.timeout_s"),
    EXIT_SAVES_FAILED: (
        "EXIT_SAVES_FAILED",
        False,
        "checkpoint saves failed: the final save, or train.max_failed_saves in a row",
    ),
    EXIT_TERM_UNSAVED: (
        "EXIT_TERM_UNSAVED",
        False,
        "SIGTERM, but the stopping step's checkpoint was not saved (its save failed, or ranks were killed)",
    ),
    EXIT_INTERRUPTED: ("EXIT_INTERRUPTED", False, "interrupted (Ctrl-C)"),
    EXIT_TERMINATED: ("EXIT_TERMINATED", False, "SIGTERM, the stopping step's checkpoint saved and verified"),
}

#: Statuses after which ``--max-restarts`` does not restart the job: a restart cannot cure them.
NO_RESTART = frozenset(code for code, (_, restarts, _) in EXIT_STATUSES.items() if not restarts)


class UserError(Exception):
    """A mistake in the user's input; the message says what to change."""

    exit_code = EXIT_USER


class ConfigError(UserError):
    """An unknown key, a wrong type or an impossible value in the configuration."""


class DataError(UserError):
    """A data source that does not exist or cannot be read."""


class CheckpointError(UserError):
    """A checkpoint that is missing, incomplete, truncated or altered."""


class TrainingStopped(Exception):
    """Training stopped on purpose (e.g. the loss stayed non-finite); nothing corrupt was saved."""

    exit_code = EXIT_STOPPED


class SavesFailed(TrainingStopped):
    """Checkpoint saves failed: the final one (there is no later step to try again), or ``train.max_failed_saves``
    in a row; the run stopped rather than train on unprotected (its last complete checkpoint is intact).
    ``step`` and ``reason`` are the last failed save's."""

    exit_code = EXIT_SAVES_FAILED

    def __init__(self, message: str, step: int = 0, reason: str = ""):
        super().__init__(message)
        self.step, self.reason = step, reason


class Terminated(TrainingStopped):
    """The run was asked to stop (SIGTERM) and stopped after a step, its checkpoint saved and verified."""

    exit_code = EXIT_TERMINATED


class TerminatedUnsaved(TrainingStopped):
    """The run was asked to stop (SIGTERM) and stopped after a step, but that step's checkpoint could not be saved."""

    exit_code = EXIT_TERM_UNSAVED


#: Exceptions reported as one line (``error: ...``) with their ``exit_code``.
ONE_LINE_ERRORS = (UserError, TrainingStopped)

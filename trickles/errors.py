"""Errors that end a command with a one-line message instead of a traceback.

:class:`UserError` means "what you asked for cannot be done" (exit status 2);
:class:`TrainingStopped` means "training cannot usefully go on" (exit status 3). Both messages
say what to change. Everything else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """A mistake in the user's input; the message says what to change."""

    exit_code = 2


class ConfigError(UserError):
    """An unknown key, a wrong type or an impossible value in the configuration."""


class DataError(UserError):
    """A data source that does not exist or cannot be read."""


class CheckpointError(UserError):
    """A checkpoint that is missing, incomplete, truncated or altered."""


class TrainingStopped(Exception):
    """Training stopped on purpose (e.g. the loss stayed non-finite); nothing corrupt was saved."""

    exit_code = 3


class SavesFailed(TrainingStopped):
    """Checkpoint saves failed ``train.max_failed_saves`` times in a row; the run stopped rather than train on
    unprotected (its last complete checkpoint is intact)."""

    exit_code = 1


class Terminated(TrainingStopped):
    """The run was asked to stop (SIGTERM) and stopped after a step, its checkpoint saved."""

    exit_code = 143  # 128 + SIGTERM, as a process the signal ended


#: Exceptions reported as one line (``error: ...``) with their ``exit_code``.
ONE_LINE_ERRORS = (UserError, TrainingStopped)

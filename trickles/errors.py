"""Errors that mean "what you asked for cannot be done", as opposed to bugs.

The command line prints a :class:`UserError` as one line and exits with status 2; everything
else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """A mistake in the user's input; the message says what to change."""


class ConfigError(UserError):
    """An unknown key, a wrong type or an impossible value in the configuration."""


class DataError(UserError):
    """A data source that does not exist or cannot be read."""


class CheckpointError(UserError):
    """A checkpoint that is missing, incomplete, truncated or altered."""

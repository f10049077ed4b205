"""The one exception type for mistakes a user can fix (bad config, missing data, ...).

The CLI prints a ``UserError`` as a single line and exits non-zero; anything else is a bug
and keeps its traceback.
"""


class UserError(Exception):
    """A problem with the user's input, reported as one line naming what is wrong."""


class ConfigError(UserError):
    """A config key with a bad value, type or name."""

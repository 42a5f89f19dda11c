"""Errors that are the user's to fix: reported as one line, never as a traceback."""


class UserError(ValueError):
    """A problem with flags, data, files or the environment that the message tells the user how to fix."""

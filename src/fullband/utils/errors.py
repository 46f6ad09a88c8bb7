"""Errors a user can fix: the command line prints them as one line and exits with code 2."""


class UsageError(Exception):
    """A problem the user can fix (bad option values, missing files); printed as one line."""

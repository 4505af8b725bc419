"""One exception type for every user-facing error, so the CLI can print it as one line."""

from __future__ import annotations


class AttnkitError(Exception):
    """An error a user can fix; its message is one line that names the input and what is allowed."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class UsageError(AttnkitError):
    """The command line itself is wrong (a missing or malformed argument): exit status 2, like argparse."""

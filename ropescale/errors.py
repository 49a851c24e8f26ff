"""The one base class of every error ropescale raises for a user's input.

``RopescaleError`` marks a mistake in what the user asked for (an unknown strategy, a parameter out
of range, an unreadable file, a folder holding another run, a device that is not there): its
message is one line that says what to change, and the CLI prints just that line. Anything else
that escapes is a bug, which the CLI shows with its traceback and a line asking to report it.

Subclasses keep the built-in base they always had (``ValueError``, ``KeyError``), so code catching
those goes on working.
"""

from __future__ import annotations

__all__ = ["InvalidInput", "OutputError", "RopescaleError"]


class RopescaleError(Exception):
    """A user's input cannot be used; ``str(err)`` is the one line to show."""


class InvalidInput(RopescaleError, ValueError):
    """A value is out of range or of the wrong kind (a strategy parameter, an option, a length)."""


class OutputError(RopescaleError, ValueError):
    """A results or export folder cannot be used (not writable, a file, a full disk)."""

"""Errors a user can cause, and how the command line shows them.

Every error anchor-rl raises for something the user can fix carries a one-line cause and,
where there is one, the fix. The ``anchor-rl`` command prints such an error on one screen
and exits with a non-zero code; ``--debug`` (or ``ANCHOR_RL_DEBUG=1``) adds the traceback.
"""

from __future__ import annotations


class AnchorRLError(Exception):
    """An error with a message for the user (cause, then what to do)."""


class NonFiniteError(AnchorRLError, FloatingPointError):
    """A loss or a gradient norm turned NaN or infinite; raised before the optimiser step
    that would have applied it."""


class DatasetError(AnchorRLError, ValueError):
    """A dataset file or its format does not fit: the message names the file and the row."""


class ConfigError(AnchorRLError, ValueError):
    """A configuration value, key or file is invalid; the message names the field."""


class UnknownNameError(AnchorRLError, KeyError):
    """A name (task, estimator, engine, component...) that nothing registered; the message
    lists the registered names."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class BadArgumentsError(AnchorRLError, TypeError):
    """Keyword arguments a constructor does not take; the message lists those it does."""

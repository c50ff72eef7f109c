"""Learner ranks' entry points that exit before they join the process group, as a rank
whose new process fails to import or unpickle its arguments does, or in its rendezvous (the
spawned process imports this module by name: the tests' directory is on its path)."""

from __future__ import annotations

import sys


def exit_before_joining(*args: object) -> None:
    sys.exit(3)


def exit_after_joining(*args: object) -> None:
    """Signal that the rank is joining (its event, the seventh argument of
    ``learners._learner_main``), then exit with code 4 instead of joining: a rank that dies
    in the process group's rendezvous."""
    args[6].set()  # type: ignore[attr-defined]
    sys.exit(4)

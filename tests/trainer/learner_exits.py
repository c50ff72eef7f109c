"""A learner rank's entry point that exits before it joins the process group, as a rank
whose new process fails to import or unpickle its arguments does (the spawned process
imports this module by name: the tests' directory is on its path)."""

from __future__ import annotations

import sys


def exit_before_joining(*args: object) -> None:
    sys.exit(3)

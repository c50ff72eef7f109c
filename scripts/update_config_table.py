"""Rewrite the config reference table of docs/training.md from the config's own field docs.

    python scripts/update_config_table.py

The table is the block of rows under the ``| key | default | meaning |`` header of the
"Config reference" section (what ``anchor-rl train --list-fields`` prints); a test checks
that every field is listed with its default.
"""

from __future__ import annotations

from pathlib import Path

from anchor_rl.trainer.config import describe

DOC = Path(__file__).parents[1] / "docs" / "training.md"
HEADER = "| key | default | meaning |"


def main() -> None:
    lines = DOC.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(HEADER)) + 2
    end = start
    while end < len(lines) and lines[end].startswith("| `"):
        end += 1
    rows = [f"| `{key}` | `{default}` | {doc} |" for key, default, doc in describe()]
    DOC.write_text("\n".join([*lines[:start], *rows, *lines[end:]]) + "\n")


if __name__ == "__main__":
    main()

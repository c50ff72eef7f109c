"""``python -m anchor_rl.cli``: the ``anchor-rl`` command."""

from anchor_rl.cli import main

main()

"""The TRL versions the plug-in supports.

The trainers override private hooks of TRL's ``GRPOTrainer`` (``_generate``,
``_generate_and_score_completions``, ``_calculate_rewards``, ``_compute_loss``,
``_get_per_token_logps_and_entropies``); TRL may change them in any release, so the
plug-in refuses a version it was not tested with. Importing
``anchor_rl.integrations.trl`` checks the installed one.
"""

from __future__ import annotations

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from anchor_rl.errors import AnchorRLError

SUPPORTED_TRL = ">=1.16.0,<1.17"
"""TRL releases whose private ``GRPOTrainer`` hooks the plug-in is written and tested against."""
INSTALL_HINT = f'pip install "trl{SUPPORTED_TRL}" datasets'


class UnsupportedTRLError(AnchorRLError, ImportError):
    """The installed TRL is missing or outside :data:`SUPPORTED_TRL`."""


def check_trl_version(version: str) -> None:
    """UnsupportedTRLError naming the supported range unless ``version`` lies inside it."""
    try:
        ok = Version(version) in SpecifierSet(SUPPORTED_TRL, prereleases=True)
    except InvalidVersion:
        ok = False
    if not ok:
        raise UnsupportedTRLError(
            f"anchor_rl.integrations.trl supports TRL {SUPPORTED_TRL}, found {version}: its "
            f"trainers override private GRPOTrainer hooks that other releases change; "
            f"{INSTALL_HINT}"
        )

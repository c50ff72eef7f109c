"""Verifiers: plain strings in, floats out (math, QA, format, PVPO manager, overlong).

Modules: ``qa`` (normalize_answer, exact_match, f1, cover_exact_match), ``math``
(math_equal, MathVerifier), ``extract`` (extract_answer), ``format`` (format_ok),
``pvpo`` (reward), ``overlong`` (soft_punishment), ``safe`` (SafeVerifier) and
``functions`` (TRL-convention reward functions, re-exported here).
"""

from anchor_rl.rewards import extract, format, math, overlong, pvpo, qa, safe
from anchor_rl.rewards.extract import extract_answer
from anchor_rl.rewards.functions import (
    REWARD_FUNCTIONS,
    format_reward,
    get_reward_function,
    math_reward,
    pvpo_reward,
    qa_cem_reward,
    qa_em_reward,
    qa_f1_reward,
)
from anchor_rl.rewards.safe import SafeVerifier

__all__ = [
    "REWARD_FUNCTIONS",
    "SafeVerifier",
    "extract",
    "extract_answer",
    "format",
    "format_reward",
    "get_reward_function",
    "math",
    "math_reward",
    "overlong",
    "pvpo",
    "pvpo_reward",
    "qa",
    "qa_cem_reward",
    "qa_em_reward",
    "qa_f1_reward",
    "safe",
]

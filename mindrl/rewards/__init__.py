"""Rule rewards: the verifier registry, built-in verifiers, the overlong penalty, the scorer."""

from mindrl.rewards.pool import VerifierCrash
from mindrl.rewards.registration import register_verifier
from mindrl.rewards.registry import get_verifier, known_verifiers
from mindrl.rewards.scorer import RewardScorer, ScoreResult

__all__ = ["RewardScorer", "ScoreResult", "VerifierCrash", "get_verifier", "known_verifiers", "register_verifier"]

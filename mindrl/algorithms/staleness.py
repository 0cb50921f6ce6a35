"""How stale an asynchronous batch is: per-token policy versions against the version being updated.

A token's staleness is `version − token_versions`, the number of updates between the policy that
sampled it and the one it now trains. A multi-turn or partially regenerated response mixes versions,
and its oldest token bounds how off-policy the sample is, so the per-sample figures and the
scheduler's bound count the oldest token, not the last (verl PR 7569 fixed exactly that).
"""

from __future__ import annotations

import torch


def oldest_version(token_versions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[batch] the oldest policy version among each row's masked tokens, for a scheduler's staleness bound.

    A row with an empty mask gets the dtype's largest integer: newer than any real version, so a bound
    `version − oldest_version(...) <= max_staleness` never rejects it.
    """
    if token_versions.shape != mask.shape:
        raise ValueError(f"token_versions {tuple(token_versions.shape)} and mask {tuple(mask.shape)} must have "
                         f"one shape.")
    newest = torch.iinfo(token_versions.dtype).max
    return token_versions.masked_fill(~mask.bool(), newest).amin(-1)


@torch.no_grad()
def staleness_metrics(token_versions: torch.Tensor, mask: torch.Tensor, version: int,
                      is_weights: torch.Tensor | None = None,
                      log_prob_gap: torch.Tensor | None = None) -> dict[str, float]:
    """Staleness over the masked tokens; over the stale ones (older than `version`), given the loss's importance
    weights, their spread, and given `log_prob_gap` (π_prox − π_behav per token, in log space) its mean size. The
    fresh tokens' gap is the engine/trainer mismatch the `rollout_is/*` figures report; these are kept apart.

    Token figures weight every masked token alike; sample figures average over rows with at least
    one masked token. With no masked token at all every figure is 0; with no stale one the stale figures are left
    out.
    """
    keep = mask.bool()
    staleness = (version - token_versions).masked_fill(~keep, 0)
    if (staleness < 0).any():
        raise ValueError(f"a response token carries a policy version newer than the one being updated "
                         f"({version}); the versions must count the same updates.")
    staleness = staleness.double()
    token_count = keep.sum(-1)
    rows = token_count > 0
    tokens = token_count.sum().clamp(min=1).item()
    samples = rows.sum().clamp(min=1).item()
    oldest = (version - oldest_version(token_versions, keep)[rows]).double()
    sample_mean = staleness[rows].sum(-1) / token_count[rows]
    metrics = {
        "async/staleness_mean": staleness.sum().item() / tokens,
        "async/staleness_max": staleness.max().item() if keep.any() else 0.0,
        "async/staleness_oldest_token_mean": oldest.sum().item() / samples,
        "async/staleness_sample_mean": sample_mean.sum().item() / samples,
        "async/off_policy_token_share": (staleness > 0).sum().item() / tokens,
        "async/off_policy_sample_share": (oldest > 0).sum().item() / samples,
    }
    stale = keep & (staleness > 0)
    if not stale.any():
        return metrics
    if is_weights is not None:
        weights = is_weights.detach().double()[stale]
        metrics |= {
            "async/is_weight_mean": weights.mean().item(),
            # population std: a batch of one token has spread 0, not NaN
            "async/is_weight_std": weights.std(correction=0).item(),
            "async/is_weight_min": weights.min().item(),
            "async/is_weight_max": weights.max().item(),
            "async/is_weight_masked_share": (weights == 0).sum().item() / weights.numel(),
        }
    if log_prob_gap is not None:
        metrics["async/stale_abs_log_prob_diff_mean"] = log_prob_gap.detach().double()[stale].abs().mean().item()
    return metrics

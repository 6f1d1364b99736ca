"""Goodness-of-fit for the statistical sampling tests."""

import math

import numpy as np

# Significance of every statistical test: a correct sampler fails at most once in
# a thousand seeds, and the seeds are fixed, so a run is reproducible.
ALPHA = 1e-3


def chi_square_p_value(counts: np.ndarray, probs: np.ndarray) -> float:
    """P-value of observed counts against expected probabilities.

    Bins expected to hold fewer than 5 samples are pooled, and the chi-square
    tail uses the Wilson-Hilferty normal approximation.
    """
    n = counts.sum()
    order = np.argsort(probs)
    small = np.cumsum(probs[order] * n) < 5
    pooled_c = [counts[order][small].sum()] + list(counts[order][~small])
    pooled_e = [probs[order][small].sum() * n] + list(probs[order][~small] * n)
    if pooled_e[0] == 0:
        assert pooled_c[0] == 0, "sampled a token of probability zero"
        pooled_c, pooled_e = pooled_c[1:], pooled_e[1:]
    x = sum((c - e) ** 2 / e for c, e in zip(pooled_c, pooled_e))
    k = len(pooled_e) - 1
    z = ((x / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2))

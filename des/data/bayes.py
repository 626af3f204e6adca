"""What the data generators share: Zipf ranks and the Bayes-optimal metrics of the labels they draw.

    >>> true_click_probabilities = np.array([0.1, 0.2, 0.5, 0.9])
    >>> stats = BayesStats(); stats.add(true_click_probabilities); stats.auc(), stats.logloss()
    (0.8452685421994883, 0.46092888772025736)
"""
from __future__ import annotations

import numpy as np


def zipf_cdf(card: int, a: float) -> np.ndarray:
    """The cumulative distribution of ranks 1..card with P(k) proportional to 1/k^a."""
    p = 1.0 / np.arange(1, card + 1) ** a
    return np.cumsum(p / p.sum())


class BayesStats:
    """Expected AUC and log loss of the true probabilities (streaming, by histogram)."""

    BINS = 200_000

    def __init__(self):
        self.pos = np.zeros(self.BINS)
        self.neg = np.zeros(self.BINS)
        self.ll, self.n = 0.0, 0

    def add(self, prob: np.ndarray) -> None:
        b = np.minimum((prob * self.BINS).astype(np.int64), self.BINS - 1)
        self.pos += np.bincount(b, prob, self.BINS)
        self.neg += np.bincount(b, 1 - prob, self.BINS)
        pc = np.clip(prob, 1e-12, 1 - 1e-12)
        self.ll += float(-(pc * np.log(pc) + (1 - pc) * np.log(1 - pc)).sum())
        self.n += len(prob)

    def auc(self) -> float:
        neg_below = np.cumsum(self.neg) - self.neg
        return float((self.pos * (neg_below + 0.5 * self.neg)).sum() / (self.pos.sum() * self.neg.sum()))

    def logloss(self) -> float:
        return self.ll / self.n

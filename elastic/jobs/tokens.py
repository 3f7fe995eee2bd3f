"""Generated token sequences: a data set a language model can learn, with no download.

A fixed random "grammar" (seeded by ``grammar_seed``) gives every token a few likely successors;
a sequence is a walk through it. Each sequence is drawn from its own seed (the grammar's seed and
the sequence's number), so the same key gives the same tokens on any rank, in any round, in any
restart: what exactly-once training needs of a data set. A validation set is the numbers after
the training set's: the same grammar, never the same sequence.
"""

from __future__ import annotations

import bisect

import torch

SUCCESSORS = 3  # likely next tokens per token
LIKELY = 0.9  # the probability that the next token is one of them


class TokenSequences:
    """``count`` sequences of ``length`` tokens below ``vocab``, numbered from ``first``.

    A sample is ``(tokens,)``, read by an ``(epoch, index)`` key (training) or an index.

    The next token is, with probability :data:`LIKELY`, one of its predecessor's
    :data:`SUCCESSORS` (by their weights), else any token alike. One uniform draw decides both:
    below ``LIKELY`` it picks among the successors, above it among the whole vocabulary. The
    grammar is ``vocab x SUCCESSORS``: a vocabulary of a real model's size costs kilobytes, where
    a dense ``vocab x vocab`` table of the same distribution took 4 GB at 32,768."""

    def __init__(self, vocab: int, length: int, count: int, grammar_seed: int, first: int = 0):
        self.vocab, self.length, self.count = vocab, length, count
        self.first, self.seed = first, grammar_seed
        g = torch.Generator().manual_seed(grammar_seed)
        successors = torch.randint(0, vocab, (vocab, SUCCESSORS), generator=g)
        weights = torch.rand(vocab, SUCCESSORS, generator=g) + 0.5
        shares = (weights / weights.sum(1, keepdim=True)).cumsum(1) * LIKELY
        self.successors: list[list[int]] = successors.tolist()
        self.shares: list[list[float]] = shares.tolist()  # each row's last entry is LIKELY

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, key: tuple[int, int] | int) -> tuple[torch.Tensor]:
        index = key[1] if isinstance(key, tuple) else key
        if not 0 <= index < self.count:
            raise IndexError(f"sequence {index} of {self.count}")
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.first + index)
        draws = torch.rand(self.length, generator=g).tolist()
        tokens = [min(int(draws[0] * self.vocab), self.vocab - 1)]
        for u in draws[1:]:
            tokens.append(self._next(tokens[-1], u))
        return (torch.tensor(tokens, dtype=torch.int64),)

    def _next(self, token: int, u: float) -> int:
        """The token after ``token`` for the uniform draw ``u``."""
        shares = self.shares[token]
        if u < shares[-1]:
            return self.successors[token][bisect.bisect_right(shares, u)]
        rest = (u - shares[-1]) / (1 - shares[-1])  # uniform in [0, 1) again
        return min(int(rest * self.vocab), self.vocab - 1)

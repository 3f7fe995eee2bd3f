"""Generated token sequences: a data set a language model can learn, with no download.

A fixed random "grammar" (seeded by ``grammar_seed``) gives every token a few likely successors;
a sequence is a walk through it. Each sequence is drawn from its own seed (the grammar's seed and
the sequence's number), so the same key gives the same tokens on any rank, in any round, in any
restart: what exactly-once training needs of a data set. A validation set is the numbers after
the training set's: the same grammar, never the same sequence.
"""

from __future__ import annotations

import torch

SUCCESSORS = 3  # likely next tokens per token
LIKELY = 0.9  # the probability that the next token is one of them


class TokenSequences:
    """``count`` sequences of ``length`` tokens below ``vocab``, numbered from ``first``.

    A sample is ``(tokens,)``, read by an ``(epoch, index)`` key (training) or an index."""

    def __init__(self, vocab: int, length: int, count: int, grammar_seed: int, first: int = 0):
        self.length, self.count, self.first, self.seed = length, count, first, grammar_seed
        g = torch.Generator().manual_seed(grammar_seed)
        successors = torch.randint(0, vocab, (vocab, SUCCESSORS), generator=g)
        weights = torch.rand(vocab, SUCCESSORS, generator=g) + 0.5
        table = torch.full((vocab, vocab), (1 - LIKELY) / vocab)
        table.scatter_add_(1, successors, LIKELY * weights / weights.sum(1, keepdim=True))
        self.cumulative = table.cumsum(1)  # each row's last entry is 1 (to rounding)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, key: tuple[int, int] | int) -> tuple[torch.Tensor]:
        index = key[1] if isinstance(key, tuple) else key
        if not 0 <= index < self.count:
            raise IndexError(f"sequence {index} of {self.count}")
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.first + index)
        draws = torch.rand(self.length, generator=g)
        tokens = torch.empty(self.length, dtype=torch.int64)
        tokens[0] = int(draws[0] * len(self.cumulative))
        for i in range(1, self.length):
            row = self.cumulative[tokens[i - 1]]
            tokens[i] = torch.searchsorted(row, draws[i]).clamp_(max=len(row) - 1)
        return (tokens,)

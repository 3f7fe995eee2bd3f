"""A small decoder-only transformer.

It has token and position embeddings, torch's pre-norm encoder layers under a causal mask, and a
linear head to the next token's logits."""

from __future__ import annotations

import torch
from torch import nn


class TinyLM(nn.Module):
    def __init__(self, vocab: int, context: int, dim: int, heads: int, layers: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Embedding(context, dim)
        layer = nn.TransformerEncoderLayer(
            dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True
        )
        # No nested-tensor fast path: it needs a padding mask, and its output layout differs.
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """The logits ``(batch, length, vocab)`` of each position's next token."""
        length = tokens.shape[1]
        x = self.tokens(tokens) + self.positions(torch.arange(length, device=tokens.device))
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=tokens.device)
        return self.head(self.norm(self.blocks(x, mask=mask, is_causal=True)))

"""The generalization suite's factory model (`factory = "bench.factory_model:build"`, docs/spec.md): PyTorch's
own `nn.TransformerEncoderLayer` blocks between a token-and-position embedding and a vocabulary head, so that
the suite also predicts a model whose blocks the project did not write.

Rules of the contract: `layers` counts every layer, the embedding and the head included (so layers >= 3); the
blocks take the spec's hidden, heads and ffn (pre-LayerNorm, GELU, no dropout, batch first); it builds on the
meta device.
"""
from __future__ import annotations

import torch
from torch import nn


class TokenAndPositionEmbedding(nn.Module):
    """Token ids (micro, seq) to hidden states: a learned table for tokens and one for positions."""

    def __init__(self, vocab: int, seq_len: int, hidden: int):
        super().__init__()
        self.tokens = nn.Embedding(vocab, hidden)
        self.positions = nn.Embedding(seq_len, hidden)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        return self.tokens(ids) + self.positions(positions)


class VocabularyHead(nn.Module):
    """Hidden states to logits: a final LayerNorm and a projection onto the vocabulary."""

    def __init__(self, hidden: int, vocab: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.projection = nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.projection(self.norm(x))


def build(model) -> list[nn.Module]:
    """The embedding, (layers - 2) `nn.TransformerEncoderLayer` blocks and the head, for a validated ModelSpec."""
    if model.layers < 3:
        raise ValueError(f"layers = {model.layers}: this model needs at least 3 (an embedding, a block, a head)")
    blocks = [nn.TransformerEncoderLayer(d_model=model.hidden, nhead=model.heads, dim_feedforward=model.ffn,
                                         dropout=0.0, activation="gelu", batch_first=True, norm_first=True)
              for _ in range(model.layers - 2)]
    return [TokenAndPositionEmbedding(model.vocab, model.seq_len, model.hidden), *blocks,
            VocabularyHead(model.hidden, model.vocab)]

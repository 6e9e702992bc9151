"""A user's factory model for tests: the contract of docs/spec.md ("module:function")."""
from torch import nn


class Embed(nn.Module):
    def __init__(self, vocab: int, width: int):
        super().__init__()
        self.table = nn.Embedding(vocab, width)

    def forward(self, ids):
        return self.table(ids)


class Mixer(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


def build(model):
    """Embedding, (layers - 2) identical residual MLP blocks, and a vocabulary projection."""
    width = model.hidden or 32
    return [Embed(model.vocab, width), *(Mixer(width) for _ in range(model.layers - 2)),
            nn.Linear(width, model.vocab)]


def not_layers(model):
    """A factory that breaks the contract: a number, not a sequence of layers."""
    return 42


def exits(model):
    """A factory that breaks the contract another way: it ends the process instead of returning layers."""
    raise SystemExit(0)


class BreaksOnRealTensors(nn.Module):
    """Described fine on the meta device; its forward fails on real tensors (a user's bug found only when run)."""

    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        if x.is_meta:
            return self.linear(x)
        return self.linear(x[..., :1])  # the user's bug: the wrong slice


def breaks_on_real_tensors(model):
    """`build`'s model with its second layer broken on real tensors."""
    width = model.hidden or 32
    return [Embed(model.vocab, width), BreaksOnRealTensors(width), *(Mixer(width) for _ in range(model.layers - 3)),
            nn.Linear(width, model.vocab)]

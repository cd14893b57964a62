"""torch twins of the training models, for tests and benchmarks (torch is an optional extra).

Each twin has the architecture of its ``training.models`` builder, and :func:`load_params`
copies a :class:`Model`'s initial parameters into it (linear weights transposed: ours are
(in, out), ``nn.Linear``'s (out, in)), so both start from the same weights.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .step import Model


def _torch() -> Any:
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - torch is a test extra
        raise ImportError("tpp_tvm.training.reference needs torch") from exc
    return torch


def mlp(sizes: list[int], activation: str = "relu") -> Any:
    """``nn.Sequential`` of Linear (+activation) layers named like ``models.mlp``."""
    nn = _torch().nn
    act = {"relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh, "sigmoid": nn.Sigmoid}[activation]
    layers: dict[str, Any] = {}
    for i, (fi, fo) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers[f"fc{i}"] = nn.Linear(fi, fo)
        if i < len(sizes) - 2:
            layers[f"act{i}"] = act()
    from collections import OrderedDict

    return nn.Sequential(OrderedDict(layers))


def bert_layer(hidden: int, heads: int, intermediate: int, eps: float = 1e-12) -> Any:
    """The post-LN BERT encoder layer of ``models.bert_layer``."""
    torch = _torch()
    nn = torch.nn

    class BertLayer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.heads = heads
            self.q, self.k, self.v, self.o = (nn.Linear(hidden, hidden) for _ in range(4))
            self.ln1 = nn.LayerNorm(hidden, eps=eps)
            self.ffn1 = nn.Linear(hidden, intermediate)
            self.ffn2 = nn.Linear(intermediate, hidden)
            self.ln2 = nn.LayerNorm(hidden, eps=eps)

        def forward(self, x: Any) -> Any:
            b, s, h = x.shape
            dh = h // self.heads

            def split(t: Any) -> Any:
                return t.view(b, s, self.heads, dh).permute(0, 2, 1, 3)

            q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
            probs = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(dh), dim=-1)
            ctx = (probs @ v).permute(0, 2, 1, 3).reshape(b, s, h)
            h1 = self.ln1(self.o(ctx) + x)
            return self.ln2(self.ffn2(torch.nn.functional.gelu(self.ffn1(h1))) + h1)

    return BertLayer()


def small_cnn(channels: int = 3, size: int = 16, width: int = 8, classes: int = 10) -> Any:
    """The conv-relu-pool x2, linear network of ``models.small_cnn``."""
    nn = _torch().nn
    from collections import OrderedDict

    return nn.Sequential(OrderedDict([
        ("conv0", nn.Conv2d(channels, width, 3, padding=1)), ("relu0", nn.ReLU()),
        ("pool0", nn.MaxPool2d(2)),
        ("conv1", nn.Conv2d(width, 2 * width, 3, padding=1)), ("relu1", nn.ReLU()),
        ("pool1", nn.MaxPool2d(2)),
        ("flatten", nn.Flatten()), ("fc", nn.Linear(2 * width * (size // 4) ** 2, classes)),
    ]))


def _is_linear_weight(module: Any, name: str) -> bool:
    owner = module.get_submodule(name.rsplit(".", 1)[0])
    return name.endswith(".weight") and isinstance(owner, _torch().nn.Linear)


def load_params(module: Any, model: Model) -> Any:
    """Copy ``model``'s initial parameters into the twin ``module`` (by name); returns it."""
    torch = _torch()
    named = dict(module.named_parameters())
    missing = set(model.params) ^ set(named)
    if missing:
        raise ValueError(f"twin and model parameters differ: {sorted(missing)}")
    with torch.no_grad():
        for name, value in model.params.items():
            value = value.T if _is_linear_weight(module, name) else value
            named[name].copy_(torch.tensor(np.ascontiguousarray(value)).reshape(
                named[name].shape))
    return module


def read_params(module: Any) -> dict[str, np.ndarray]:
    """The twin's parameters in the model's layout (for comparing after training)."""
    return {name: (p.detach().numpy().T if _is_linear_weight(module, name)
                   else p.detach().numpy())
            for name, p in module.named_parameters()}

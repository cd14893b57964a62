"""Local model generators: ONNX models built from plain torch modules with random weights.

Tests and benchmarks need real exported graphs (the op sequences ``torch.onnx.export`` really
produces), but this project never downloads weights and cannot use torchvision or
transformers. So each generator writes the architecture in plain torch, initialises it from a
fixed seed, and exports it with the TorchScript exporter (``dynamo=False``, opset 17; the
dynamo exporter needs onnxscript, which is not installed). Every call with the same arguments
returns the same model, and :func:`example_inputs` gives the same inputs.

Each generator takes ``cache_dir``: when given, the export is stored there under a name made of
the generator's arguments and loaded from there next time, so benchmarks do not re-export.

torch is imported lazily (it is a test/benchmark extra, never a run-time dependency).
"""

from __future__ import annotations

import io
import math
import os
import tempfile
import warnings
import zlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper

OPSET = 17
SEED = 0
# Part of every cache file name: bump it when a generator's graph or weights change.
_CACHE_VERSION = 1

# metadata_props key prefix saying how example_inputs fills an input ("normal" or "mask").
_EXAMPLE_KEY = "tpp_tvm.example."


def _torch() -> Any:
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - torch is a test extra
        raise ImportError(
            "tpp_tvm.models needs torch to export models (pip install 'tpp_tvm[test]')"
        ) from exc
    return torch


def _cache_name(kind: str, args: dict[str, Any]) -> str:
    parts = [kind, f"v{_CACHE_VERSION}", f"op{OPSET}"]
    for key, value in args.items():
        if isinstance(value, list | tuple):
            value = "x".join(str(v) for v in value)
        parts.append(f"{key}{value}")
    return "_".join(parts) + ".onnx"


def _cached(
    kind: str, args: dict[str, Any], cache_dir: str | os.PathLike | None, build: Callable[[], bytes]
) -> onnx.ModelProto:
    """Load ``kind(args)`` from ``cache_dir`` or build, store and return it."""
    if cache_dir is None:
        return onnx.load_from_string(build())
    path = Path(cache_dir) / _cache_name(kind, args)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        data = build()
        # Write-then-rename: concurrent benchmark processes never read a half-written file.
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return onnx.load(path)


def _export(
    module: Any,
    example: Sequence[Any],
    input_names: Sequence[str],
    example_kinds: dict[str, str] | None = None,
    dynamic_axes: dict[str, dict[int, str]] | None = None,
) -> bytes:
    """Export an eval-mode torch module to ONNX bytes (static shapes unless ``dynamic_axes``)."""
    torch = _torch()
    module.eval()
    buf = io.BytesIO()
    with torch.no_grad(), warnings.catch_warnings():
        # The TorchScript exporter's deprecation notice is expected here (see module docstring).
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        torch.onnx.export(
            module,
            tuple(example),
            buf,
            opset_version=OPSET,
            dynamo=False,
            input_names=list(input_names),
            output_names=["output"],
            do_constant_folding=True,
            dynamic_axes=dynamic_axes,
        )
    model = onnx.load_from_string(buf.getvalue())
    for name, kind in (example_kinds or {}).items():
        helper.set_model_props(
            model,
            {**{p.key: p.value for p in model.metadata_props}, _EXAMPLE_KEY + name: kind},
        )
    return model.SerializeToString()


def _seeded(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` with torch's RNG seeded to SEED, leaving the caller's RNG untouched."""
    torch = _torch()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        return fn()


def _randomize_norms(module: Any, calibrate: Any = None) -> None:
    """Give LayerNorm/BatchNorm non-trivial affine parameters (and BatchNorm real statistics).

    Identity norms would hide a converter that drops gamma/beta. BatchNorm statistics come
    from one training-mode pass over ``calibrate`` so activations stay O(1) through deep nets.
    """
    torch = _torch()
    norms = [
        m for m in module.modules() if isinstance(m, torch.nn.LayerNorm | torch.nn.BatchNorm2d)
    ]
    with torch.no_grad():
        for m in norms:
            m.weight.copy_(1.0 + 0.1 * torch.randn_like(m.weight))
            m.bias.copy_(0.1 * torch.randn_like(m.bias))
        if calibrate is not None:
            for m in norms:
                if isinstance(m, torch.nn.BatchNorm2d):
                    m.momentum = None  # cumulative average: one pass sets the statistics
                    m.reset_running_stats()
            module.train()
            module(calibrate)
    module.eval()


# --------------------------------------------------------------------------------------------
# MLP


_MLP_ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "none")


def mlp_torch(dims: Sequence[int], activation: str) -> Any:
    """The torch module :func:`mlp` exports, with the same weights: for peers that run the
    model in torch (benchmarks)."""
    torch = _torch()
    nn = torch.nn

    def make() -> Any:
        layers: list[Any] = []
        for i, (d_in, d_out) in enumerate(zip(dims[:-1], dims[1:], strict=True)):
            layers.append(nn.Linear(d_in, d_out))
            if i < len(dims) - 2 and activation != "none":
                layers.append(
                    {
                        "gelu": lambda: nn.GELU(),
                        "gelu_tanh": lambda: nn.GELU(approximate="tanh"),
                        "relu": lambda: nn.ReLU(),
                    }[activation]()
                )
        return nn.Sequential(*layers)

    return _seeded(make)


def mlp(
    batch: int = 64,
    dims: Sequence[int] = (1024, 4096, 4096, 1024),
    activation: str = "gelu",
    *,
    cache_dir: str | os.PathLike | None = None,
) -> onnx.ModelProto:
    """A stack of ``nn.Linear`` layers, ``activation`` after each but the last.

    Input ``input`` is ``[batch, dims[0]]``; 2-D inputs export each Linear as one ``Gemm``
    (``transB=1``) and exact GELU as ``Div, Erf, Add, Mul, Mul``. Tiny: ``mlp(4, (16, 32, 8))``.
    """
    if activation not in _MLP_ACTIVATIONS:
        raise ValueError(f"activation {activation!r} is not one of {_MLP_ACTIVATIONS}")
    if len(dims) < 2:
        raise ValueError(f"dims needs at least an input and an output size, got {dims}")
    dims = tuple(int(d) for d in dims)

    def build() -> bytes:
        module = mlp_torch(dims, activation)
        return _export(module, [_torch().zeros(batch, dims[0])], ["input"])

    args = {"b": batch, "d": dims, "act": activation}
    return _cached("mlp", args, cache_dir, build)


# --------------------------------------------------------------------------------------------
# BERT encoder


def _bert_module(layers: int, hidden: int, heads: int, intermediate: int) -> Any:
    torch = _torch()
    nn = torch.nn

    class SelfAttention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.heads, self.head_dim = heads, hidden // heads
            self.query = nn.Linear(hidden, hidden)
            self.key = nn.Linear(hidden, hidden)
            self.value = nn.Linear(hidden, hidden)
            self.dense = nn.Linear(hidden, hidden)
            self.norm = nn.LayerNorm(hidden, eps=1e-12)

        def split(self, x: Any) -> Any:
            b, s, _ = x.shape
            return x.view(b, s, self.heads, self.head_dim).permute(0, 2, 1, 3)

        def forward(self, x: Any, mask: Any) -> Any:
            q, k, v = self.split(self.query(x)), self.split(self.key(x)), self.split(self.value(x))
            scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_dim)
            probs = torch.softmax(scores + mask, dim=-1)
            ctx = torch.matmul(probs, v).permute(0, 2, 1, 3).contiguous()
            b, s = ctx.shape[0], ctx.shape[1]
            ctx = ctx.view(b, s, self.heads * self.head_dim)
            return self.norm(self.dense(ctx) + x)

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attention = SelfAttention()
            self.intermediate = nn.Linear(hidden, intermediate)
            self.output = nn.Linear(intermediate, hidden)
            self.norm = nn.LayerNorm(hidden, eps=1e-12)

        def forward(self, x: Any, mask: Any) -> Any:
            a = self.attention(x, mask)
            h = torch.nn.functional.gelu(self.intermediate(a))  # exact (erf) GELU, as BERT
            return self.norm(self.output(h) + a)

    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(Layer() for _ in range(layers))

        def forward(self, x: Any, mask: Any) -> Any:
            for layer in self.layers:
                x = layer(x, mask)
            return x

    return Encoder()


def bert_encoder_torch(layers: int, hidden: int, heads: int, intermediate: int) -> Any:
    """The torch module :func:`bert_encoder` exports, with the same weights."""

    def make() -> Any:
        module = _bert_module(layers, hidden, heads, intermediate)
        _randomize_norms(module)
        return module

    return _seeded(make)


def bert_encoder(
    layers: int = 2,
    hidden: int = 768,
    heads: int = 12,
    intermediate: int = 3072,
    seq: int = 128,
    batch: int = 1,
    *,
    dynamic: bool = False,
    cache_dir: str | os.PathLike | None = None,
) -> onnx.ModelProto:
    """``layers`` BERT encoder layers (post-norm, exact GELU), written like HF's BertLayer.

    Inputs: ``hidden_states`` ``[batch, seq, hidden]`` and ``attention_mask``, an additive
    float mask ``[batch, 1, 1, seq]`` (0 keeps a position, -10000 drops it). Defaults are
    BERT-base; tiny: ``bert_encoder(layers=1, hidden=64, heads=4, intermediate=128, seq=16)``.
    ``dynamic=True`` exports batch and seq as dynamic axes, as deployed models usually are: the
    graph then computes its reshapes through Shape/Gather/Unsqueeze/Concat chains.
    """
    if hidden % heads:
        raise ValueError(f"hidden={hidden} is not a multiple of heads={heads}")

    def build() -> bytes:
        torch = _torch()
        module = bert_encoder_torch(layers, hidden, heads, intermediate)
        example = [torch.zeros(batch, seq, hidden), torch.zeros(batch, 1, 1, seq)]
        kinds = {"hidden_states": "normal", "attention_mask": "mask"}
        axes = (
            {
                "hidden_states": {0: "batch", 1: "seq"},
                "attention_mask": {0: "batch", 3: "seq"},
                "output": {0: "batch", 1: "seq"},
            }
            if dynamic
            else None
        )
        return _export(module, example, ["hidden_states", "attention_mask"], kinds, axes)

    args = {"l": layers, "h": hidden, "n": heads, "i": intermediate, "s": seq, "b": batch}
    if dynamic:
        args["dyn"] = 1
    return _cached("bert", args, cache_dir, build)


# --------------------------------------------------------------------------------------------
# CNNs


def _conv_bn(nn: Any, c_in: int, c_out: int, kernel: int, stride: int = 1) -> list[Any]:
    return [
        nn.Conv2d(c_in, c_out, kernel, stride=stride, padding=kernel // 2, bias=False),
        nn.BatchNorm2d(c_out),
    ]


def _bottleneck(nn: Any) -> Any:
    """ResNet-50's bottleneck block class (v1.5: the stride on the 3x3)."""

    class Bottleneck(nn.Module):
        expansion = 4

        def __init__(self, c_in: int, planes: int, stride: int) -> None:
            super().__init__()
            c_out = planes * self.expansion
            self.body = nn.Sequential(
                *_conv_bn(nn, c_in, planes, 1),
                nn.ReLU(),
                *_conv_bn(nn, planes, planes, 3, stride),  # stride on the 3x3, as torchvision
                nn.ReLU(),
                *_conv_bn(nn, planes, c_out, 1),
            )
            self.down = (
                nn.Sequential(*_conv_bn(nn, c_in, c_out, 1, stride))
                if stride != 1 or c_in != c_out
                else nn.Identity()
            )
            self.relu = nn.ReLU()

        def forward(self, x: Any) -> Any:
            return self.relu(self.body(x) + self.down(x))

    return Bottleneck


def _resnet_module(width: int, blocks: Sequence[int], classes: int) -> Any:
    torch = _torch()
    nn = torch.nn
    Bottleneck = _bottleneck(nn)

    layers: list[Any] = [
        *_conv_bn(nn, 3, width, 7, 2),
        nn.ReLU(),
        nn.MaxPool2d(3, stride=2, padding=1),
    ]
    c_in = width
    for stage, count in enumerate(blocks):
        planes = width * 2**stage
        for i in range(count):
            layers.append(Bottleneck(c_in, planes, 2 if stage > 0 and i == 0 else 1))
            c_in = planes * Bottleneck.expansion
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c_in, classes)]
    return nn.Sequential(*layers)


def resnet50_torch(image: int, width: int, blocks: Sequence[int], classes: int) -> Any:
    """The torch module :func:`resnet50` exports, with the same weights (BatchNorm statistics
    calibrated at ``image`` pixels, as the export's)."""
    torch = _torch()

    def make() -> Any:
        module = _resnet_module(width, blocks, classes)
        _randomize_norms(module, calibrate=torch.randn(2, 3, image, image))
        return module

    return _seeded(make)


def resnet50(
    batch: int = 1,
    image: int = 224,
    *,
    width: int = 64,
    blocks: Sequence[int] = (3, 4, 6, 3),
    classes: int = 1000,
    cache_dir: str | os.PathLike | None = None,
) -> onnx.ModelProto:
    """ResNet-50 v1.5 (bottleneck blocks, stride on the 3x3), BatchNorm in eval mode.

    Input ``input`` is ``[batch, 3, image, image]``. The TorchScript exporter folds each eval
    BatchNorm into its Conv, so the graph is Conv(+bias)/Relu/Add/MaxPool/GlobalAveragePool/
    Flatten/Gemm. Tiny: ``resnet50(image=32, width=8, blocks=(1, 1, 1, 1), classes=10)``.
    """
    blocks = tuple(int(b) for b in blocks)

    def build() -> bytes:
        module = resnet50_torch(image, width, blocks, classes)
        return _export(module, [_torch().zeros(batch, 3, image, image)], ["input"])

    args = {"b": batch, "img": image, "w": width, "blk": blocks, "c": classes}
    return _cached("resnet", args, cache_dir, build)


def resnet50_block(
    batch: int = 1,
    image: int = 56,
    planes: int = 64,
    *,
    cache_dir: str | os.PathLike | None = None,
) -> onnx.ModelProto:
    """One identity bottleneck block of ResNet-50 (stage 2 by default: 256 -> 64 -> 64 -> 256
    channels at 56x56), BatchNorm folded: the unit ResNet-50 is made of, for tuning."""

    def build() -> bytes:
        torch = _torch()

        def make() -> Any:
            module = _bottleneck(torch.nn)(planes * 4, planes, 1)
            _randomize_norms(module, calibrate=torch.randn(2, planes * 4, image, image))
            return module

        module = _seeded(make)
        return _export(module, [torch.zeros(batch, planes * 4, image, image)], ["input"])

    args = {"b": batch, "img": image, "p": planes}
    return _cached("resnet_block", args, cache_dir, build)


def small_cnn(
    batch: int = 1,
    image: int = 32,
    *,
    channels: Sequence[int] = (16, 32, 64),
    classes: int = 10,
    cache_dir: str | os.PathLike | None = None,
) -> onnx.ModelProto:
    """Conv3x3+BN+ReLU blocks (max-pooling between them), global average pool and a Linear.

    Input ``input`` is ``[batch, 3, image, image]`` (1x3x32x32 by default; already tiny).
    """
    channels = tuple(int(c) for c in channels)

    def build() -> bytes:
        torch = _torch()
        nn = torch.nn

        def make() -> Any:
            layers: list[Any] = []
            c_in = 3
            for i, c_out in enumerate(channels):
                layers += [*_conv_bn(nn, c_in, c_out, 3), nn.ReLU()]
                if i < len(channels) - 1:
                    layers.append(nn.MaxPool2d(2))
                c_in = c_out
            layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c_in, classes)]
            module = nn.Sequential(*layers)
            _randomize_norms(module, calibrate=torch.randn(4, 3, image, image))
            return module

        module = _seeded(make)
        return _export(module, [torch.zeros(batch, 3, image, image)], ["input"])

    args = {"b": batch, "img": image, "ch": channels, "c": classes}
    return _cached("smallcnn", args, cache_dir, build)


# --------------------------------------------------------------------------------------------
# Inputs


def _static_shape(value: onnx.ValueInfoProto) -> tuple[int, ...]:
    dims = value.type.tensor_type.shape.dim
    if not all(d.HasField("dim_value") for d in dims):
        raise ValueError(f"input {value.name!r} has a dynamic shape; pass its shape in shape_dict")
    return tuple(d.dim_value for d in dims)


def example_inputs(
    model: onnx.ModelProto,
    shape_dict: Mapping[str, Sequence[int]] | None = None,
    seed: int = SEED,
) -> dict[str, np.ndarray]:
    """Deterministic inputs for ``model``'s graph inputs (same model and seed, same arrays).

    Shapes come from the model, or from ``shape_dict`` (needed for dynamic inputs).

    Float inputs are standard normal, except those the generator marked as additive attention
    masks: 0 everywhere but the last quarter of the positions, which get -10000. Integer
    inputs are zeros. Each input's generator is seeded from its name, so adding an input does
    not change the others.
    """
    props = {p.key: p.value for p in model.metadata_props}
    initializers = {t.name for t in model.graph.initializer}
    inputs: dict[str, np.ndarray] = {}
    for value in model.graph.input:
        if value.name in initializers:
            continue
        if shape_dict and value.name in shape_dict:
            shape = tuple(int(d) for d in shape_dict[value.name])
        else:
            shape = _static_shape(value)
        dtype = helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type)
        rng = np.random.default_rng([seed, zlib.crc32(value.name.encode())])
        kind = props.get(_EXAMPLE_KEY + value.name, "normal")
        if not np.issubdtype(dtype, np.floating):
            array = np.zeros(shape, dtype)
        elif kind == "mask":
            array = np.zeros(shape, dtype)
            if shape:
                keep = max(1, shape[-1] - shape[-1] // 4)
                array[..., keep:] = -10000.0
        else:
            array = rng.standard_normal(shape).astype(dtype)
        inputs[value.name] = array
    return inputs


GENERATORS: dict[str, Callable[..., onnx.ModelProto]] = {
    "mlp": mlp,
    "bert": bert_encoder,
    "resnet50": resnet50,
    "small_cnn": small_cnn,
}
"""The generators by name (for the CLI and benchmarks)."""

TINY_ARGS: dict[str, dict[str, Any]] = {
    "mlp": {"batch": 4, "dims": (16, 32, 8)},
    "bert": {"layers": 1, "hidden": 64, "heads": 4, "intermediate": 128, "seq": 16},
    "resnet50": {"image": 32, "width": 8, "blocks": (1, 1, 1, 1), "classes": 10},
    "small_cnn": {},
}
"""Arguments that make each generator's model tiny (a second to export, import and build)."""

"""Export a transformers causal LM with its KV cache as ONNX inputs and outputs.

The layout is the one Optimum and ONNX Runtime GenAI use and :class:`~tpp_tvm.decoding.
DecoderSession` runs: inputs ``input_ids``, ``attention_mask`` (over past and new tokens),
``position_ids`` and ``past_key_values.<i>.key|value`` (batch, kv heads, past, head dim);
outputs ``logits`` and ``present.<i>.key|value`` (the past with the new tokens appended).
The batch, the new tokens, the past and the total length are dynamic axes.

transformers 5 keeps the cache in a ``DynamicCache`` object, which the TorchScript exporter
cannot take as an input, so a wrapper rebuilds it from the flat tensors. The trace runs with
two new tokens: transformers branches in Python on a single query (``q_length == 1`` in its
SDPA integration), and the tracer freezes the branch it took into the graph, which must
serve prompts as well as steps. transformers and torch are imported lazily.

``weights="int4"`` (or ``"int8"``) then stores every MatMul's weights in that many bits
with ONNX Runtime's own quantizer (``MatMulNBitsQuantizer``, symmetric, a scale per block
of K): the same file ONNX Runtime runs, and ``DecoderSession`` runs it on the weight-only
kernels. Export and session are then the whole path::

    path = export_causal_lm_with_cache(model, "llm.onnx", weights="int4")
    session = tpp_tvm.DecoderSession(path)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

OPSET = 17
#: ``weights=`` of :func:`export_causal_lm_with_cache`: bits per stored weight.
WEIGHT_BITS = {"int4": 4, "int8": 8}


def cache_names(layers: int) -> tuple[list[str], list[str]]:
    """The past input names and their present output names, in order."""
    past = [f"past_key_values.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]
    return past, [p.replace("past_key_values", "present") for p in past]


def export_causal_lm_with_cache(model: Any, path: str | Path, past: int = 4, *,
                                weights: str | None = None, block_size: int = 32,
                                accuracy_level: int = 0) -> Path:
    """Export ``model`` (a transformers ``*ForCausalLM`` in eval mode) to ``path``; with
    ``weights`` ("int4" or "int8") its MatMul weights quantized in blocks of ``block_size``
    along K (``accuracy_level`` 4: A on int8 dot products, as MatMulNBits defines)."""
    if weights is not None and weights not in WEIGHT_BITS:
        raise ValueError(f"weights={weights!r}: one of {', '.join(WEIGHT_BITS)} or None")
    import torch
    from transformers import DynamicCache

    cfg = model.config
    layers = cfg.num_hidden_layers
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads

    class WithCache(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, position_ids, *flat):
            cache = DynamicCache()
            for i in range(layers):
                cache.update(flat[2 * i], flat[2 * i + 1], i)
            out = self.model(input_ids=input_ids, attention_mask=attention_mask,
                             position_ids=position_ids, past_key_values=cache, use_cache=True)
            present = []
            for layer in out.past_key_values.layers:
                present += [layer.keys, layer.values]
            return (out.logits, *present)

    new = 2
    ids = torch.zeros((1, new), dtype=torch.int64)
    mask = torch.ones((1, past + new), dtype=torch.int64)
    positions = torch.arange(past, past + new).unsqueeze(0)
    cache = [torch.zeros((1, kv_heads, past, head_dim)) for _ in range(2 * layers)]
    past_names, present_names = cache_names(layers)
    axes: dict[str, dict[int, str]] = {
        "input_ids": {0: "batch", 1: "seq"}, "position_ids": {0: "batch", 1: "seq"},
        "attention_mask": {0: "batch", 1: "total"}, "logits": {0: "batch", 1: "seq"}}
    axes |= {n: {0: "batch", 2: "past"} for n in past_names}
    axes |= {n: {0: "batch", 2: "total"} for n in present_names}
    path = Path(path)
    with torch.no_grad():
        torch.onnx.export(WithCache(), (ids, mask, positions, *cache), str(path),
                          opset_version=OPSET, dynamo=False,
                          input_names=["input_ids", "attention_mask", "position_ids",
                                       *past_names],
                          output_names=["logits", *present_names], dynamic_axes=axes)
    if weights is not None:
        quantize_matmul_weights(path, WEIGHT_BITS[weights], block_size, accuracy_level)
    return path


def quantize_matmul_weights(path: str | Path, bits: int = 4, block_size: int = 32,
                            accuracy_level: int = 0) -> Path:
    """Rewrite the model at ``path`` in place with its MatMuls by constant weights as
    ``com.microsoft:MatMulNBits`` (ONNX Runtime's ``MatMulNBitsQuantizer``, symmetric)."""
    import onnx

    try:
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
    except ImportError as exc:
        raise ImportError("quantizing weights uses ONNX Runtime's MatMulNBitsQuantizer: "
                          "pip install onnxruntime") from exc
    quantizer = MatMulNBitsQuantizer(onnx.load(str(path)), bits=bits, block_size=block_size,
                                     is_symmetric=True, accuracy_level=accuracy_level)
    quantizer.process()
    onnx.save(quantizer.model.model, str(path))
    return Path(path)

"""PyTorch models into Relax: ``torch.export`` captures the module, TVM's exported-program
importer writes it as Relax, and the ``tpp`` pipeline's canonicalizations (batch norms
folded into convolutions, activation forms) make its idioms the ones the ONNX route's
patterns claim.

Parameters and buffers become constants (``keep_params_as_input=False``): weights the
kernels pack once at build time, as ONNX initializers are. Errors name what failed: an
operator the importer has no converter for, or the reason ``torch.export`` gave.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tvm

from .errors import ModelLoadError, UnsupportedOperatorError


def export_program(module: Any, example_inputs: Sequence[Any],
                   dynamic_shapes: Any = None) -> Any:
    """``torch.export.export`` of ``module`` in eval mode, without autograd; a failure
    becomes a :class:`ModelLoadError` with torch's reason."""
    import torch

    if isinstance(module, torch.nn.Module):
        try:
            module = module.eval()
        except NotImplementedError:  # an exported GraphModule (torchao's PT2E output)
            pass
    try:
        with torch.no_grad():
            return torch.export.export(module, tuple(example_inputs),
                                       dynamic_shapes=dynamic_shapes)
    except Exception as exc:  # torch's own errors are many types; one line each
        lines = [line for line in str(exc).strip().splitlines() if line.strip()]
        raise ModelLoadError(f"torch.export could not capture the model: "
                             f"{type(exc).__name__}: {(lines or [''])[0][:400]}") from exc


def unsupported_operators(program: Any) -> list[str]:
    """The ATen operators of ``program`` (after the importer's decompositions) that TVM's
    exported-program importer has no converter for."""
    from tvm.relax.frontend.torch.exported_program_translator import ExportedProgramImporter

    known = {**ExportedProgramImporter().create_convert_map(), **CONVERTERS}
    missing = []
    for node in core_program(program).graph.nodes:
        if node.op != "call_function":
            continue
        name = getattr(node.target, "__name__", str(node.target))
        if name not in known and name not in missing:
            missing.append(name)
    return missing


def core_program(program: Any) -> Any:
    """``program`` in core ATen operators, except ``scaled_dot_product_attention``: the
    importer writes it as one ``nn.attention``, which the pipeline gives the attention
    kernel, where its decomposition (the scale split over Q and K, heads flattened for
    ``bmm``) ran as matmuls and a softmax apart."""
    import torch

    table = torch.export.default_decompositions()
    table.pop(torch.ops.aten.scaled_dot_product_attention.default, None)
    return program.run_decompositions(table)


def _sdpa(node: Any, importer: Any) -> Any:
    """``scaled_dot_product_attention`` as ``nn.attention`` (TVM's converter takes float
    masks only, and no grouped-query heads): a boolean mask becomes an additive one (0 where
    attended, the most negative float elsewhere, as transformers writes it), and K and V
    heads shared by ``enable_gqa`` are repeated in transformers' ``repeat_kv`` form, which
    the grouped attention pattern reads in place."""
    import numpy as np
    from tvm import relax

    emit = importer.block_builder.emit
    args, kwargs = list(node.args), dict(node.kwargs)
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
    given = {**dict(zip(names, args)), **kwargs}
    q, k, v = (importer.env[given[n]] for n in names[:3])
    if float(given.get("dropout_p", 0.0) or 0.0) != 0.0:
        raise UnsupportedOperatorError("scaled_dot_product_attention with dropout_p > 0 "
                                       "(a training graph)")
    heads, kv_heads = int(q.ty.shape[1]), int(k.ty.shape[1])
    if heads != kv_heads:
        group = heads // kv_heads

        def repeat(x: Any) -> Any:
            b, h, n, d = (int(e) for e in x.ty.shape)
            wide = emit(relax.op.broadcast_to(emit(relax.op.expand_dims(x, 2)),
                                              (b, h, group, n, d)))
            return emit(relax.op.reshape(wide, (b, h * group, n, d)))

        k, v = repeat(k), repeat(v)
    mask = given.get("attn_mask")
    bias = None
    if mask is not None:
        bias = importer.env[mask]
        if str(bias.ty.dtype) == "bool":
            bias = emit(relax.op.where(bias, relax.const(0.0, "float32"),
                                       relax.const(np.finfo(np.float32).min, "float32")))
    swap = [0, 2, 1, 3]
    q, k, v = (emit(relax.op.permute_dims(x, swap)) for x in (q, k, v))
    out = emit(relax.op.nn.attention(q, k, v, bias=bias, scale=given.get("scale"),
                                     causal_mask="TopLeft" if given.get("is_causal") else None))
    return emit(relax.op.permute_dims(out, swap))


def _cumsum(node: Any, importer: Any) -> Any:
    """``cumsum`` with torch's result type: a boolean or narrower integer input sums into
    int64 (TVM's converter kept bool, which its kernel rejects: transformers' mask of
    packed sequences, in every Llama export)."""
    from tvm import relax

    x = importer.env[node.args[0]]
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    dtype = node.kwargs.get("dtype")
    if dtype is not None:
        dtype = str(dtype).removeprefix("torch.")
    elif str(x.ty.dtype) in ("bool", "int8", "uint8", "int16", "int32"):
        dtype = "int64"
    if dtype is not None and str(x.ty.dtype) == "bool":
        x = importer.block_builder.emit(relax.op.astype(x, dtype))
    return importer.block_builder.emit(relax.op.cumsum(x, dim, dtype))


def _quantization_operand(importer: Any, value: Any, dtype: str) -> Any:
    """A scale or zero point of ``dtype``: a constant from a number, else the tensor, cast
    (:func:`_cast_constants` folds the cast of a parameter: the QDQ patterns take
    constants, as the ONNX importer writes them)."""
    from tvm import relax

    if isinstance(value, (int, float)):
        return relax.const(value, dtype)
    operand = importer.env[value]
    if str(operand.ty.dtype) != dtype:
        operand = importer.block_builder.emit(relax.op.astype(operand, dtype))
    return operand


def _quantize(per_channel: bool, inverse: bool) -> Any:
    """A PT2E (``torch.ao`` ``convert_pt2e``) quantize or dequantize node as Relax's
    ``quantize``/``dequantize``, the ops the ONNX importer writes QuantizeLinear and
    DequantizeLinear as, so a PT2E model meets the QDQ path onto the int8 TPPs.
    ``(x, scale, zero_point, [axis,] quant_min, quant_max, dtype)``."""

    def convert(node: Any, importer: Any) -> Any:
        from tvm import relax

        args = list(node.args)
        x = importer.env[args[0]]
        axis = int(args[3]) if per_channel else -1
        dtype = str(node.kwargs.get("dtype", args[-1])).removeprefix("torch.")
        if dtype not in ("uint8", "int8"):
            raise UnsupportedOperatorError(f"{node.target}: {dtype} quantization (the int8 "
                                           "TPPs take uint8 and int8)")
        scale = _quantization_operand(importer, args[1], "float32")
        zero = _quantization_operand(importer, args[2], dtype)
        if inverse:
            call = relax.op.dequantize(x, scale, zero, axis=axis, out_dtype="float32")
        else:
            call = relax.op.quantize(x, scale, zero, axis=axis, out_dtype=dtype)
        return importer.block_builder.emit(call)

    return convert


def _cat(node: Any, importer: Any) -> Any:
    """``cat`` without the empty 1-D tensors torch lets it take beside tensors of any rank
    (transformers' KV caches start from ``torch.tensor([])``: GPT-2 and Llama exports);
    TVM's converter rejects the ranks' mismatch."""
    from tvm import relax

    tensors = [importer.env[t] for t in node.args[0]]
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    def empty_vector(t: Any) -> bool:
        shape = t.ty.shape
        return len(shape) == 1 and isinstance(shape[0], tvm.tirx.IntImm) and int(shape[0]) == 0

    kept = [t for t in tensors if not empty_vector(t)] or tensors[:1]
    if len(kept) == 1:
        return kept[0]
    return importer.block_builder.emit(relax.op.concat(kept, axis=dim))


#: Converters in place of TVM's for these ATen operators.
CONVERTERS = {"scaled_dot_product_attention.default": _sdpa, "cumsum.default": _cumsum,
              "cat.default": _cat, "concat.default": _cat}
for _name, (_channel, _inverse) in {
        "quantize_per_tensor.default": (False, False),
        "quantize_per_tensor.tensor": (False, False),
        "dequantize_per_tensor.default": (False, True),
        "dequantize_per_tensor.tensor": (False, True),
        "quantize_per_channel.default": (True, False),
        "dequantize_per_channel.default": (True, True)}.items():
    CONVERTERS[_name] = _quantize(_channel, _inverse)


def from_program(program: Any) -> tvm.IRModule:
    """Relax for an exported program (its weights as constants)."""
    from tvm import relax
    from tvm.relax.frontend.torch import from_exported_program

    try:
        mod = from_exported_program(core_program(program), keep_params_as_input=False,
                                    unwrap_unit_return_tuple=True,
                                    run_ep_decomposition=False,
                                    custom_convert_map=CONVERTERS)
    except Exception as exc:
        missing = unsupported_operators(program)
        if missing:
            raise UnsupportedOperatorError(
                f"TVM's PyTorch importer has no converter for {', '.join(missing)}") from exc
        lines = [line for line in str(exc).strip().splitlines() if line.strip()]
        raise ModelLoadError(f"TVM's PyTorch importer failed: {type(exc).__name__}: "
                             f"{(lines or [''])[-1][:400]}") from exc
    # A batch norm comes as (output, mean, var)[0]: the output itself, for the patterns.
    mod = relax.transform.CanonicalizeBindings()(mod)
    return _cast_constants(mod)


def _cast_constants(mod: tvm.IRModule) -> tvm.IRModule:
    """``astype(constant)`` → a constant of that type: the importer binds parameters after
    converting, so a cast of one (a PT2E zero point, int64 in torch, int8 for Relax's
    ``dequantize``) stayed a cast, which the QDQ patterns do not take. Folding everything
    instead would fold the int8 weights' ``dequantize`` into fp32 weights."""
    from tvm import relax
    from tvm.relax.dpl import is_const, is_op, rewrite_call

    pattern = is_op("relax.astype")(is_const())

    def cast(orig: Any, _m: Any) -> Any:
        value = orig.args[0].value.numpy()
        return relax.const(value.astype(str(orig.attrs.dtype)), str(orig.attrs.dtype))

    for gv, func in list(mod.functions.items()):
        if isinstance(func, relax.Function):
            mod[gv] = rewrite_call(pattern, cast, func)
    return mod


def from_torch(module: Any, example_inputs: Sequence[Any], dynamic_shapes: Any = None
               ) -> tuple[tvm.IRModule, Any]:
    """``module`` at the shapes of ``example_inputs`` as Relax, and its exported program
    (whose call spec gives the outputs' structure)."""
    program = export_program(module, example_inputs, dynamic_shapes)
    return from_program(program), program

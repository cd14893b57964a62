"""ONNX import: a cleaned-up ONNX model becomes a Relax IRModule with weights as constants.

:func:`from_onnx` cleans the model at the ONNX level (:func:`~.cleanups.clean_model`),
checks its operators (:func:`~.converters.check_supported`), then converts it with TVM's
importer (``tvm.relax.frontend.onnx``) extended by :data:`~.converters.EXTRA_CONVERTERS`.
Weights stay in the module as ``relax.Constant`` (``keep_params_in_input=False``), where the
graph passes can pack them ahead of time. Errors a user can cause are
:class:`~tpp_tvm.errors.TPPError` subclasses naming the path, input, dimension or node.
"""

from __future__ import annotations

import contextlib
import functools
import io
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import onnx
import tvm

from tpp_tvm.errors import ModelLoadError, TPPError, describe_tvm_error
from tpp_tvm.onnx_static import why_not_static

from .cleanups import clean_model
from .converters import EXTRA_CONVERTERS, check_supported
from .loading import ModelLike


def _default_opset(model: onnx.ModelProto) -> int:
    for entry in model.opset_import:
        if entry.domain in ("", "ai.onnx"):
            return int(entry.version)
    return 1


@functools.cache
def _importer_class() -> type:
    from tvm.relax.frontend.onnx.onnx_frontend import ONNXGraphImporter

    class Importer(ONNXGraphImporter):
        """TVM's importer, with conversion failures naming the node that failed (and where
        static shapes stopped, when that is why), and the converters of
        :data:`~.converters.EXTRA_CONVERTERS`."""

        #: The cleaned graph being converted, for :func:`~tpp_tvm.onnx_static.why_not_static`.
        onnx_graph: onnx.GraphProto | None = None

        def _check_for_unsupported_ops(self, graph: onnx.GraphProto) -> None:
            pass  # from_onnx checked the model against TVM's table plus ours already

        def _convert_operator(
            self, op_name: str, inputs: Any, attrs: dict[str, Any], opset: int
        ) -> Any:
            try:
                if op_name in EXTRA_CONVERTERS:
                    out = EXTRA_CONVERTERS[op_name](self.bb, inputs, attrs)
                    if out is not None:
                        return out
                return super()._convert_operator(op_name, inputs, attrs, opset)
            except TPPError:  # ours, naming the node already
                raise
            except Exception as exc:
                node = attrs.get("tvm_custom", {}).get("name", "?")
                why = why_not_static(self.onnx_graph, node) \
                    if self.onnx_graph is not None else ""
                raise ModelLoadError(
                    f"TVM's ONNX converter failed on {op_name} node {node!r}: "
                    f"{describe_tvm_error(exc)}" + (f" ({why})" if why else "")
                ) from exc

    return Importer


#: ``main``'s attribute holding the ONNX input names, in parameter order.
ONNX_INPUT_NAMES = "tpp.onnx_input_names"


def from_onnx(
    model_or_path: ModelLike, shape_dict: Mapping[str, Sequence[int]] | None = None
) -> tvm.IRModule:
    """Import an ONNX model (ModelProto, path or bytes) as a Relax ``tvm.IRModule``.

    ``shape_dict`` maps input names to static shapes; it is needed for every input with a
    dynamic dimension. The model is cleaned first (:func:`clean_model`), checked against the
    converter's op table, then converted with weights as ``relax.Constant``. Returns a module
    whose ``main`` takes the graph inputs (parameter names sanitized by TVM: ``.`` becomes
    ``_``; the ONNX names are kept in ``main``'s ``ONNX_INPUT_NAMES`` attribute).
    """
    model = clean_model(model_or_path, shape_dict)
    check_supported(model)
    shapes = {
        v.name: [d.dim_value for d in v.type.tensor_type.shape.dim] for v in model.graph.input
    }
    importer = _importer_class()(shapes, "float32", keep_params_in_input=False, sanitize=True)
    importer.onnx_graph = model.graph
    # TVM's importer prints every input of a failing node to stdout; our error names the node.
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Renaming name")
        try:
            mod = importer.from_onnx(model.graph, _default_opset(model))
        except TPPError:
            raise
        except Exception as exc:  # outside a converter: graph inputs, outputs, constants
            raise ModelLoadError(f"TVM's ONNX importer failed: {describe_tvm_error(exc)}"
                                 ) from exc
    # The model's own input names, which callers use: TVM's sanitized ones (``.`` → ``_``)
    # only name the Relax parameters (clean_model left the real inputs, in order).
    names = [v.name for v in model.graph.input]
    if len(names) == len(mod["main"].params):
        mod["main"] = mod["main"].with_attr(ONNX_INPUT_NAMES, names)
    return mod

"""ONNX import: an ONNX model becomes a Relax IRModule with weights as constants
(:func:`from_onnx`), after an ONNX-level cleanup that gives TVM's converter the clean,
statically shaped graph it handles well (:func:`clean_model`).

One job per module, in the order a model goes through them:

* ``loading``: reading a model (path, bytes, ModelProto; external data) and writing one,
  over protobuf's 2 GiB limit with its weights beside it; the onnx version checks.
* ``shapes``: a graph's real inputs, their types, and their static shapes from
  ``shape_dict`` or the model.
* ``fold_ops``: the one table of what constant folding computes, op type -> numpy function.
* ``folding``: the folding pass over a graph (constants, ``Shape``/``Size`` of static
  values, renames instead of copies for shared weights).
* ``cleanups``: :func:`clean_model`, the whole ONNX-level cleanup (inlining, static shapes,
  folding with shape inference, SAME padding made explicit, inference Dropout removed).
* ``converters``: the converters tpp_tvm adds to TVM's importer, and the check that every
  operator has one.
* ``importer``: :func:`from_onnx`, TVM's importer with those converters and errors that
  name the failing node.
"""

from .cleanups import clean_model, explicit_auto_pad, inference_dropout_as_identity
from .converters import unsupported_nodes
from .importer import ONNX_INPUT_NAMES, from_onnx
from .loading import ModelLike, check_versions, fits_protobuf, load_model, save_model
from .shapes import graph_inputs, input_type

__all__ = [
    "ONNX_INPUT_NAMES",
    "ModelLike",
    "check_versions",
    "clean_model",
    "explicit_auto_pad",
    "fits_protobuf",
    "from_onnx",
    "graph_inputs",
    "inference_dropout_as_identity",
    "input_type",
    "load_model",
    "save_model",
    "unsupported_nodes",
]

"""Reading and writing ONNX models: a model from a ModelProto, a path (with its external data)
or bytes, checked against what the installed onnx knows; and a model of any size written
back, over protobuf's 2 GiB limit with its weights beside it.

A protobuf message cannot exceed 2 GiB (a 1B-parameter fp32 LLM is 4 GB), so such a model
is read with its external data and written with it (:func:`save_model`); nothing serializes
it whole. The onnx passes that serialize a model (shape inference, the function inliner)
get a copy without its weights (:func:`weightless`).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
from google.protobuf.message import EncodeError
from onnx import helper, numpy_helper

from tpp_tvm.errors import ModelLoadError
from tpp_tvm.onnx_static import MAX_SHAPE_DATA

#: What :func:`load_model` reads: a ModelProto, a path or the serialized bytes.
ModelLike = onnx.ModelProto | str | os.PathLike | bytes

_PROTOBUF_LIMIT = 2**31 - 1


def load_model(model_or_path: ModelLike) -> onnx.ModelProto:
    """An ONNX ModelProto from a ModelProto (copied, never modified), a path or bytes."""
    if isinstance(model_or_path, onnx.ModelProto):
        model = onnx.ModelProto()
        model.CopyFrom(model_or_path)
        return model
    if isinstance(model_or_path, bytes | bytearray | memoryview):
        return _parse(bytes(model_or_path), "the given bytes")
    if isinstance(model_or_path, str | os.PathLike):
        path = Path(model_or_path)
        if not path.is_file():
            what = "is a directory, not a file" if path.is_dir() else "does not exist"
            raise ModelLoadError(f"cannot load ONNX model: {path} {what}")
        model = _parse(path.read_bytes(), str(path))
        if any(_uses_external_data(t) for t in model.graph.initializer):
            _load_external_data(model, path)
        return model
    raise TypeError(
        f"expected an onnx.ModelProto, a path or bytes, got {type(model_or_path).__name__}"
    )


def _uses_external_data(tensor: onnx.TensorProto) -> bool:
    return tensor.data_location == onnx.TensorProto.EXTERNAL


def _load_external_data(model: onnx.ModelProto, path: Path) -> None:
    """Read the initializers kept in files beside the model; a missing or short file is a
    :class:`ModelLoadError` naming the tensor and the file (onnx raises a checker error, or
    reads garbage past the end of a short file)."""
    for tensor in model.graph.initializer:
        if not _uses_external_data(tensor):
            continue
        info = {e.key: e.value for e in tensor.external_data}
        location = info.get("location", "")
        where = path.parent / location
        if not location or not where.is_file():
            raise ModelLoadError(
                f"{path}: initializer {tensor.name!r} keeps its data in "
                f"{location or '(no location)'!r}, which is missing (expected {where})"
            )
        end = int(info.get("offset", 0)) + int(info.get("length", 0))
        if end > where.stat().st_size:
            raise ModelLoadError(
                f"{path}: initializer {tensor.name!r} needs bytes up to {end} of {where}, "
                f"which has only {where.stat().st_size}: truncated external data"
            )
    try:
        onnx.load_external_data_for_model(model, str(path.parent))
    except Exception as exc:  # onnx's checker errors (a location outside the folder, ...)
        raise ModelLoadError(f"{path}: cannot load its external data: {exc}") from exc


def _parse(data: bytes, source: str) -> onnx.ModelProto:
    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except Exception as exc:  # protobuf raises DecodeError (or RuntimeWarning-ish) variants
        raise ModelLoadError(f"{source} is not an ONNX model (protobuf parse failed)") from exc
    # Protobuf accepts many non-ONNX byte strings as a message of unknown fields.
    if model.ir_version <= 0 or not model.HasField("graph"):
        raise ModelLoadError(f"{source} is not an ONNX model (no IR version or no graph)")
    if model.ir_version < 3:
        raise ModelLoadError(f"{source}: ONNX IR version {model.ir_version} is too old (< 3)")
    check_versions(model, source)
    return model


def check_versions(model: onnx.ModelProto, source: str = "the model") -> None:
    """Refuse a model newer than the installed onnx knows: TVM's converter picks the newest
    converter at or below the model's opset, so an unknown opset would silently get an older
    version's semantics."""
    if model.ir_version > onnx.IR_VERSION:
        raise ModelLoadError(
            f"{source}: ONNX IR version {model.ir_version} is newer than this onnx "
            f"{onnx.__version__} reads (up to {onnx.IR_VERSION}); upgrade onnx"
        )
    newest = onnx.defs.onnx_opset_version()
    for entry in model.opset_import:
        if entry.domain in ("", "ai.onnx") and entry.version > newest:
            raise ModelLoadError(
                f"{source} imports ONNX opset {entry.version}, newer than the importer "
                f"knows (onnx {onnx.__version__}: opsets up to {newest}); re-export it "
                f"with opset <= {newest}"
            )



def _split_weights(
    model: onnx.ModelProto, keep_elements: int
) -> tuple[onnx.ModelProto, list[onnx.TensorProto]]:
    """A copy of ``model`` without its initializers over ``keep_elements`` elements, and
    those initializers (the model's own, not copies)."""
    graph = model.graph
    light = onnx.ModelProto(ir_version=model.ir_version, opset_import=model.opset_import,
                            functions=model.functions)
    light.graph.name = graph.name
    for field in ("node", "input", "output", "value_info", "sparse_initializer"):
        getattr(light.graph, field).extend(getattr(graph, field))
    weights = []
    for tensor in graph.initializer:
        if int(np.prod(tensor.dims)) <= keep_elements:
            light.graph.initializer.add().CopyFrom(tensor)
        else:
            weights.append(tensor)
    return light, weights


def weightless(model: onnx.ModelProto, keep_elements: int) -> onnx.ModelProto:
    """A copy of ``model`` for the onnx passes that serialize it (shape inference, the
    function inliner): every initializer over ``keep_elements`` elements becomes a typed
    graph input without data. Those passes need weights' types and shapes, never their
    values (only shape-sized tensors are read), and a protobuf message cannot exceed 2 GiB:
    a 1B-parameter fp32 model (4 GB) could not go through them whole, and ALBERT-xxlarge
    went over once its shared weights had been copied per use."""
    light, weights = _split_weights(model, keep_elements)
    inputs = {v.name for v in light.graph.input}
    for tensor in weights:
        if tensor.name not in inputs:  # old exports list initializers as inputs too
            light.graph.input.append(
                helper.make_tensor_value_info(tensor.name, tensor.data_type, tensor.dims))
    return light


def fits_protobuf(model: onnx.ModelProto) -> bool:
    """Whether ``model`` serializes as one protobuf message (at most 2 GiB)."""
    try:
        return model.ByteSize() <= _PROTOBUF_LIMIT
    except EncodeError:  # upb refuses to even size a message over the limit
        return False


def save_model(model: onnx.ModelProto, path: str | os.PathLike) -> Path:
    """Write ``model`` to ``path``; one over protobuf's 2 GiB limit keeps its larger
    initializers in ``<name>.data`` beside it (ONNX external data, which
    :func:`load_model`, ``onnx.load`` and ONNX Runtime read). Unlike ``onnx.save`` with
    ``save_as_external_data``, the model in memory keeps its weights."""
    path = Path(path)
    if fits_protobuf(model):
        path.write_bytes(model.SerializeToString())
        return path
    light, weights = _split_weights(model, MAX_SHAPE_DATA)
    data = path.with_name(path.name + ".data")
    with data.open("wb") as out:
        for tensor in weights:
            if tensor.data_type == onnx.TensorProto.STRING:  # no fixed-size bytes to write
                light.graph.initializer.add().CopyFrom(tensor)
                continue
            raw = tensor.raw_data if tensor.HasField("raw_data") else \
                numpy_helper.to_array(tensor).tobytes()
            ref = light.graph.initializer.add(name=tensor.name, data_type=tensor.data_type,
                                              dims=tensor.dims)
            ref.data_location = onnx.TensorProto.EXTERNAL
            for key, value in (("location", data.name), ("offset", out.tell()),
                               ("length", len(raw))):
                ref.external_data.add(key=key, value=str(value))
            out.write(raw)
    path.write_bytes(light.SerializeToString())
    return path

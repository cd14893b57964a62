"""TPPs as TE computations: the form in which schedules (and tests) meet a TPP.

``te_compute(spec)`` states a TPP's math as a TE computation built from the same pieces as
its description (its kind's, see ``kinds/``), so a block made from it tensorizes with the
TPP's intrinsic by construction. Two TPPs update their output in place (``muladd``, and
``gemm``/``brgemm`` with beta 1), which TE cannot express: :func:`workload` gives those as
the description itself on compact buffers.
"""

from __future__ import annotations

import numpy as np
from tvm import te, tirx

from .kinds import describe, kind_of
from .spec import TPPSpec

#: Name of the TE stage (and so of the block) that :func:`te_compute` returns.
BLOCK = "tpp"


def operand_shapes(spec: TPPSpec) -> list[tuple[int, ...]]:
    """Shapes of the description's parameters, in order (inputs first, output last)."""
    return kind_of(spec).operand_shapes(spec)


def operand_dtypes(spec: TPPSpec) -> list[str]:
    """Dtypes of the description's parameters, in order."""
    return kind_of(spec).operand_dtypes(spec)


def in_place(spec: TPPSpec) -> bool:
    """Whether the TPP reads its output's old value (TE cannot express it)."""
    return kind_of(spec).in_place(spec)


def te_compute(
    spec: TPPSpec, inputs: list[te.Tensor] | None = None, name: str = BLOCK
) -> tuple[list[te.Tensor], te.Tensor]:
    """``(inputs, output)`` of a TE computation equal to ``spec``'s description.

    ``inputs`` (default: fresh placeholders of the description's shapes) may be any tensors
    of those shapes, e.g. earlier stages of a schedule. ``muladd`` and beta-1 contractions
    have no TE form (see :func:`workload`); for contractions the result is the beta-0 form
    (TE's reduction initializes C), which a schedule turns into beta 1 with
    ``decompose_reduction``.
    """
    kind = kind_of(spec)
    if inputs is None:
        shapes, dtypes = kind.operand_shapes(spec), kind.operand_dtypes(spec)
        inputs = [
            te.placeholder(s, d, name=f"in{i}")
            for i, (s, d) in enumerate(zip(shapes[:-1], dtypes[:-1]))
        ]
    inputs = list(inputs)
    return inputs, kind.te_compute(spec, inputs, name)


def workload(spec: TPPSpec) -> tirx.PrimFunc:
    """A PrimFunc computing ``spec`` on compact buffers, its block named ``"tpp"``.

    A TE computation where one exists; for in-place TPPs, the description itself with
    compact strides (the only way to state "update C"). Tensorize the block's outermost
    loop with ``intrinsic(spec)``; for a beta-1 contraction built from TE, first
    ``decompose_reduction``.
    """
    if in_place(spec):
        desc = describe(spec)
        binds = {}
        for param, shape in zip(desc.params, operand_shapes(spec)):
            strides = [int(np.prod(shape[d + 1 :])) for d in range(len(shape))]
            # Parameters of a PrimFunc are its buffers in this TVM.
            binds[param] = tirx.decl_buffer(
                shape, param.dtype, name=str(param.name), strides=strides if param.strides else None
            )
        return desc.specialize(binds).with_attr("global_symbol", "main")
    inputs, out = te_compute(spec)
    return te.create_prim_func([*inputs, out])

"""Gathers (``take``) as injective ops, so TVM's fusion puts them in their consumers' kernel.

``AnnotateTIROpPattern`` calls any PrimFunc that indexes one buffer by values loaded from
another opaque, so FuseOps leaves every ``take`` a kernel of its own that writes its whole
result to memory for the next one to read back. A gather is injective (each output element
is one input element), and fused into its consumer it costs no pass of its own: the
separable resize of :mod:`.canonical_forms` gathers whole rows by constant indices, and
fused, the row pass of DeepLabV3's 21 x 224 x 224 upsampling is one vectorized kernel
instead of two takes (0.43 ms) and a weighted sum.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.ir.expr import TensorLoad

#: TVM's ``OpPatternKind`` values (``include/tvm/relax/op_attr_types.h``).
INJECTIVE = 2
OPAQUE = 8


def _is_gather(func: tirx.PrimFunc) -> bool:
    """One spatial block (a legalized op's only one) storing one element loaded at an
    index that another buffer's element gives, and nothing else."""
    blocks: list[s_tir.SBlock] = []
    tvm_ffi.structural_walk(func.body, [(s_tir.SBlock, blocks.append)])
    body = [b for b in blocks if b.name_hint != "root"]
    if len(body) != 1 or body[0].init is not None \
            or any(int(iv.iter_type) != 0 for iv in body[0].iter_vars):
        return False
    store = body[0].body
    if not isinstance(store, tirx.BufferStore) or not isinstance(store.value, TensorLoad):
        return False
    load = store.value
    index_loads: list[TensorLoad] = []
    for index in load.indices:
        tvm_ffi.structural_walk(index, [(TensorLoad, index_loads.append)])
    return bool(index_loads)


@tvm.transform.module_pass(opt_level=0, name="tpp.InjectiveGathers")
def injective_gathers(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """Re-annotate the gathers ``AnnotateTIROpPattern`` called opaque as injective (run
    between it and ``FuseOps``)."""
    for gv, func in list(mod.functions.items()):
        if isinstance(func, tirx.PrimFunc) and func.attrs is not None \
                and int(func.attrs.get("op_pattern", -1)) == OPAQUE and _is_gather(func):
            mod[gv] = func.with_attr("op_pattern", INJECTIVE)
    return mod

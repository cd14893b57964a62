"""Constants shared between the builds of one model.

A dynamic model compiles one static build per size, and a decoder two models (its prompts'
and its steps'); each build binds the weights as ``relax.const`` constants, packed for its kernels,
and its VM executable keeps those tensors. Built separately, every build held its own copy of
weights that are mostly identical (a 0.45B int4 decoder: 470 MB a build). A
:class:`SharedConstants` pool, handed to each build, replaces every constant by the pooled
one with the same dtype, shape and bytes before the module becomes an executable, so the
executables reference one tensor for it (an in-memory build keeps the tensor objects it is
given, it does not copy them).
"""

from __future__ import annotations

import hashlib
import threading

import numpy as np
import tvm
from tvm import relax

#: Constants smaller than this (bytes) are not worth hashing.
MIN_SHARED_BYTES = 64 * 1024


class SharedConstants:
    """A pool of constant tensors by content; :meth:`share` points a module at it."""

    def __init__(self) -> None:
        self._pool: dict[tuple[str, tuple[int, ...], bytes], tvm.ir.Constant] = {}
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        """Bytes of the pooled tensors."""
        return sum(_nbytes(c) for c in self._pool.values())

    def __len__(self) -> int:
        return len(self._pool)

    def _pooled(self, const: tvm.ir.Constant) -> tvm.ir.Constant:
        data = const.value
        if not isinstance(data, tvm.runtime.Tensor) or _nbytes(const) < MIN_SHARED_BYTES:
            return const
        array = np.from_dlpack(data) if str(data.dtype) in _DLPACK_DTYPES else data.numpy()
        digest = hashlib.blake2b(np.ascontiguousarray(array).view(np.uint8), digest_size=20)
        key = (str(data.dtype), tuple(int(d) for d in data.shape), digest.digest())
        with self._lock:
            return self._pool.setdefault(key, const)

    def share(self, mod: tvm.IRModule) -> tvm.IRModule:
        """``mod`` with each large constant of its Relax functions replaced by the pool's
        tensor of the same content (pooled first where the pool has none)."""
        pool = self

        @relax.expr_functor.mutator
        class _Share(relax.PyExprMutator):
            def visit_generic_const_(self, op: tvm.ir.Constant) -> relax.Expr:
                return pool._pooled(op)

        out = {}
        for gv, func in mod.functions.items():
            if isinstance(func, relax.Function):
                out[gv] = _Share(mod).visit_expr(func)
        for gv, func in out.items():
            mod[gv] = func
        return mod


_DLPACK_DTYPES = frozenset({"float32", "float16", "float64", "int8", "uint8", "int16",
                            "uint16", "int32", "uint32", "int64", "uint64", "bool"})


def _nbytes(const: tvm.ir.Constant) -> int:
    """Bytes of a tensor constant (0 for others: a dtype, a shape)."""
    data = const.value
    if not isinstance(data, tvm.runtime.Tensor):
        return 0
    return int(np.prod([int(d) for d in data.shape], dtype=np.int64)) * \
        tvm.runtime.DataType(str(data.dtype)).bits // 8

"""Kernel families: one object per family of TPP kernels (dlight's rule shape).

A family (:class:`~.base.KernelFamily`) names itself (``TPPPattern.lowering`` says which
family lowers a pattern), declares the graph precisions it has kernels for, and lowers a
:class:`~.base.Match` to a :class:`~.base.Lowered`: the expression, and what it decided
(AMX tiles, kept fp32, low-precision rebuilds), never written back into the match.
Modules: ``gemm`` (dense, matmul, bmm, bias-gradient column sums), ``conv`` (convolution,
depthwise, expansion + depthwise), ``attention``, ``rowwise`` (norms, softmax, element-wise
equations), ``pool``. Adding a family: one :class:`KernelFamily` in its module's
``FAMILIES``, and the patterns that name it.
"""

from __future__ import annotations

from . import attention, conv, gemm, pool, rowwise
from .base import KernelFamily, Lowered, Match, as_relax_kernel, kernel_name

#: Every kernel family by name.
FAMILIES: dict[str, KernelFamily] = {
    family.name: family
    for module in (pool, rowwise, attention, gemm, conv)
    for family in module.FAMILIES
}

__all__ = ["FAMILIES", "KernelFamily", "Lowered", "Match", "as_relax_kernel", "kernel_name"]

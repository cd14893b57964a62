"""The TPP pattern table: which Relax subgraphs become one TPP kernel.

Patterns are data (name, dataflow pattern, check, lowering and its parameters), as in TVM's
``relax/backend/patterns.py``: adding a fused subgraph is one entry in the module of its
kind (``contractions``, ``attention``, ``rowwise``, ``pool``; activations and the epilogue
builder in ``activations``) plus, for a new kernel family, one ``KernelFamily`` in
``families/``. Names read ``tpp.<kernel>[_bias][_<activation>][_residual]`` and are for
people (reports, kernel names): nothing parses them back; what a lowering needs is a field
of the entry. The order of the table is the matching priority (the most fused variant
first).
"""

from __future__ import annotations

from .activations import (
    PLAIN_ACTIVATIONS,
    RELAX_ACTIVATIONS,
    activation_constants_hold,
    epilogue_pattern,
    matched_activation,
)
from .attention import attention_patterns, mask_rows_broadcast
from .base import TPPPattern
from .contractions import (
    bmm_pattern,
    col_sum_pattern,
    contraction_patterns,
    expand_depthwise_patterns,
    matmul_patterns,
    runtime_weight_conv_pattern,
)
from .pool import pool_patterns
from .rowwise import eltwise_patterns, rowwise_patterns

__all__ = [
    "PLAIN_ACTIVATIONS",
    "RELAX_ACTIVATIONS",
    "TPPPattern",
    "activation_constants_hold",
    "epilogue_pattern",
    "mask_rows_broadcast",
    "matched_activation",
    "pattern_table",
]


def pattern_table() -> list[TPPPattern]:
    """All TPP patterns in matching priority order."""
    table = attention_patterns()  # before bmm/softmax: it contains both
    table.extend(expand_depthwise_patterns())  # before either convolution alone
    table.extend(contraction_patterns())
    table.append(runtime_weight_conv_pattern())
    table.append(bmm_pattern())
    table.extend(matmul_patterns())
    table.append(col_sum_pattern())
    table.extend(rowwise_patterns())
    table.extend(pool_patterns())
    table.extend(eltwise_patterns())  # last: contractions absorb their own epilogues first
    return table

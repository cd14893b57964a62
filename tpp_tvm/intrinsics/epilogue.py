"""The epilogue of a contraction TPP: what a kernel applies to each finished fp32 tile
before it stores it, as one value.

LIBXSMM fuses element-wise work into the BRGEMM's tile loop ("BRGEMM with fused
epilogues"): the tile is still in registers, so a bias, an activation or a residual costs
a pass over registers, not over memory. Every contraction family (GEMM, convolution,
depthwise, Winograd, expansion + depthwise, int8) takes the same :class:`Epilogue`, built
once from the matched graph (``relay_passes/patterns/``), so a step added here reaches
all of them at once. The steps, in order::

    Y = post_activation(activation(C + bias) * gate + residual)

written as ``out_dtype``. Each step is an equation TPP step (``spec.EQUATION_STEPS``);
:attr:`Epilogue.pre_steps` are those that work on the padded tile (row operands and
element-wise functions), :attr:`Epilogue.post_steps` those that read a tile operand shaped
like the output.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..errors import UnsupportedDTypeError, UnsupportedShapeError
from .spec import OPERAND_STEPS, UNARY_STEPS

#: What a kernel may write: fp32, bf16 for the next bf16 layer, u8/s8 for the next int8 one.
OUTPUT_DTYPES = ("float32", "bfloat16", "uint8", "int8")
#: The equation step adding a quantized residual tile, by the tile's dtype.
QUANTIZED_RESIDUAL_STEPS = {op.dtype: step for step, op in OPERAND_STEPS.items()
                            if op.dtype is not None and not op.row}


@dataclass(frozen=True)
class Epilogue:
    """The fused steps after a contraction, their operands in parameter order (bias row,
    gate tile, residual tile [, the residual's scale row]) and the output dtype.

    ``residual_dtype`` u8/s8: the residual is a quantized tile r (the next int8 layer's
    input, a quarter of the bytes) added as ``r`` converted to fp32, then a ``scale`` row
    multiplies: Y = relu(C + r) * scale, the caller having folded the residual's
    quantization into C (``C / s_r - z_r``). So nothing may stand between C and the
    residual, and only a ReLU after it."""

    bias: bool = False
    activation: str | None = None
    gate: bool = False
    residual: bool = False
    post_activation: str | None = None
    residual_dtype: str = "float32"
    out_dtype: str = "float32"

    def __post_init__(self) -> None:
        for act in (self.activation, self.post_activation):
            if act is not None and act not in UNARY_STEPS:
                raise UnsupportedShapeError(
                    f"epilogue: activation {act!r} unsupported; one of {', '.join(UNARY_STEPS)}")
        if self.out_dtype not in OUTPUT_DTYPES:
            raise UnsupportedDTypeError(
                f"epilogue: output dtype {self.out_dtype!r}; one of {', '.join(OUTPUT_DTYPES)}")
        if self.residual_dtype == "float32":
            return
        if self.residual_dtype not in QUANTIZED_RESIDUAL_STEPS:
            raise UnsupportedDTypeError(
                f"epilogue: residual dtype {self.residual_dtype!r}; float32, uint8 or int8")
        if not self.residual or self.bias or self.activation or self.gate \
                or self.post_activation not in (None, "relu"):
            raise UnsupportedShapeError(
                f"epilogue: a {self.residual_dtype} residual takes no bias, activation or "
                f"gate and only a ReLU after it (got {self})")

    @property
    def quantized_residual(self) -> bool:
        return self.residual_dtype != "float32"

    @property
    def pre_steps(self) -> tuple[str, ...]:
        """The steps before any tile operand: bias row, activation."""
        return (("bias",) if self.bias else ()) + ((self.activation,) if self.activation else ())

    @property
    def post_steps(self) -> tuple[str, ...]:
        """The steps from the first tile operand on: gate, residual, post-activation [and
        a quantized residual's scale]."""
        residual = QUANTIZED_RESIDUAL_STEPS.get(self.residual_dtype, "residual")
        return ((("gate",) if self.gate else ()) + ((residual,) if self.residual else ())
                + ((self.post_activation,) if self.post_activation else ())
                + (("scale",) if self.quantized_residual else ()))

    @property
    def steps(self) -> tuple[str, ...]:
        """Every fp32 step in order (no step: the tile is stored as it is)."""
        return self.pre_steps + self.post_steps

    @property
    def activations(self) -> tuple[str, ...]:
        return tuple(a for a in (self.activation, self.post_activation) if a)

    def writing(self, out_dtype: str) -> Epilogue:
        """The same steps, the result written as ``out_dtype``."""
        return replace(self, out_dtype=out_dtype)

    @property
    def suffix(self) -> str:
        """How kernel and report names spell the steps: ``_bias_relu``,
        ``_bias_residual_relu``, ``_residual_u8_relu`` (for people; nothing parses it)."""
        residual = None
        if self.residual:
            residual = "residual" + ("" if not self.quantized_residual else
                                     "_" + self.residual_dtype.replace("uint", "u")
                                     .replace("int", "s"))
        steps = ("bias" if self.bias else None, self.activation, "gate" if self.gate else None,
                 residual, self.post_activation)
        return "".join(f"_{step}" for step in steps if step)

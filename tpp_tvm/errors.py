"""Errors a tpp_tvm user can hit.

Everything a user can trigger by asking for something tpp_tvm does not support derives from
:class:`TPPError`, so callers (and the CLI) can catch one type and print one line. Messages name
the operator, shape or dtype involved and what is supported instead.
"""

from __future__ import annotations


class TPPError(Exception):
    """Base class of the errors tpp_tvm raises on purpose (not bugs)."""


class UnsupportedISAError(TPPError):
    """Raised when the host CPU or a requested ISA has no TPP implementation.

    For example: asking for ``target("neon")``, or building for the host on a CPU with
    neither AVX-512, AMX nor SVE.
    """


class UnsupportedDTypeError(TPPError):
    """Raised when a TPP or schedule is asked for a dtype it has no kernel for.

    For example: an fp16 GEMM on an ISA that only has fp32/bf16/int8 microkernels.
    """


class UnsupportedShapeError(TPPError):
    """Raised when a shape or layout cannot be mapped onto a TPP.

    For example: a GEMM whose reduction axis is not the innermost loop of its block, or a
    dynamic shape where a static extent is required.
    """


class UnsupportedOperatorError(TPPError):
    """Raised when an operator has no TPP mapping and the caller asked for no fallback.

    Also raised on import when a model contains an ONNX operator (or operator domain) that
    TVM's ONNX converter cannot convert; the message names the op type and the node.
    """


class ModelLoadError(TPPError):
    """Raised when a model cannot be read or converted.

    For example: a path that does not exist, a file that is not an ONNX model, or a node that
    TVM's ONNX converter fails on (the message names the node).
    """


class CompileError(TPPError):
    """Raised when TVM's build fails on a model that tpp_tvm accepted (an ``InternalError``
    or check failure inside TVM's passes or LLVM): the message names the failing check, the
    original error is the ``__cause__``. TVM's own default build usually fails on the same
    model (for example a cast to a 4-bit integer type it cannot lay out in memory)."""


class ExecutionError(TPPError):
    """Raised when a compiled model fails while it runs on inputs that passed the input
    checks (TVM's VM rejected an argument or a kernel failed)."""


def describe_tvm_error(exc: BaseException) -> str:
    """One line for an exception from TVM: its type and the message's last line (TVM puts a
    C++ traceback first)."""
    lines = [t for t in str(exc).strip().splitlines() if t.strip()]
    tail = next((t for t in reversed(lines) if not t.startswith(" ")), lines[-1] if lines
                else "")
    return f"{type(exc).__name__}: {tail.strip()[:400]}"


def _register_with_tvm_ffi() -> None:
    """Let these errors cross TVM's FFI as themselves: one raised inside a Python pass that
    TVM runs (the TIR pipeline's feature check) reaches the caller as a ``TPPError``, not
    as a plain ``RuntimeError``."""
    import tvm_ffi

    for cls in (TPPError, UnsupportedISAError, UnsupportedDTypeError, UnsupportedShapeError,
                UnsupportedOperatorError, ModelLoadError, CompileError, ExecutionError):
        tvm_ffi.register_error(cls.__name__, cls)


_register_with_tvm_ffi()

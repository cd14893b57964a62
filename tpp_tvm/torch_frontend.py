"""PyTorch models into Relax: ``torch.export`` captures the module, TVM's exported-program
importer writes it as Relax, and the ``tpp`` pipeline's canonicalizations (batch norms
folded into convolutions, activation forms) make its idioms the ones the ONNX route's
patterns claim.

Parameters and buffers become constants (``keep_params_as_input=False``): weights the
kernels pack once at build time, as ONNX initializers are. Errors name what failed: an
operator the importer has no converter for, or the reason ``torch.export`` gave.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tvm

from .errors import ModelLoadError, UnsupportedOperatorError


def export_program(module: Any, example_inputs: Sequence[Any],
                   dynamic_shapes: Any = None) -> Any:
    """``torch.export.export`` of ``module`` in eval mode, without autograd; a failure
    becomes a :class:`ModelLoadError` with torch's reason."""
    import torch

    if isinstance(module, torch.nn.Module):
        module = module.eval()
    try:
        with torch.no_grad():
            return torch.export.export(module, tuple(example_inputs),
                                       dynamic_shapes=dynamic_shapes)
    except Exception as exc:  # torch's own errors are many types; one line each
        lines = [line for line in str(exc).strip().splitlines() if line.strip()]
        raise ModelLoadError(f"torch.export could not capture the model: "
                             f"{type(exc).__name__}: {(lines or [''])[0][:400]}") from exc


def unsupported_operators(program: Any) -> list[str]:
    """The ATen operators of ``program`` (after the importer's decompositions) that TVM's
    exported-program importer has no converter for."""
    from tvm.relax.frontend.torch.exported_program_translator import ExportedProgramImporter

    known = ExportedProgramImporter().create_convert_map()
    missing = []
    for node in program.run_decompositions().graph.nodes:
        if node.op != "call_function":
            continue
        name = getattr(node.target, "__name__", str(node.target))
        if name not in known and name not in missing:
            missing.append(name)
    return missing


def from_program(program: Any) -> tvm.IRModule:
    """Relax for an exported program (its weights as constants)."""
    from tvm import relax
    from tvm.relax.frontend.torch import from_exported_program

    try:
        mod = from_exported_program(program, keep_params_as_input=False,
                                    unwrap_unit_return_tuple=True)
    except Exception as exc:
        missing = unsupported_operators(program)
        if missing:
            raise UnsupportedOperatorError(
                f"TVM's PyTorch importer has no converter for {', '.join(missing)}") from exc
        lines = [line for line in str(exc).strip().splitlines() if line.strip()]
        raise ModelLoadError(f"TVM's PyTorch importer failed: {type(exc).__name__}: "
                             f"{(lines or [''])[-1][:400]}") from exc
    # A batch norm comes as (output, mean, var)[0]: the output itself, for the patterns.
    return relax.transform.CanonicalizeBindings()(mod)


def from_torch(module: Any, example_inputs: Sequence[Any], dynamic_shapes: Any = None
               ) -> tuple[tvm.IRModule, Any]:
    """``module`` at the shapes of ``example_inputs`` as Relax, and its exported program
    (whose call spec gives the outputs' structure)."""
    program = export_program(module, example_inputs, dynamic_shapes)
    return from_program(program), program

"""A compiled model as a plain sequence of kernel calls, to run without TVM's runtime.

The ``tpp`` pipeline up to its kernel stage (``tpp_kernel_passes``: graph pass, TPP
schedules, default schedules) leaves ``main`` as a dataflow of ``call_tir`` bindings. That
is all a model is: kernels, tensors (inputs, weights, intermediates) and the order of
calls. :func:`plan_model` extracts it, so the kernels can be cross-compiled into one
library and called in order by ``harness.c`` under qemu: the same graph pass and
schedules as a host build, with the Relax VM replaced by the call list.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import tvm
from tvm import relax

from ..errors import UnsupportedOperatorError, UnsupportedShapeError
from ..relay_passes.pipeline import tpp_kernel_passes
from ..relay_passes.report import LoweringReport
from ..tir_pipeline import compile_kernels
from .runner import Call, run_calls
from .toolchain import export_library

_CALL_TIR = tvm.ir.Op.get("relax.call_tir")


@dataclass
class ModelPlan:
    """Kernels (one IRModule of PrimFuncs), tensors and calls of one static-shape model.

    ``tensors[i]`` is a (shape, dtype) slot; ``constants`` holds the weights by slot;
    ``inputs``/``outputs`` are the slots of ``main``'s parameters and results.
    """

    kernels: tvm.IRModule
    tensors: list[tuple[tuple[int, ...], str]] = field(default_factory=list)
    constants: dict[int, np.ndarray] = field(default_factory=dict)
    calls: list[Call] = field(default_factory=list)
    inputs: list[int] = field(default_factory=list)
    outputs: list[int] = field(default_factory=list)
    report: LoweringReport = field(default_factory=LoweringReport)

    def build(self, target: tvm.target.Target, path: str | Path) -> Path:
        """Compile every kernel for ``target`` into one shared library at ``path``."""
        return export_library(compile_kernels(self.kernels, target), path)

    def arrays(self, inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Every tensor slot filled: inputs and weights by value, the rest zeros."""
        if len(inputs) != len(self.inputs):
            raise ValueError(f"model takes {len(self.inputs)} inputs, got {len(inputs)}")
        arrays = [np.zeros(shape, dtype) for shape, dtype in self.tensors]
        for slot, value in [*zip(self.inputs, inputs), *self.constants.items()]:
            shape, dtype = self.tensors[slot]
            if tuple(np.shape(value)) != shape:
                raise ValueError(f"tensor {slot}: expected shape {shape}, got {np.shape(value)}")
            arrays[slot] = np.asarray(value, dtype)
        return arrays

    def run(self, library: str | Path, inputs: Sequence[np.ndarray], **qemu) -> list[np.ndarray]:
        """The model's outputs for ``inputs``, computed by ``library`` under qemu."""
        results = run_calls(library, self.arrays(inputs), self.calls, **qemu)
        return [results[slot] for slot in self.outputs]


def _slot_type(ty) -> tuple[tuple[int, ...], str]:
    try:
        return tuple(int(d) for d in ty.shape), str(ty.dtype)
    except (TypeError, ValueError, AttributeError) as err:
        raise UnsupportedShapeError(f"cross-running a model needs static shapes; got {ty}") from err


def plan_model(mod: tvm.IRModule, target: tvm.target.Target) -> ModelPlan:
    """Run the ``tpp`` kernel passes for ``target`` and list ``main``'s kernel calls."""
    report = LoweringReport()
    with target:
        mod = tvm.transform.Sequential(tpp_kernel_passes(target, report))(mod)
    main = mod["main"]
    plan = ModelPlan(tvm.IRModule(), report=report)
    slots: dict = {}  # relax.Var -> slot

    def new_slot(ty) -> int:
        plan.tensors.append(_slot_type(ty))
        return len(plan.tensors) - 1

    def slot_of(arg) -> int:
        if isinstance(arg, relax.Var):
            return slots[arg]
        if isinstance(arg, tvm.ir.GenericConst):
            value = arg.value.numpy()
            slot = new_slot(relax.TensorType(value.shape, str(value.dtype)))
            plan.constants[slot] = value
            return slot
        raise UnsupportedOperatorError(f"kernel argument {arg} is neither a tensor nor a weight")

    for param in main.params:
        slots[param] = new_slot(param.ty)
        plan.inputs.append(slots[param])
    kernels = {}
    for block in main.body.blocks:
        for binding in block.bindings:
            call = binding.value
            if not (isinstance(call, tvm.ir.Call) and call.op.same_as(_CALL_TIR)):
                raise UnsupportedOperatorError(
                    f"cannot run {binding.var.name} = {call} without the Relax VM: only "
                    "call_tir bindings are supported")
            if len(call.args) > 2:
                raise UnsupportedShapeError(f"{call.args[0].name_hint}: symbolic shape arguments")
            if isinstance(binding.var.ty, relax.TupleType):
                raise UnsupportedOperatorError(
                    f"{call.args[0].name_hint} has several outputs; not supported here")
            args = [slot_of(a) for a in call.args[1].fields]
            slots[binding.var] = new_slot(binding.var.ty)
            name = call.args[0].name_hint
            kernels[name] = mod[call.args[0]].with_attr("global_symbol", name)
            plan.calls.append(Call(name, (*args, slots[binding.var])))
    result = main.body.body
    outputs = result.fields if isinstance(result, relax.Tuple) else [result]
    plan.outputs = [slot_of(out) for out in outputs]
    plan.kernels = tvm.IRModule(kernels)
    return plan

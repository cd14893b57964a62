"""A whole training step compiled onto TPPs: forward, loss, backward, optimizer update.

``compile_training_step(model, loss=..., optimizer=...)`` builds one Relax function

    main(inputs..., labels, params..., states..., scalars)
        -> (loss, new params..., new states...)

from the model's forward function: the loss is appended, Relax's ``Gradient`` pass derives
the backward graph, and the optimizer update of all parameters is one fused kernel
(``optim.py``). The function goes through the ``tpp`` pipeline like any model, so the
backward's GEMMs with transposed operands, bias-gradient column sums and activation
backward forms become TPP kernels (``relay_passes/patterns/``). The returned
:class:`TrainingStep` keeps parameters and optimizer state on the device between steps.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax

from ..compiled import linked_kernels, virtual_machine
from ..errors import UnsupportedShapeError
from ..intrinsics.registry import target_vector_isa
from ..relay_passes.pipeline import build
from ..relay_passes.report import LoweringReport
from ..runtime import configure_threads, install, target_threads, use_threads
from ..target import target as tpp_target
from . import gradients  # noqa: F401 - registers the TPP-backed gradients
from .loss import label_type, loss_spec
from .optim import SGD, AdamW, Optimizer, optimizer_kernel


@dataclass
class Model:
    """A trainable model: ``mod["main"](inputs..., params...)`` and the initial params.

    ``params`` is ordered like main's parameters after the first ``num_input``.
    """

    mod: tvm.IRModule
    params: dict[str, np.ndarray]
    num_input: int = 1

    def param_vars(self) -> list[relax.Var]:
        return list(self.mod["main"].params[self.num_input:])

    def input_vars(self) -> list[relax.Var]:
        return list(self.mod["main"].params[: self.num_input])


def _fresh(var: relax.Var, name: str | None = None) -> relax.Var:
    return relax.Var(name or str(var.name), var.ty)


def _shape(ty: relax.TensorType) -> tuple[int, ...]:
    return tuple(int(d) for d in ty.shape.values)


def _inline(mod: tvm.IRModule, names: list[str]) -> tvm.IRModule:
    for name in names:
        gv = mod.get_global_var(name)
        mod[gv] = mod[gv].without_attr("global_symbol")
    mod = relax.transform.InlinePrivateFunctions()(mod)
    mod = relax.transform.DeadCodeElimination()(mod)
    return relax.transform.ConvertToDataflow()(relax.transform.CanonicalizeBindings()(mod))


def training_module(model: Model, loss: str, optimizer: Optimizer,
                    target: tvm.target.Target | None = None) -> tvm.IRModule:
    """The Relax module of one training step (see the module docstring for its signature).

    ``target`` sets the vector width of the optimizer update (its ISA's fp32 lanes;
    AVX-512's when None)."""
    build_loss, _, _ = loss_spec(loss)
    forward = model.mod["main"]
    out_ty = forward.ret_ty if hasattr(forward, "ret_ty") else forward.body.ty
    if not isinstance(out_ty, relax.TensorType):
        raise UnsupportedShapeError(
            f"training: the model must return one tensor (its output), got {out_ty}")
    mod = tvm.IRModule({k: v for k, v in model.mod.functions.items() if k.name_hint != "main"})
    inputs = [_fresh(v) for v in model.input_vars()]
    params = [_fresh(v) for v in model.param_vars()]
    labels = relax.Var("labels", label_type(loss, _shape(out_ty)))
    bb = relax.BlockBuilder(mod)
    fwd = bb.add_func(forward.with_attr("global_symbol", "forward"), "forward")
    with bb.function("loss", [*inputs, labels, *params]):
        with bb.dataflow():
            out = bb.emit(relax.Call(fwd, [*inputs, *params]))
            value = bb.emit_output(build_loss(bb, out, labels))
        bb.emit_func_output(value)
    mod = _inline(bb.get(), ["forward"])
    loss_fn = mod["loss"]
    grad_params = list(loss_fn.params[len(inputs) + 1:])
    mod = relax.transform.Gradient("loss", require_grads=grad_params, target_index=0)(mod)
    lanes = target_vector_isa(target).schedule_lanes("float32")
    mod = _add_step(mod, inputs, labels, params, optimizer, lanes)
    del mod[mod.get_global_var("loss")]
    return mod


def _add_step(mod: tvm.IRModule, inputs: list[relax.Var], labels: relax.Var,
              params: list[relax.Var], optimizer: Optimizer, lanes: int) -> tvm.IRModule:
    """``main``: the loss and gradients (``loss_adjoint``, inlined), then the in-place
    optimizer update of every parameter and state in one kernel call."""
    shapes = [_shape(p.ty) for p in params]
    n_states = len(optimizer.state_names)
    opt_func = optimizer_kernel(optimizer, shapes, lanes).without_attr("global_symbol").with_attrs(
        {"op_pattern": 8, "tirx.is_scheduled": True, "tirx.noalias": True})
    s_inputs = [_fresh(v) for v in inputs]
    s_labels = _fresh(labels)
    s_params = [_fresh(v) for v in params]
    s_states = [relax.Var(f"{name}.{p.name}", p.ty)
                for name in optimizer.state_names for p in params]
    scalars = relax.Var("scalars", relax.TensorType((len(optimizer.scalars(1)),), "float32"))
    bb = relax.BlockBuilder(mod)
    opt_gv = bb.add_func(opt_func, "optimizer_update")
    with bb.function("main", [*s_inputs, s_labels, *s_params, *s_states, scalars]):
        with bb.dataflow():
            res = bb.emit(relax.Call(bb.get().get_global_var("loss_adjoint"),
                                     [*s_inputs, s_labels, *s_params]))
            loss_v = bb.emit(relax.TupleGetItem(res, 0))
            grads_t = bb.emit(relax.TupleGetItem(res, 1))
            grads = [bb.emit(relax.TupleGetItem(grads_t, i)) for i in range(len(params))]
            out_types = [p.ty for p in params] * (1 + n_states)
            n = len(params)
            # Params and states are updated in place: outputs alias those inputs.
            inplace = list(range(n)) + list(range(2 * n, 2 * n + n * n_states))
            upd = bb.emit(relax.op.call_tir_inplace(
                opt_gv, relax.Tuple([*s_params, *grads, *s_states, scalars]), inplace,
                out_types))
            outs = [loss_v] + [bb.emit(relax.TupleGetItem(upd, i)) for i in range(len(out_types))]
            result = bb.emit_output(relax.Tuple(outs))
        bb.emit_func_output(result)
    return _inline(bb.get(), ["loss_adjoint"])


class TrainingStep:
    """A compiled training step holding parameters and optimizer state on the device.

    ``step(*inputs, labels)`` runs forward, backward and the update, and returns the loss;
    ``params`` reads the current parameters back as numpy arrays.
    """

    def __init__(self, exe: relax.VMExecutable, model: Model, loss: str,
                 optimizer: Optimizer, report: LoweringReport, threads: int,
                 compile_seconds: float, target: tvm.target.Target | None = None) -> None:
        self.threads = configure_threads(threads)
        self.optimizer = optimizer
        self.loss = loss
        self.report = report
        self.compile_seconds = compile_seconds
        self.num_input = model.num_input
        self._names = list(model.params)
        self._dev = tvm.cpu()
        # The kernels linked as an exported model's are (TVM's JIT made slower code), so
        # they run on tpp_tvm's thread pool; the folder goes with the step.
        self._linked = linked_kernels(exe, target) if target is not None else None
        self._vm = virtual_machine(exe, self._linked[0] if self._linked else None)
        install()
        self._params = [tvm.runtime.tensor(np.ascontiguousarray(v, dtype="float32"), self._dev)
                        for v in model.params.values()]
        self._states = [tvm.runtime.tensor(np.zeros(np.shape(v), "float32"), self._dev)
                        for _ in optimizer.state_names for v in model.params.values()]
        self._label_dtype = loss_spec(loss)[1]
        self.steps = 0

    def _args(self, inputs: tuple, labels) -> list:
        if len(inputs) != self.num_input:
            raise UnsupportedShapeError(
                f"training step takes {self.num_input} inputs and labels, got {len(inputs)}")
        self.steps += 1
        ins = [tvm.runtime.tensor(np.ascontiguousarray(x, dtype="float32"), self._dev)
               for x in inputs]
        lab = tvm.runtime.tensor(np.ascontiguousarray(labels, dtype=self._label_dtype),
                                 self._dev)
        scalars = tvm.runtime.tensor(self.optimizer.scalars(self.steps), self._dev)
        return [*ins, lab, *self._params, *self._states, scalars]

    def step(self, *inputs, labels) -> float:
        """One training step on a batch; returns the loss before the update."""
        use_threads(self.threads)
        out = self._vm["main"](*self._args(inputs, labels))
        n = len(self._params)
        self._params = [out[1 + i] for i in range(n)]
        self._states = [out[1 + n + i] for i in range(len(self._states))]
        return float(out[0].numpy())

    @property
    def params(self) -> dict[str, np.ndarray]:
        return {k: v.numpy() for k, v in zip(self._names, self._params)}

    def profile(self, *inputs, labels, repeat: int = 3) -> list[tuple[str, float, int]]:
        """Per-kernel time of one step (the parameters move on as it runs)."""
        from ..profiling import profile_vm

        args = self._args(inputs, labels)
        return profile_vm(self._vm, args, repeat)


def compile_training_step(model: Model, loss: str = "mse",
                          optimizer: Optimizer | None = None,
                          target: tvm.target.Target | None = None) -> TrainingStep:
    """Compile forward + ``loss`` + backward + ``optimizer`` update onto TPPs.

    ``model`` is a :class:`Model` (see ``training.models`` for MLP, BERT layer, small CNN);
    ``loss`` is ``"mse"`` or ``"cross_entropy"`` (integer class labels); ``optimizer`` is
    :class:`SGD` or :class:`AdamW` (default ``SGD(lr=0.01)``).
    """
    optimizer = optimizer if optimizer is not None else SGD(lr=0.01)
    if not isinstance(optimizer, SGD | AdamW):
        raise TypeError(f"optimizer must be SGD or AdamW, got {type(optimizer).__name__}")
    tgt = target if target is not None else tpp_target()
    tgt = tgt if isinstance(tgt, tvm.target.Target) else tvm.target.Target(tgt)
    t0 = time.perf_counter()
    mod = training_module(model, loss, optimizer, tgt)
    report = LoweringReport()
    exe = build(mod, tgt, report=report)
    return TrainingStep(exe, model, loss, optimizer, report, target_threads(tgt),
                        time.perf_counter() - t0, tgt)

"""Compile every TPP, schedule and demo model for one CPU, down to machine code.

A kernel that builds for the CPU tpp_tvm was developed on can still kill the process inside
LLVM for another one (``Do not know how to split this operator's operand!`` on a bf16 tail
for ``icelake-server``), and TVM generates machine code lazily, so only code generation
proves a build. ``python -m tpp_tvm.compile_check --mcpu icelake-server`` (or ``--tag
tpp/amx``) compiles each item and prints one line per item before and after it
(``start <item>``, then ``ok``, ``refused: <why>`` for a clear :class:`TPPError`, or
``error: <why>``), so a parent process can tell which item an LLVM abort happened in. The
test suite runs it once per CPU in a subprocess (``tests/test_compile_check.py``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator

import tvm
from tvm import s_tir

from tpp_tvm.errors import TPPError
from tpp_tvm.target import isa_of

#: The x86 CPUs every build must compile for, oldest first (LLVM ``mcpu`` names).
X86_CPUS: tuple[str, ...] = ("skylake-avx512", "cascadelake", "icelake-server",
                             "sapphirerapids", "graniterapids", "znver4", "znver5")

Item = tuple[str, Callable[[tvm.target.Target], None]]


def check_target(mcpu: str | None = None, tag: str = "tpp/avx512") -> tvm.target.Target:
    """The one-core TPP target for ``tag`` with ``mcpu`` (default: the tag's own CPU)."""
    config: dict = {"tag": tag, "num-cores": 1}
    if mcpu:
        config["mcpu"] = mcpu
    return tvm.target.Target(config)


def generate_machine_code(module: tvm.runtime.Module) -> None:
    """Run LLVM's code generation for ``module`` and everything it imports."""
    if module.kind == "llvm":
        module.inspect_source("asm")
    for sub in module.imports:
        generate_machine_code(sub)


def _compile_tir(mod: tvm.IRModule, tgt: tvm.target.Target) -> None:
    from tpp_tvm.tir_pipeline import compile_kernels

    generate_machine_code(compile_kernels(mod, tgt).mod)


def _tpp_items() -> Iterator[Item]:
    from tpp_tvm.intrinsics import intrinsic
    from tpp_tvm.intrinsics.reference import BLOCK, workload
    from tpp_tvm.intrinsics.registry import catalogue, low_precision_catalogue
    from tpp_tvm.schedules.gemm_plan import register_tile_isa

    def implementation(spec, isa: str):
        """The target ISA's implementation; on AMX, shapes the tiles do not take use the
        AVX-512 one, as an AMX target's schedules do."""
        try:
            return intrinsic(spec, isa)
        except TPPError:
            if register_tile_isa(isa) == isa:
                raise
            return intrinsic(spec, register_tile_isa(isa))

    for spec in [*catalogue(), *low_precision_catalogue()]:
        def build(tgt: tvm.target.Target, spec=spec) -> None:
            sch = s_tir.Schedule(workload(spec))
            sch.tensorize(sch.get_loops(sch.get_sblock(BLOCK))[0],
                          implementation(spec, isa_of(tgt)))
            _compile_tir(sch.mod, tgt)

        yield f"tpp {spec.name('avx512')}", build


def _schedule_items() -> Iterator[Item]:
    from tpp_tvm.intrinsics.epilogue import Epilogue
    from tpp_tvm.runtime import target_threads
    from tpp_tvm.schedules import attention, conv, gemm, pool, rowwise, winograd

    def gemm_item(dtype: str, **options) -> Callable[[tvm.target.Target], None]:
        def build(tgt: tvm.target.Target) -> None:
            sch, _ = gemm.gemm_schedule(37, 100, 64, isa_of(tgt), dtype=dtype,
                                        threads=target_threads(tgt), **options)
            _compile_tir(sch.mod, tgt)
        return build

    bias_gelu = Epilogue(bias=True, activation="gelu")
    yield "gemm f32 37x100x64 bias gelu", gemm_item("float32", epilogue=bias_gelu)
    yield "gemm f32 batched", gemm_item("float32", batch=3)
    yield "gemm bf16 37x100x64", gemm_item("bfloat16")
    yield "gemm bf16 bias gelu", gemm_item("bfloat16", epilogue=bias_gelu)
    yield "gemm int8 37x100x64", gemm_item("int8")
    relu = Epilogue(activation="relu")
    yield "gemm int8 dequantize relu", gemm_item("int8", dequantize=True, epilogue=relu)
    yield "gemm int16 dequantize relu", gemm_item("int16", dequantize=True, epilogue=relu)

    def conv_item(dtype: str) -> Callable[[tvm.target.Target], None]:
        def build(tgt: tvm.target.Target) -> None:
            shape = conv.ConvShape(1, 14, 14, 24, 40, 3, 3, 1, (1, 1, 1, 1))
            sch, _ = conv.conv_schedule(shape, isa_of(tgt), dtype=dtype,
                                        epilogue=Epilogue(bias=True, activation="relu"))
            _compile_tir(sch.mod, tgt)
        return build

    yield "conv2d f32 3x3 bias relu", conv_item("float32")
    yield "conv2d f32 3x3 winograd grouped", lambda tgt: _compile_tir(winograd.winograd_schedule(
        conv.ConvShape(1, 10, 9, 64, 64, 3, 3, 1, (1, 1, 1, 1), 2), isa_of(tgt),
        epilogue=Epilogue(bias=True, activation="relu", residual=True))[0].mod, tgt)
    yield "conv2d int8 3x3 bias relu", conv_item("int8")
    yield "conv2d int16 3x3 bias relu", conv_item("int16")
    yield "layer_norm 196x768", lambda tgt: _compile_tir(
        rowwise.layer_norm_schedule(196, 768, 1e-5, isa_of(tgt)).mod, tgt)
    yield "softmax 49x77", lambda tgt: _compile_tir(
        rowwise.softmax_schedule(49, 77, isa_of(tgt)).mod, tgt)
    yield "attention 4x64x64 masked", lambda tgt: _compile_tir(attention.attention_schedule(
        attention.AttentionShape(4, 64, 64, 64, 2, 0.125, True), isa_of(tgt)).mod, tgt)
    yield "attention bf16 tiles 4x64x96 masked", lambda tgt: _compile_tir(
        attention.attention_tile_schedule(attention.AttentionShape(4, 64, 96, 64, 2, 0.125, True),
                                          target_threads(tgt)).mod, tgt)
    yield "max_pool 3x3/2", lambda tgt: _compile_tir(pool.max_pool_schedule(
        pool.PoolShape(1, 15, 15, 32, 3, 3, 2, (1, 1, 1, 1)), isa_of(tgt)).mod, tgt)


def _model_items() -> Iterator[Item]:
    from tpp_tvm.cli import demo_models

    for label, generate in demo_models(full=False):
        def build(tgt: tvm.target.Target, generate=generate) -> None:
            from tpp_tvm.compiled import compile_onnx

            generate_machine_code(compile_onnx(generate(), target=tgt)._module.mod)

        yield f"model {label.split(' ')[0]}", build


def items(models: bool = True) -> list[Item]:
    """Everything the check compiles, as (label, build for a target)."""
    found = [*_tpp_items(), *_schedule_items()]
    return found + list(_model_items()) if models else found


def run(tgt: tvm.target.Target, models: bool = True, out=sys.stdout) -> int:
    """Compile every item for ``tgt``, one status line each; the number of errors."""
    errors = 0
    for label, build in items(models):
        print(f"start {label}", file=out, flush=True)
        try:
            build(tgt)
        except TPPError as exc:
            print(f"refused {label}: {exc}", file=out, flush=True)
        except Exception as exc:  # noqa: BLE001 - every failure is reported by name
            errors += 1
            first = str(exc).strip().splitlines()[-1:] or [type(exc).__name__]
            print(f"error {label}: {type(exc).__name__}: {first[0]}", file=out, flush=True)
        else:
            print(f"ok {label}", file=out, flush=True)
    return errors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mcpu", help="LLVM CPU name (default: the tag's)")
    parser.add_argument("--tag", default="tpp/avx512", help="TPP target tag")
    parser.add_argument("--no-models", action="store_true", help="skip the demo models")
    args = parser.parse_args(argv)
    return 1 if run(check_target(args.mcpu, args.tag), not args.no_models) else 0


if __name__ == "__main__":
    sys.exit(main())

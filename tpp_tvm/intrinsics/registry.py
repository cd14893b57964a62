"""Registry of TPP tensor intrinsics: names, lookup by TPP + dtype + ISA, lazy registration.

An intrinsic is registered with TVM (``TensorIntrin.register``) the first time a schedule or
user asks for it, because TPPs are generated per tile shape and the shape set is open. The
catalogue (every primitive at a representative shape) is registered on the first call of
:func:`registered`, so listing shows the whole TPP set.
"""

from __future__ import annotations

import importlib
import threading
from concurrent.futures import ThreadPoolExecutor

from tvm import tirx
from tvm.s_tir import TensorIntrin
from tvm.target import Target

from ..errors import UnsupportedISAError
from ..target import ISAS, isa_of
from .kinds import describe, examples
from .spec import DTYPE_SHORT, POOL_DTYPES, TPPSpec
from .vector_isa import VectorISA

_lock = threading.RLock()
_names: dict[str, tuple[TPPSpec, str]] = {}


def _isa_module(isa: str):
    """The implementation module of TPP ISA ``isa`` (``target.ISAS``): one per ISA here."""
    if isa not in ISAS:
        raise UnsupportedISAError(f"unknown TPP ISA {isa!r}; supported: {', '.join(ISAS)}")
    try:
        return importlib.import_module(f"{__package__}.{isa}")
    except ModuleNotFoundError as err:
        raise UnsupportedISAError(f"no {isa} implementation of the TPPs is available") from err


def _implementer(isa: str):
    return _isa_module(isa).implement


def vector_isa(isa: str) -> VectorISA:
    """The vector unit ``isa``'s implementations are written for: the one source of lane
    and register counts for schedules too."""
    return _isa_module(isa).VECTOR_ISA


def target_vector_isa(target: Target | str | dict | None) -> VectorISA:
    """The vector unit of ``target``'s TPP ISA. ``None`` and CPU targets with no TPP ISA
    (no AVX2, AVX-512 or SVE) get AVX-512's: their plain loops are vectorized at its width,
    which narrower units run as two or four registers."""
    try:
        return vector_isa(isa_of(target) if target is not None else "avx512")
    except UnsupportedISAError:
        return vector_isa("avx512")


def implementation(spec: TPPSpec, isa: str = "avx512") -> tirx.PrimFunc:
    """The ISA implementation PrimFunc of ``spec`` (not registered)."""
    return _implementer(isa)(spec)


def intrinsic(spec: TPPSpec, isa: str = "avx512") -> str:
    """Register (once) and return the tensor intrinsic name implementing ``spec`` on ``isa``."""
    name = spec.name(isa)
    with _lock:
        if name in _names and _names[name] != (spec, isa):
            # Two specs must never share a name: the second would silently get the first's
            # implementation.
            raise RuntimeError(f"TPP name collision: {name} for {spec} and {_names[name][0]}")
        if name not in _names:
            desc, impl = on_short_stack(lambda: (describe(spec), implementation(spec, isa)))
            TensorIntrin.register(name, desc, impl, override=True)
            _names[name] = (spec, isa)
    return name


def on_short_stack(fn):
    """Run ``fn`` in a fresh thread. TVMScript's parser inspects every frame of the calling
    stack (``inspect.getouterframes``, each scanning ``sys.modules``): deep inside pytest or
    a MetaSchedule rule that made one registration take seconds instead of milliseconds."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(fn).result()


def spec_of(name: str) -> TPPSpec:
    """The spec of a registered intrinsic name."""
    return _names[name][0]


def catalogue(dtype: str = "float32") -> list[TPPSpec]:
    """Every primitive of the TPP set at a representative tile (with tails: N=37), as each
    kind chooses its examples (``TPPKind.examples``)."""
    return examples(dtype)


def low_precision_catalogue() -> list[TPPSpec]:
    """The bf16, u8 x s8 and s16 x s16 contractions (VNNI-packed B, with an N tail), the
    fp32 <-> bf16 conversions and bf16 element-wise TPPs, at representative tiles."""
    specs = []
    for a, b in (("bfloat16", None), ("uint8", "int8"), ("int16", None)):
        for beta in (0, 1):
            specs.append(TPPSpec("gemm", a, b_dtype=b, m=6, n=37, k=64, beta=beta))
            specs.append(TPPSpec("brgemm", a, b_dtype=b, m=4, n=64, k=32, batch=4, beta=beta))
    specs.append(TPPSpec("copy", "float32", m=8, n=37, out_dtype="bfloat16"))
    specs.append(TPPSpec("copy", "bfloat16", m=8, n=37, out_dtype="float32"))
    specs.append(TPPSpec("gelu", "bfloat16", m=8, n=37))
    specs.append(TPPSpec("add", "bfloat16", m=8, n=37, bcast="row"))
    specs.append(TPPSpec("pool_max", "uint8", m=8, n=37, batch=3, k=3, stride=74))
    return specs


#: ISAs whose whole catalogue is registered by :func:`registered` (AMX has no fp32 set).
_CATALOGUE_ISAS = ("avx512", "avx2", "sve")


def portable(spec: TPPSpec) -> bool:
    """Whether every ISA implements ``spec``: fp32 in and out, or max pooling of u8/s8
    (the one template on integer lanes). Low-precision and quantization TPPs exist for
    AVX-512 (and AMX) only so far."""
    if spec.op == "pool_max":
        return spec.dtype in POOL_DTYPES
    return spec.dtype == "float32" and spec.acc_dtype == "float32"


def implements(spec: TPPSpec, isa: str) -> bool:
    """Whether ``isa`` has an implementation of ``spec``: every portable TPP; a
    low-precision contraction where the ISA's vector unit has its dot product (AVX2: s16
    pairs only); the other low-precision TPPs on AVX-512."""
    if portable(spec):
        return True
    if spec.vnni > 1:
        return (spec.dtype, spec.b_dtype or spec.dtype) in vector_isa(isa).dot_dtypes
    return isa == "avx512"


def catalogue_names(isa: str | None = None) -> list[str]:
    """Names of the catalogue's intrinsics on ``isa`` (default: every ISA with a whole
    catalogue), without building them (building all takes ~40 ms each: TVMScript parsing).
    Imports each ISA's implementation module, so a broken one raises here."""
    return sorted(spec.name(spec_isa) for spec, spec_isa in _catalogue_specs(isa))


def _catalogue_specs(isa: str | None = None) -> list[tuple[TPPSpec, str]]:
    """(spec, ISA) of every catalogue intrinsic on ``isa`` (default: every ISA with a whole
    catalogue; another ISA has none), importing each ISA's implementation module."""
    out = []
    for cat_isa in _CATALOGUE_ISAS if isa is None else (isa,):
        if cat_isa in _CATALOGUE_ISAS:
            _isa_module(cat_isa)
            out += [(spec, cat_isa) for spec in catalogue() + low_precision_catalogue()
                    if implements(spec, cat_isa)]
    return out


def registered(isa: str | None = None, dtype: str | None = None) -> list[str]:
    """Names of the registered TPP intrinsics, optionally filtered by ISA and dtype.

    ``dtype`` may be given long (``float32``) or short (``f32``).
    """
    for spec, spec_isa in _catalogue_specs(isa):
        intrinsic(spec, spec_isa)
    short = DTYPE_SHORT.get(dtype, dtype) if dtype else None
    out = []
    for name, (spec, spec_isa) in _names.items():
        if isa is not None and spec_isa != isa:
            continue
        if short is not None and DTYPE_SHORT[spec.dtype] != short:
            continue
        out.append(name)
    return sorted(out)

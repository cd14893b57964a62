"""What the graph passes did, as data: one row per kind of TPP kernel, counted.

A :class:`KernelRow` says what a kernel is (the pattern it took, the lowering family that
built it, its GEMM precision, the unit it runs on, whether a tuned schedule replaced the
hand one); the report counts rows. Text is made from rows only where people read it
(:meth:`LoweringReport.summary`, ``CompiledModel.report``): ``tpp.dense_bias [bf16, amx]``
is a rendering, never read back. An exported model's sidecar stores the rows
(:data:`SIDECAR_FORMAT` 2); :func:`rows_from_labels` reads the label strings that format 1
stored, once, at load time.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field

#: Vector registers (AVX-512, AVX2, SVE): every kernel that is not on tiles.
VECTOR = "vector"
#: AMX tiles.
AMX = "amx"
UNITS = (VECTOR, AMX)

#: How the report text names a kernel's precision (fp32 is named by nothing); ``int16``
#: is an int8 model's GEMM on s16 dot products (AVX2's vpmaddwd: the same int32 sums).
PRECISION_TAGS = {"bfloat16": "bf16", "int8": "int8", "int16": "int8 via int16"}
#: Precisions of kernels that compute on quantized (int8) data.
QUANTIZED = frozenset({"int8", "int16"})

#: The sidecar's report format: 2 stores :class:`KernelRow` fields; 1 (no ``format`` key)
#: stored report labels.
SIDECAR_FORMAT = 2


@dataclass(frozen=True)
class KernelRow:
    """One kind of TPP kernel a lowering emitted (the report counts them).

    ``pattern``: what it computes, as the report names it: a composite's pattern
    (``tpp.dense_bias``), a quantized layer with its fused epilogue
    (``tpp.qdq_conv2d_bias_relu``), a training kernel (``tpp.gelu_inv``).
    ``family``: the lowering that built it (``dense``, ``conv2d``, ``int8_matmul``,
    ``backward``, ``contraction``...; empty where not recorded: a format-1 sidecar).
    ``precision``: its GEMM dtype (``float32``, ``bfloat16``, ``int8``, ``int16``).
    ``unit``: :data:`VECTOR` or :data:`AMX`. ``tuned``: a MetaSchedule kernel from a tuning
    log ran instead of the hand schedule."""

    pattern: str
    family: str = ""
    precision: str = "float32"
    unit: str = VECTOR
    tuned: bool = False

    def __post_init__(self) -> None:
        if self.unit not in UNITS:
            raise ValueError(f"kernel row {self.pattern}: unit {self.unit!r}, one of {UNITS}")
        if self.precision != "float32" and self.precision not in PRECISION_TAGS:
            raise ValueError(f"kernel row {self.pattern}: precision {self.precision!r}, one of "
                             f"float32, {', '.join(PRECISION_TAGS)}")

    @property
    def on_tiles(self) -> bool:
        return self.unit == AMX

    @property
    def quantized(self) -> bool:
        """Whether it computes on int8 data (an int8 kernel, or int16 for it)."""
        return self.precision in QUANTIZED

    def label(self) -> str:
        """The report's text for this row: ``<pattern>``, ``<pattern> [bf16]``,
        ``<pattern> [int8, amx]`` (on AMX tiles), ``<pattern> (tuned)``."""
        marks = [PRECISION_TAGS[self.precision]] if self.precision != "float32" else []
        marks += [AMX] if self.on_tiles else []
        text = f"{self.pattern} [{', '.join(marks)}]" if marks else self.pattern
        return f"{text} (tuned)" if self.tuned else text


def unit_of(on_tiles: bool) -> str:
    """:data:`AMX` where a kernel runs on tiles, else :data:`VECTOR`."""
    return AMX if on_tiles else VECTOR


def labels(rows: Mapping[KernelRow, int]) -> Counter:
    """The rows as report text: label -> count (for people, and for readers of
    ``report_data["lowered"]``)."""
    out: Counter = Counter()
    for row, count in rows.items():
        out[row.label()] += count
    return out


def rows_to_json(rows: Mapping[KernelRow, int]) -> list[dict]:
    """The rows as the sidecar stores them: each row's fields and its ``count``."""
    return [asdict(row) | {"count": count}
            for row, count in sorted(rows.items(), key=lambda item: item[0].label())]


def rows_from_json(items: Iterable[Mapping]) -> Counter:
    """The rows :func:`rows_to_json` wrote."""
    rows: Counter = Counter()
    for item in items:
        fields = {key: value for key, value in item.items() if key != "count"}
        rows[KernelRow(**fields)] += int(item["count"])
    return rows


def rows_from_labels(lowered: Mapping[str, int]) -> Counter:
    """The rows of a format-1 sidecar, which stored the report's text (``lowered``: label
    -> count). The one place a label is read back: the legacy file format made of them.
    Format 1 labels were ``<pattern>``, ``<pattern> (tuned)`` and ``<pattern> [<tag>]`` or
    ``[<tag>, amx]`` with a tag of :data:`PRECISION_TAGS`; the family was not recorded."""
    from_tag = {tag: precision for precision, tag in PRECISION_TAGS.items()}
    rows: Counter = Counter()
    for label, count in lowered.items():
        pattern, tuned = label, label.endswith(" (tuned)")
        if tuned:
            pattern = pattern.removesuffix(" (tuned)")
        precision, unit = "float32", VECTOR
        head, _, marks = pattern.partition(" [")
        if marks.endswith("]"):
            tag, _, tiles = marks[:-1].partition(", ")
            if tag in from_tag and tiles in ("", AMX):
                pattern, precision, unit = head, from_tag[tag], unit_of(tiles == AMX)
        rows[KernelRow(pattern, precision=precision, unit=unit, tuned=tuned)] += int(count)
    return rows


@dataclass
class LoweringReport:
    """What the graph pass did: kernels by :class:`KernelRow`, and fallbacks with their
    reasons."""

    kernels: Counter = field(default_factory=Counter)
    """:class:`KernelRow` -> how many such kernels were emitted."""
    fallbacks: Counter = field(default_factory=Counter)
    precision: str = "float32"
    rewrites: Counter = field(default_factory=Counter)
    """Graph rewrites that change no kernel count but the user should know about."""
    default_scheduled: list = field(default_factory=list)
    """Functions no TPP kernel took: TVM's fused ops on the default (parallel, vectorized)
    schedules of ``schedules/default.py``, by name."""
    tpp_functions: list = field(default_factory=list)
    """Functions holding TPP-scheduled kernels (hand schedules, tuned ones), by name: the
    symbols a profile of the model times as TPP kernels."""

    @property
    def lowered(self) -> Counter:
        """The kernels as report text, label -> count (see :meth:`KernelRow.label`)."""
        return labels(self.kernels)

    def summary(self) -> str:
        lines = [f"  {k}: {v}" for k, v in sorted(self.lowered.items())]
        lines += [f"  fallback {k}: {v}" for k, v in sorted(self.fallbacks.items())]
        return "\n".join(lines) if lines else "  (no TPP subgraphs)"

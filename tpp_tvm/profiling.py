"""Per-kernel time of a compiled model, from the Relax VM's instrumentation hook.

Answers "where does the time go" without an external profiler: every VM call instruction
(a TPP kernel, a fallback kernel, a reshape) is timed and summed by symbol name.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

from tvm import relax


def profile_vm(
    vm: relax.VirtualMachine, args: list, repeat: int = 5
) -> list[tuple[str, float, int]]:
    """(symbol, mean ms per run, calls per run) for every called function, slowest first."""
    totals: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    starts: dict[str, float] = {}

    def instrument(func, name, before_run, ret_value, *fargs):
        name = str(name)
        if before_run:
            starts[name] = time.perf_counter()
        else:
            totals[name] += time.perf_counter() - starts.pop(name, time.perf_counter())
            counts[name] += 1
        return 0

    vm["main"](*args)
    vm.set_instrument(instrument)
    try:
        for _ in range(repeat):
            vm["main"](*args)
    finally:
        vm.set_instrument(None)
    rows = [(k, 1e3 * v / repeat, counts[k] // repeat) for k, v in totals.items()]
    return sorted(rows, key=lambda r: -r[1])


@contextmanager
def peak_rss(interval_s: float = 0.05) -> Iterator[dict]:
    """Sample this process's resident memory while the block runs; on exit the yielded
    dict holds ``peak_mib`` (the largest sample) and ``start_mib``. A sampler thread,
    because ``ru_maxrss`` is the peak of the whole process so far, not of one compile."""
    import psutil

    proc = psutil.Process()
    result = {"start_mib": proc.memory_info().rss / 2**20}
    result["peak_mib"] = result["start_mib"]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(interval_s):
            result["peak_mib"] = max(result["peak_mib"], proc.memory_info().rss / 2**20)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield result
    finally:
        done.set()
        thread.join()
        result["peak_mib"] = max(result["peak_mib"], proc.memory_info().rss / 2**20)


def release_freed_memory() -> None:
    """Give the C heap's freed pages back to the system (glibc's ``malloc_trim``; nothing
    elsewhere). A compile frees about as much as the build keeps, scattered over the heap:
    without this a 0.45B decoder's build left 880 MB resident where it holds 470."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc
        return
    if trim is not None:
        trim(0)
    release_compiler_pages()


#: ``madvise`` advice that reclaims pages at once (Linux 5.4+), and the shared libraries
#: whose pages only compiling reads.
MADV_PAGEOUT = 21
COMPILER_LIBRARIES = ("libtvm_compiler",)


def release_compiler_pages() -> None:
    """Hand back the read-only pages of TVM's compiler library (LLVM's code and tables)
    that a compile touched: a compiled model never runs them, yet they stayed resident (49
    MB of a 0.45B decoder session's 518 on Zen 4). Another compile reads them in again.
    Nothing happens where ``madvise`` or ``/proc/self/maps`` is missing (not Linux)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name, use_errno=True) if name else None
        with open("/proc/self/maps") as maps:
            lines = maps.read().splitlines()
    except OSError:
        return
    if libc is None or not hasattr(libc, "madvise"):
        return
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    for line in lines:
        fields = line.split()
        if len(fields) < 6 or "w" in fields[1] or \
                not any(lib in fields[5] for lib in COMPILER_LIBRARIES):
            continue
        start, end = (int(x, 16) for x in fields[0].split("-"))
        libc.madvise(start, end - start, MADV_PAGEOUT)  # advice only: errors ignored

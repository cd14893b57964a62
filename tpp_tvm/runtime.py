"""The thread pool compiled TPP kernels run their parallel loops on, and its size.

TVM's generated code splits each parallel loop into shares and hands them to a launcher
(``TVMBackendParallelLaunch``). TVM's own pool gives share k to thread k and waits for all:
when another process takes a core, a kernel waits a scheduler tick for a worker that is not
running, and transformers with hundreds of short kernels a run slowed 8x beside one busy
process. tpp_tvm's pool (``thread_pool.c``, built with the host's C compiler on first use)
lets any thread claim any share not yet started, the caller included, so a held-up worker
costs only the shares it already runs; idle workers spin briefly, then sleep; and where the
workers keep losing their cores mid-share (time the scheduler took from a share, measured
against the thread's CPU time), launches run on the calling thread alone for a while.
:func:`install` points every loaded kernel library at it; libraries loaded where the pool
cannot be built (no C compiler) or JIT-compiled in memory keep TVM's pool.

Sizes: the pool runs as many threads as the largest model loaded asks (its target's
``num-cores``, see :func:`tpp_tvm.target.physical_cores`), and each call uses its own
model's count (:func:`use_threads`), so models of different sizes share one pool without
oversubscribing it. ``TVM_NUM_THREADS`` in the environment always wins. One launch runs at a
time: a model called from a second Python thread while another runs its kernels runs that
kernel's shares on its own thread (correct, and no more threads than cores).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from pathlib import Path

import tvm
import tvm_ffi

from .native import NativeBuildError, load_library

_LOG = logging.getLogger(__name__)
_SOURCE = Path(__file__).with_name("thread_pool.c")
#: Shares per thread a parallel loop is split into: finer shares let the caller take more
#: of a late worker's work, at some cost per share.
TASKS_PER_THREAD = 1
#: Microseconds an idle thread spins for the next kernel before it sleeps
#: (``TPP_TVM_SPIN_MICROSECONDS`` overrides: 0 on a machine shared with busy processes).
SPIN_MICROSECONDS = 50


@functools.cache
def _pool() -> ctypes.CDLL | None:
    """The pool's library, or None (TVM's pool then) where it cannot be built."""
    if os.environ.get("TPP_TVM_THREAD_POOL", "tpp") == "tvm":
        return None
    try:
        lib = load_library(_SOURCE, flags=("-pthread",))
    except NativeBuildError as exc:
        _LOG.warning("tpp_tvm's thread pool is unavailable, kernels run on TVM's: %s", exc)
        return None
    lib.tpp_pool_configure.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long]
    lib.tpp_pool_set_caller_threads.argtypes = [ctypes.c_int]
    lib.tpp_pool_pause_workers.argtypes = [ctypes.c_int]
    lib.tpp_pool_delay_workers.argtypes = [ctypes.c_long]
    for counter in ("stolen", "launches", "solo_launches", "solo_periods"):
        getattr(lib, f"tpp_pool_{counter}").restype = ctypes.c_longlong
    spin = os.environ.get("TPP_TVM_SPIN_MICROSECONDS", "")
    lib.tpp_pool_configure(1, TASKS_PER_THREAD, int(spin) if spin.isdigit() else
                           SPIN_MICROSECONDS)
    return lib


def install() -> bool:
    """Point every kernel library loaded in this process at tpp_tvm's pool; True if the
    pool runs them (False: TVM's pool, where the pool cannot be built)."""
    lib = _pool()
    if lib is None:
        return False
    lib.tpp_pool_install()
    return True


def configure_threads(num_threads: int) -> int:
    """Grow the pool to ``num_threads`` (``TVM_NUM_THREADS`` wins where set); returns the
    thread count a model asking for ``num_threads`` runs with."""
    env = os.environ.get("TVM_NUM_THREADS")
    wanted = int(env) if env else max(1, int(num_threads))
    lib = _pool()
    if lib is None:
        return _configure_tvm_pool(wanted)
    if wanted > lib.tpp_pool_threads():
        lib.tpp_pool_configure(wanted, 0, -1)
    return wanted


def use_threads(num_threads: int) -> None:
    """Run this thread's next kernels on ``num_threads`` threads (at most the pool's)."""
    lib = _pool()
    if lib is not None:
        lib.tpp_pool_set_caller_threads(int(num_threads))


#: What :func:`pool_statistics` counts.
STATISTICS = ("launches", "stolen", "solo_launches", "solo_periods")


def pool_statistics() -> dict[str, int]:
    """Counts since the process started (zeros on TVM's pool): ``launches`` run in
    parallel; ``stolen`` shares the calling thread took beyond its own (work a late worker
    would have held up); ``solo_periods`` times the workers lost over a quarter of their
    share time to the scheduler (another process wanted the cores), after each of which
    launches ran on the calling thread alone for a while; ``solo_launches`` those."""
    lib = _pool()
    if lib is None:
        return dict.fromkeys(STATISTICS, 0)
    return {name: getattr(lib, f"tpp_pool_{name}")() for name in STATISTICS}


def delay_workers(microseconds: int) -> None:
    """Tests: hold each worker up this long inside every share it takes, as if the OS had
    descheduled it mid-share (0: no more)."""
    lib = _pool()
    if lib is not None:
        lib.tpp_pool_delay_workers(int(microseconds))


def pause_workers(paused: bool) -> None:
    """Tests: keep the pool's workers from taking shares, as if the OS had descheduled them."""
    lib = _pool()
    if lib is not None:
        lib.tpp_pool_pause_workers(int(paused))


def _configure_tvm_pool(num_threads: int) -> int:
    """Size TVM's own pool (where tpp_tvm's cannot be built). It assumes hyper-threading on
    x86 and would start half the logical CPUs; the first model loaded sizes it."""
    global _tvm_configured
    if "TVM_NUM_THREADS" not in os.environ and not _tvm_configured:
        os.environ["TVM_NUM_THREADS"] = str(num_threads)
        _tvm_configured = True
        if tvm.runtime.num_threads() != num_threads:
            tvm_ffi.get_global_func("runtime.config_threadpool")(0, num_threads)
    return tvm.runtime.num_threads()


_tvm_configured = False


def target_threads(tgt: tvm.target.Target) -> int:
    """The thread count a target asks for (its ``num-cores``, else 1)."""
    n = tgt.attrs.get("num-cores") if hasattr(tgt, "attrs") else None
    return int(n) if n else 1

"""Runtime settings a compiled TPP kernel needs: the size of TVM's thread pool.

TVM's CPU thread pool assumes hyper-threading on x86 and starts half the logical CPUs, so
on this kind of 2-vCPU machine it would run one thread whatever the target says. Kernels
built for a target with ``num-cores`` N call :func:`configure_threads` so N threads run.
The pool is process-wide: the first kernel loaded sizes it, and an explicit
``TVM_NUM_THREADS`` in the environment always wins.
"""

from __future__ import annotations

import os

import tvm
import tvm_ffi


def configure_threads(num_threads: int) -> int:
    """Resize TVM's CPU thread pool to ``num_threads`` (unless TVM_NUM_THREADS is set).

    Returns the number of threads the pool now runs.
    """
    global _configured
    if "TVM_NUM_THREADS" not in os.environ and num_threads >= 1 and not _configured:
        # The pool reads TVM_NUM_THREADS when it starts (first parallel call); until then
        # setting the variable is enough. Afterwards, reconfigure the running pool.
        os.environ["TVM_NUM_THREADS"] = str(int(num_threads))
        _configured = True
        if tvm.runtime.num_threads() != num_threads:
            tvm_ffi.get_global_func("runtime.config_threadpool")(0, int(num_threads))
    return tvm.runtime.num_threads()


_configured = False


def target_threads(tgt: tvm.target.Target) -> int:
    """The thread count a target asks for (its ``num-cores``, else 1)."""
    n = tgt.attrs.get("num-cores") if hasattr(tgt, "attrs") else None
    return int(n) if n else 1

"""Threads that meet without leaving Numba: a spin barrier over atomic integers (kernels/decode_step.py uses it).

A `prange` loop is a fork and a join: Numba hands the iterations to its worker threads and waits until all are done.
That costs microseconds per loop, and the loop has to end wherever the next step needs *all* of this step's results
(a matmul needs the whole input row): at decode, 4 loops per layer, 4 L per token, plus a Python call around each.
Worse, between two loops the memory system idles while one thread does the serial bits.

The other way, the one llama.cpp's CPU backend takes: start the threads once per step, give each a fixed share of
every matmul, and let them wait for each other at a *barrier* when the next step needs everyone's results:

    arrive:  gen = generation;  if I am the last to arrive (count + 1 == n): count = 0, generation += 1
             else: spin until generation != gen

A barrier costs a fraction of a fork and join when the threads arrive together. It needs atomic read-modify-write
on shared integers, which Numba does not offer; the intrinsics below emit LLVM's `atomicrmw` / atomic load and store.

The catch: a barrier is only safe if all n threads really run at the same time. OpenMP (Numba's `omp` threading
layer) guarantees that for the threads of one parallel loop; TBB does not (it may run two iterations one after the
other on one thread: a deadlock). So decode_step uses it only under `omp`, and every wait gives up after a deadline
(`TIMEOUT_CYCLES`), marks the step failed and lets the caller run the step the ordinary way.

The other catch: "at the same time" also needs a core for each thread. Beside another busy program the partner may
be waiting for a core while we spin on ours, for a whole time slice, at each of a step's 150 barriers. So a wait
spins for `SPIN_CYCLES` (longer than any wait on a quiet machine) and then yields the core on every turn.
"""
from __future__ import annotations

import platform

import numba
import numpy as np

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .isa import ARCH

# layout of the int64 `sync` array: each field on its own 64-byte cache line, so that spinning on one does not
# slow the atomic increments of another
COUNT, GENERATION, FAILED, SYNC_SIZE = 0, 8, 16, 24
# a wait this long means a partner never came: seconds of x86's time-stamp counter (it ticks at GHz rates), and of
# arm64's generic timer (it ticks at tens of MHz; a fraction of a second where it runs at 1 GHz)
TIMEOUT_CYCLES = 10_000_000_000 if ARCH == "x86" else 250_000_000

# spin this long before a waiting thread starts giving its core away (os_yield) on every turn of the loop: tens of
# microseconds, chosen, not tuned: long against the few microseconds by which two threads' equal shares of a matmul
# part on a quiet machine, so alone the yield never runs, while under load it gives the core to whoever needs it
# (docs/performance.md, "Why the kernels' constants are what they are")
SPIN_CYCLES = 200_000 if ARCH == "x86" else 4_000       # arm64's counter ticks slower (see TIMEOUT_CYCLES)
HAS_YIELD = platform.system() in ("Linux", "Darwin")      # sched_yield is POSIX: in libc / libSystem

_I64 = ir.IntType(64)
HAS_CLOCK = ARCH in ("x86", "arm64")          # a counter the deadline can read


def _element(context, builder, array_type, array, index):
    """Pointer to array[index] of a 1-d int64 array."""
    ary = context.make_array(array_type)(context, builder, array)
    return cgutils.get_item_pointer(context, builder, array_type, ary, [index])


@intrinsic
def atomic_add(typingctx, array, index, value):
    """array[index] += value as one atomic step (all threads see one total); returns the value before."""
    def codegen(context, builder, signature, args):
        p = _element(context, builder, signature.args[0], args[0], args[1])
        return builder.atomic_rmw("add", p, args[2], "seq_cst")
    return types.int64(array, index, types.int64), codegen


@intrinsic
def atomic_load(typingctx, array, index):
    """array[index], read so that what another thread wrote before its atomic store is visible after it."""
    def codegen(context, builder, signature, args):
        return builder.load_atomic(_element(context, builder, signature.args[0], args[0], args[1]), "seq_cst", 8)
    return types.int64(array, index), codegen


@intrinsic
def atomic_store(typingctx, array, index, value):
    """array[index] = value, visible to every thread's later atomic_load."""
    def codegen(context, builder, signature, args):
        builder.store_atomic(args[2], _element(context, builder, signature.args[0], args[0], args[1]), "seq_cst", 8)
        return context.get_dummy_value()
    return types.void(array, index, types.int64), codegen


@intrinsic
def cpu_relax(typingctx):
    """The spin-wait hint of this CPU: x86 `pause`, arm64 `yield` (less power, the partner thread gets the core's
    resources), nothing elsewhere. An x86 intrinsic in an arm64 build would not compile at all."""
    def codegen(context, builder, signature, args):
        if ARCH == "x86":
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                                "llvm.x86.sse2.pause")
            builder.call(fn, [])
        elif ARCH == "arm64":
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [ir.IntType(32)]),
                                                "llvm.aarch64.hint")
            builder.call(fn, [ir.Constant(ir.IntType(32), 1)])          # hint #1 = yield
        return context.get_dummy_value()
    return types.void(), codegen


@intrinsic
def os_yield(typingctx):
    """sched_yield(): let the scheduler run another thread on this core now. When more threads want the cores than
    there are (a second program, the BLAS pool still spinning, a browser), the partner a barrier waits for may be
    the one that has no core: spinning on keeps it off for a whole time slice (ms) per barrier, 150 barriers a
    step. Nothing where the C library has no sched_yield."""
    def codegen(context, builder, signature, args):
        if HAS_YIELD:
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(32), []), "sched_yield")
            builder.call(fn, [])
        return context.get_dummy_value()
    return types.void(), codegen


@intrinsic
def cycle_counter(typingctx):
    """A clock that costs a few tens of cycles to read: x86's time-stamp counter (rdtsc); elsewhere LLVM's steady
    counter (arm64: the generic timer, CNTVCT_EL0: its cycle counter PMCCNTR_EL0 traps in user space on Linux)."""
    def codegen(context, builder, signature, args):
        name = "llvm.readcyclecounter" if ARCH == "x86" else "llvm.readsteadycounter"
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_I64, []), name)
        return builder.call(fn, [])
    return types.int64(), codegen


@njit(cache=True)
def barrier(sync, n_threads, timeout_cycles):
    """Wait until all n_threads have called barrier (the k-th call of each thread meets the others' k-th call).
    Returns False, and marks sync[FAILED], if the step has failed: another thread gave up, or this one waited
    longer than timeout_cycles. After a failure every thread's next barrier returns False at once."""
    if atomic_load(sync, FAILED):
        return False
    gen = atomic_load(sync, GENERATION)
    if atomic_add(sync, COUNT, 1) == n_threads - 1:          # the last to arrive opens the barrier
        atomic_store(sync, COUNT, 0)
        atomic_add(sync, GENERATION, 1)
        return True
    start = cycle_counter()
    while atomic_load(sync, GENERATION) == gen:
        cpu_relax()
        if atomic_load(sync, FAILED):
            return False
        waited = cycle_counter() - start
        if waited > SPIN_CYCLES:           # the partner is late: likely off its core (see os_yield)
            os_yield()
        if waited > timeout_cycles:
            atomic_store(sync, FAILED, 1)
            return False
    return True


def regions_can_run(T: int, logit_rows) -> bool:
    """Can a step of T rows run as parallel regions meeting at `barrier`? Only when every row needs logits (a
    decode step: logit_rows None or 0..T-1), the deadline has a clock, and on the `omp` threading layer (the only
    one that runs the threads of a parallel loop at the same time, which a barrier needs)."""
    if not HAS_CLOCK:
        return False
    if logit_rows is not None and (len(logit_rows) != T or np.any(np.asarray(logit_rows) != np.arange(T))):
        return False
    try:
        return numba.threading_layer() == "omp"
    except ValueError:                     # no parallel kernel has run yet: the layer is not chosen
        return False

"""Ctrl-C at a safe point: hold SIGINT back while a data structure is half updated, deliver it afterwards."""
from __future__ import annotations

import contextlib
import signal
import threading


class _Deferral:
    """The handler of one `interrupts_held` block and its sections (`with deferred:`): inside a section a SIGINT is
    noted and raised as KeyboardInterrupt when the section ends; between sections it is raised at once, as Python's
    own handler does."""

    def __init__(self):
        self.depth, self.caught = 0, False

    def handler(self, signum, frame):
        if self.depth:
            self.caught = True
        else:
            signal.default_int_handler(signum, frame)      # raises KeyboardInterrupt

    def __enter__(self):
        self.depth += 1

    def __exit__(self, *exc):
        self.depth -= 1
        if self.caught and not self.depth and exc[0] is None:
            self.caught = False
            raise KeyboardInterrupt


@contextlib.contextmanager
def interrupts_held():
    """A block whose sections (`with deferred:`) hold back Ctrl-C (SIGINT) until they have ended, then raise
    KeyboardInterrupt; between them Ctrl-C interrupts at once. Yields `deferred`, reusable within the block.

    The engine's bookkeeping (queues, block tables, refcounts, the prefix trie) must change all together or not at
    all: a KeyboardInterrupt landing between popping a request off the queue and adding it to `running` would lose
    it, with its blocks. A forward, which changes nothing the next step relies on, may be cut. One handler serves a
    whole Engine step (its bookkeeping, forward, bookkeeping): installing one is a system call, and after a decode
    step's kernel the Python around it runs cold (docs/performance.md, "The Python around a decode step"). Only in
    the main thread, and only while Python's own handler is installed (an application that installed its own SIGINT
    handler keeps it): elsewhere the sections hold nothing back."""
    if threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield contextlib.nullcontext()
        return
    deferral = _Deferral()
    previous = signal.signal(signal.SIGINT, deferral.handler)
    try:
        yield deferral
    finally:
        signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def interrupts_deferred():
    """Hold back Ctrl-C (SIGINT) until the block has ended, then raise KeyboardInterrupt: `interrupts_held` with
    one section, the whole block."""
    with interrupts_held() as deferred, deferred:
        yield

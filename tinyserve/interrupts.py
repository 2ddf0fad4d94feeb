"""Ctrl-C at a safe point: hold SIGINT back while a data structure is half updated, deliver it afterwards."""
from __future__ import annotations

import contextlib
import signal
import threading


@contextlib.contextmanager
def interrupts_deferred():
    """Hold back Ctrl-C (SIGINT) until the block has ended, then raise KeyboardInterrupt.

    The engine's bookkeeping (queues, block tables, refcounts, the prefix trie) must change all together or not at
    all: a KeyboardInterrupt landing between popping a request off the queue and adding it to `running` would lose
    it, with its blocks. Only in the main thread, and only while Python's own handler is installed (an
    application that installed its own SIGINT handler keeps it)."""
    if threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt

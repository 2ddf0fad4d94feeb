"""The line protocol between tools/bench_peers.py and a peer worker (one JSON object per line, each way).

A worker runs in a venv of its own (llama-cpp-python, or torch + transformers), so this module imports nothing
beyond the standard library; both sides use it.

    worker -> driver   {"ready": true, "info": {...}}               once, after loading the model
    driver -> worker   {"cmd": "decode", "prompts": [[ids]], "new_tokens": 128}
    worker -> driver   {"ok": true, ...result...}  or  {"ok": false, "error": "what went wrong"}
    driver -> worker   {"cmd": "quit"}                              (or EOF on stdin): the worker exits

Native libraries (llama.cpp, OpenMP, PyTorch) may print to file descriptor 1 at any time. `serve` therefore
moves the protocol onto a private duplicate of stdout and points fd 1 at stderr, so no stray line can ever be
mistaken for an answer.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from typing import Callable


class PeerError(RuntimeError):
    """A worker answered with an error, died, or broke the protocol. The message says which and why."""


def serve(load: Callable[[], tuple[dict, dict[str, Callable[..., dict]]]]) -> int:
    """Run a worker: `load()` returns (info, {command name: handler(**fields) -> result dict})."""
    out = os.fdopen(os.dup(1), "w", buffering=1)   # the protocol channel: line-buffered
    os.dup2(2, 1)                                    # anything else written to stdout goes to stderr
    sys.stdout = sys.stderr

    def send(obj: dict) -> None:
        out.write(json.dumps(obj) + "\n")

    try:
        info, handlers = load()
    except Exception as e:  # noqa: BLE001  (the driver must learn why, not see a silent EOF)
        traceback.print_exc()
        send({"ready": False, "error": f"{type(e).__name__}: {e}"})
        return 1
    send({"ready": True, "info": info})
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            msg = json.loads(line)
            cmd = msg.pop("cmd")
        except (json.JSONDecodeError, KeyError, AttributeError) as e:
            send({"ok": False, "error": f"bad request {line.strip()[:80]!r}: {e}"})
            continue
        if cmd == "quit":
            break
        if cmd not in handlers:
            send({"ok": False, "error": f"unknown command {cmd!r}; this worker knows {sorted(handlers)}"})
            continue
        try:
            send({"ok": True, **handlers[cmd](**msg)})
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            send({"ok": False, "error": f"{cmd}: {type(e).__name__}: {e}"})
    return 0



class Worker:
    """The driver's end: start a worker process, wait for it to load, send commands, read answers."""

    def __init__(self, name: str, argv: list[str], log_path: str | os.PathLike, env: dict | None = None):
        self.name, self.log_path = name, str(log_path)
        self._log = open(log_path, "w")                       # the worker's stderr: native logs, tracebacks
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     text=True, bufsize=1, env=env)
        hello = self._read()
        if not hello.get("ready"):
            self.close()
            raise PeerError(f"{name} could not start: {hello.get('error')} (log: {self.log_path})")
        self.info: dict = hello.get("info", {})

    def request(self, cmd: str, **fields) -> dict:
        try:
            self.proc.stdin.write(json.dumps({"cmd": cmd, **fields}) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError, OSError):
            raise PeerError(self._died()) from None
        reply = self._read()
        if not reply.get("ok"):
            raise PeerError(f"{self.name}: {reply.get('error', reply)}")
        return reply

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise PeerError(self._died())
        try:
            reply = json.loads(line)
        except json.JSONDecodeError:
            raise PeerError(f"{self.name} broke the protocol, it wrote {line.strip()[:120]!r}") from None
        if not isinstance(reply, dict):
            raise PeerError(f"{self.name} broke the protocol, it wrote {line.strip()[:120]!r}")
        return reply

    def _died(self) -> str:
        try:
            code = self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            code = None
        self._log.flush()
        with open(self.log_path, errors="replace") as f:
            tail = "".join(f.readlines()[-8:]).rstrip()
        how = f"exited with code {code}" if code is not None else "stopped answering"
        if code is not None and code < 0:
            how += f" (killed by signal {-code})"
        return f"{self.name} worker {how}; the end of its log {self.log_path}:\n{tail}"

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=10)
            except (BrokenPipeError, OSError, ValueError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._log.close()

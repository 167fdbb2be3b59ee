"""A running fleet's control endpoint: kill or restart a worker on request (fault injection).

``POST /workers/<name>/kill`` and ``POST /workers/<name>/restart`` on 127.0.0.1; ``GET /workers``
lists the workers and whether each is alive. The router and the engines are driven by one thread
and are not thread-safe, so a command is queued and applied by that thread (between two routed
requests, see :meth:`FleetControl.apply`); the reply waits until it is applied, or answers 202
when the driving thread is busy for longer than ``wait_s``.

A kill is what a crashed worker process looks like: the router takes the worker out of its pool
(its sessions migrate), the worker's HTTP and ZMQ endpoints go away. A restart brings it back as
a fresh process: empty cache, KV-event sequence from 0, on its old ports or, when another process
took one of them meanwhile, on fresh ones (the answer says so and the fleet republishes its
manifest). A restart that cannot bind at all answers 503 and leaves the worker down.
"""

from __future__ import annotations

import json
import logging
import queue
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Any, Protocol

from fleet.http_service import ThreadedHttpService
from fleet.workers import WorkerFleet

log = logging.getLogger("prefixscope.fleet.control")

ACTIONS = ("kill", "restart")
_PATH = re.compile(r"^/workers/([^/]+)/([a-z]+)/?$")


class WorkerFaults(Protocol):
    """What applies a command: a running :class:`~fleet.simulation.Simulation` (router and fleet)."""

    def fail_worker(self, w: str) -> None: ...

    def restart_worker(self, w: str) -> None: ...


@dataclass
class Command:
    action: str
    worker: str
    done: threading.Event = field(default_factory=threading.Event)
    status: int = 202
    message: str = "queued"


class FleetControl(ThreadedHttpService):
    """The command queue plus its HTTP face; ``start`` binds, ``apply`` runs commands, ``stop`` ends."""

    thread_name = "fleet-control"

    def __init__(self, fleet: WorkerFleet, host: str = "127.0.0.1", port: int = 0, wait_s: float = 10.0) -> None:
        self.fleet = fleet
        self.wait_s = wait_s
        self.announce: Callable[[str], None] | None = None  # told what each command did (the demo's news)
        self._queue: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._bind(host, port, _handler(self))


    # -- commands ---------------------------------------------------------------------------
    def submit(self, action: str, worker: str) -> Command:
        """Queue a command and wait (bounded) for the driving thread to apply it."""
        cmd = Command(action, worker)
        if action not in ACTIONS:
            cmd.status, cmd.message = 404, f"unknown action {action!r}; use one of {', '.join(ACTIONS)}"
            return cmd
        if worker not in self.fleet.workers:
            cmd.status, cmd.message = 404, f"unknown worker {worker!r}; workers: {', '.join(self.fleet.workers)}"
            return cmd
        self._queue.put(cmd)
        cmd.done.wait(self.wait_s)
        return cmd

    def apply(self, target: WorkerFaults | None) -> None:
        """Run every queued command; called by the thread that drives the router.

        With no simulation running (between scenarios, or a fleet serving without traffic) the
        fleet alone kills or restarts the worker.
        """
        while True:
            try:
                cmd = self._queue.get_nowait()
            except queue.Empty:
                return
            cmd.status, cmd.message = self._run(cmd, target)
            log.info("control: %s %s -> %s", cmd.action, cmd.worker, cmd.message)
            if self.announce is not None:
                self.announce(f"control: {cmd.message}")
            cmd.done.set()

    def _run(self, cmd: Command, target: WorkerFaults | None) -> tuple[int, str]:
        alive = self.fleet[cmd.worker].alive
        if cmd.action == "kill":
            if not alive:
                return 409, f"{cmd.worker} is already down"
            if target is not None:
                target.fail_worker(cmd.worker)
            else:
                self.fleet.kill(cmd.worker)
            return 200, f"{cmd.worker} killed"
        before = self.fleet[cmd.worker].url
        try:
            if target is not None:
                target.restart_worker(cmd.worker)
            else:
                self.fleet.restart(cmd.worker)
        except (OSError, RuntimeError) as exc:  # the worker stays down; the fleet carries on
            log.warning("control: restart of %s failed: %s", cmd.worker, exc)
            return 503, f"{cmd.worker} could not restart: {exc}"
        after = self.fleet[cmd.worker].url
        if after != before:
            return 200, f"{cmd.worker} restarted on new ports ({after}; its old port was taken)"
        return 200, f"{cmd.worker} restarted"

    def workers(self) -> list[dict[str, Any]]:
        return [{"name": w.name, "url": w.url, "alive": w.alive} for w in self.fleet]


def _handler(control: FleetControl) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            log.debug("control %s", format % args)

        def _reply(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path.rstrip("/") == "/workers":
                self._reply(200, {"workers": control.workers()})
            else:
                self._reply(404, {"error": "GET /workers, POST /workers/<name>/kill or /workers/<name>/restart"})

        def do_POST(self) -> None:
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                length = 0
            if 0 < length <= 65536:
                self.rfile.read(length)  # a body is not needed; drain what is sent
            m = _PATH.match(self.path)
            if m is None:
                self._reply(404, {"error": "POST /workers/<name>/kill or /workers/<name>/restart"})
                return
            cmd = control.submit(m.group(2), m.group(1))
            self._reply(cmd.status, {"worker": cmd.worker, "action": cmd.action, "result": cmd.message})

    return Handler

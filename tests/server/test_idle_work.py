"""The server's engine thread: ready before the engine's idle work (measuring its step costs) is done, which
then runs piece by piece while no request does."""
from __future__ import annotations

import threading
import time

from specserve.server.async_engine import AsyncEngine


class _Engine:
    """An engine with three pieces of idle work and no requests; the first piece waits for `go`."""

    def __init__(self) -> None:
        self.left, self.go, self.tp = 3, threading.Event(), None

    def has_unfinished(self) -> bool:
        return False

    def idle_work(self) -> bool:
        if self.left == 3:
            assert self.go.wait(10)
        self.left -= 1
        return self.left > 0

    def close(self) -> None:
        pass


def _wait(cond, seconds: float = 10) -> bool:  # noqa: ANN001
    end = time.monotonic() + seconds
    while not cond() and time.monotonic() < end:
        time.sleep(0.01)
    return cond()


def test_ready_before_idle_work_then_all_of_it_runs() -> None:
    eng = _Engine()
    ae = AsyncEngine(lambda: eng)
    ae.start()
    try:
        assert _wait(lambda: ae.ready) and eng.left == 3  # ready while the first piece is still running
        eng.go.set()
        assert _wait(lambda: eng.left == 0)
        time.sleep(0.05)
        assert eng.left == 0  # no piece after the engine said it was done
    finally:
        ae.stop()

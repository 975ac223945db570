"""The server's engine thread: ready before the engine's idle work (measuring its step costs) is done, which
then runs piece by piece once no request has run for QUIET_S."""
from __future__ import annotations

import threading
import time

import pytest

from specserve.server import async_engine
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


def test_ready_before_idle_work_then_all_of_it_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(async_engine, "QUIET_S", 0.05)
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


class _Busy(_Engine):
    """Three steps of a request, then idle work; records when each ran."""

    def __init__(self) -> None:
        super().__init__()
        self.go.set()
        self.steps, self.step_at, self.idle_at = 3, [], []

    def has_unfinished(self) -> bool:
        return self.steps > 0

    def step(self) -> list:
        self.steps -= 1
        self.step_at.append(time.monotonic())
        time.sleep(0.02)
        return []

    def idle_work(self) -> bool:
        self.idle_at.append(time.monotonic())
        return super().idle_work()


def test_idle_work_waits_until_no_request_has_run_for_quiet_s(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not in the gaps between a client's requests (its busy time, and a forward there delays the next one): the
    first piece runs QUIET_S after the last step, then the rest back to back."""
    monkeypatch.setattr(async_engine, "QUIET_S", 0.3)
    eng = _Busy()
    ae = AsyncEngine(lambda: eng)
    ae.start()
    try:
        assert _wait(lambda: eng.left == 0)
        assert len(eng.step_at) == 3 and len(eng.idle_at) == 3
        assert eng.idle_at[0] - eng.step_at[-1] >= 0.3 and eng.idle_at[-1] - eng.idle_at[0] < 0.25
    finally:
        ae.stop()

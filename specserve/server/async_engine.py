"""Bridge between the synchronous engine and asyncio.

NOTE: the engine is single-threaded. ONE background thread builds it (so /health can answer 503
while the model loads) and then owns it: it alone calls add_request / abort / step. Handlers talk
to it through a thread-safe command queue; per-step results go back to each HTTP request's
asyncio.Queue with loop.call_soon_threadsafe, one hop per step.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable

from ..core import FatalEngineError, Request, SamplingParams, Status, TokenLogprob
from ..engine.llm import request_meta
from .metrics import Metrics, StatsLogger

log = logging.getLogger("specserve.server")

#: the engine's idle work (measuring its step costs, saving the suffix index) starts once no request has run for
#: this long. NOTE: the gaps between one client's requests are that client's busy time (on 2 cores a probe timed
#: in them read the 1.5B's t(1) at 1.5× its quiet figure and rescaled the curve to it), and a forward run in one
#: delays the request that ends it
QUIET_S = 1.0


@dataclass
class Delta:
    """New output of one sequence of an HTTP request since the previous Delta."""

    index: int  # position of the sequence in the group submitted
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None  # stop | length | abort | error
    error: str | None = None
    stop_text: str | None = None
    meta: dict[str, Any] | None = None  # request_meta, on the last Delta
    #: SamplingParams.prompt_logprobs, on the first Delta (the prefill that emits the first token completes them)
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass
class _Stream:
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    index: int
    sent: int = 0


class AsyncEngine:
    def __init__(self, factory: Callable[[], Any], metrics: Metrics | None = None, log_interval: float = 10.0,
                 on_load_failed: Callable[[BaseException], None] | None = None) -> None:
        self._factory, self.metrics, self._on_load_failed = factory, metrics, on_load_failed
        self.stats_logger = StatsLogger(log_interval)
        self.engine: Any = None
        self.state = "loading"  # loading | ready | failed | stopped
        self.load_error: str | None = None
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self._ids = itertools.count()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="specserve-engine", daemon=True)

    # ---- called from the event loop ----
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._cmds.put(None)
        self._thread.join(timeout)

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    def new_ids(self, prefix: str, n: int) -> list[str]:
        k = next(self._ids)
        return [f"{prefix}-{k}-{i}" for i in range(n)]

    async def submit(self, seqs: list[tuple[list[int], SamplingParams]], ids: list[str]) -> asyncio.Queue:
        """Add all sequences (or none: ValueError naming the field); their Deltas arrive on the queue."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        q: asyncio.Queue = asyncio.Queue()
        self._cmds.put(("add", seqs, ids, q, loop, fut))
        await fut
        return q

    def abort(self, ids: list[str]) -> None:
        self._cmds.put(("abort", ids))

    async def embed(self, prompts: list[list[int]]) -> list[list[float]]:
        """Embeddings of token-id prompts, computed by the engine thread between steps (ValueError naming the
        field)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        self._cmds.put(("embed", prompts, loop, fut))
        return await fut

    # ---- the engine thread ----
    def _run(self) -> None:
        try:
            t0 = time.perf_counter()
            self.engine = self._factory()
            log.info("engine ready in %.1f s", time.perf_counter() - t0)
        except BaseException as e:  # noqa: BLE001 - reported through /health and the exit code
            self.state, self.load_error = "failed", f"{type(e).__name__}: {e}"
            log.error("model failed to load: %s", self.load_error)
            if self._on_load_failed:
                self._on_load_failed(e)
            self._drain_after_failure()
            return
        self.state = "ready"
        eng = self.engine
        if getattr(eng, "tp", None) is not None:  # a worker that dies while we idle wakes the loop
            eng.tp.on_failure.append(lambda msg: self._cmds.put(("fatal", msg)))
        try:
            self._loop(eng)
        except FatalEngineError as e:
            self._die(e)
        finally:
            eng.close()
        if self.state == "failed":
            self._drain_after_failure()
        else:
            self.state = "stopped"

    def _loop(self, eng: Any) -> None:
        idle_work = True  # the engine has work for idle time (measuring its step costs): done between commands
        busy_at = time.monotonic()  # the last step (or ready): idle work waits QUIET_S past it
        while not self._stopping:
            quiet_in = QUIET_S - (time.monotonic() - busy_at)
            self._drain(block=not eng.has_unfinished() and (not idle_work or quiet_in > 0),
                        timeout=quiet_in if idle_work else 0.5)
            if self._stopping:
                break
            if idle_work and not eng.has_unfinished():
                if time.monotonic() - busy_at < QUIET_S:
                    continue
                try:
                    idle_work = eng.idle_work()
                except FatalEngineError:
                    raise
                except Exception:  # noqa: BLE001 - the measurement is an optimisation: serve without it
                    log.exception("idle work failed (step-cost measurement, suffix index save); serving without it")
                    idle_work = False
                continue
            try:
                touched: list = []
                if eng.has_unfinished():
                    touched, busy_at = eng.step(), time.monotonic()
                idle_work = idle_work or not eng.has_unfinished()  # idle again: the drafter may save its index
                if self.metrics:  # before publishing: a client that saw its answer sees the counters too
                    self.metrics.on_step(eng)
                self._publish(touched)
                self.stats_logger.maybe_log(eng)
            except FatalEngineError:
                raise
            except Exception as e:  # noqa: BLE001 - one bad step must not stop the server
                # NOTE: the step itself fails only the requests an exception concerns (runtime/isolate.py);
                # what reaches here broke the engine outside any request (scheduler, allocator)
                log.exception("engine step failed outside any request; failing the requests in flight")
                self._fail_all(f"internal engine error: {type(e).__name__}: {e}")

    def _die(self, e: FatalEngineError) -> None:
        """The engine cannot go on: fail everything in flight, report unhealthy, tell the server to exit."""
        log.error("engine stopped: %s", e)
        self._fail_all(str(e))
        self.state, self.load_error = "failed", str(e)
        if self._on_load_failed:
            self._on_load_failed(e)

    def _drain(self, block: bool, timeout: float = 0.5) -> None:
        try:
            cmd = self._cmds.get(timeout=timeout) if block else self._cmds.get_nowait()
        except queue.Empty:
            return
        while cmd is not None:
            if cmd[0] == "add":
                self._add(*cmd[1:])
            elif cmd[0] == "embed":
                self._embed(*cmd[1:])
            elif cmd[0] == "fatal":
                raise FatalEngineError(cmd[1])
            else:
                self._abort(cmd[1])
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return

    def _drain_after_failure(self) -> None:
        while not self._stopping:
            cmd = self._cmds.get()
            if cmd is not None and cmd[0] in ("add", "embed"):
                loop, fut = cmd[-2:]
                _call(loop, _resolve, fut, RuntimeError(f"model not available: {self.load_error}"))

    def _add(self, seqs: list, ids: list[str], q: asyncio.Queue, loop: asyncio.AbstractEventLoop,
             fut: asyncio.Future) -> None:
        added: list[Request] = []
        try:
            for (prompt_ids, params), rid in zip(seqs, ids):
                added.append(self.engine.add_request(prompt_ids, params, rid))
        except Exception as e:  # noqa: BLE001 - ValueError → 400; anything else → 500 for this request only
            for r in added:
                self.engine.abort(r.request_id)
            _call(loop, _resolve, fut, e)
            return
        for i, r in enumerate(added):
            self._streams[r.request_id] = _Stream(q, loop, i)
            if self.metrics:
                self.metrics.on_admit(r)
        _call(loop, _resolve, fut, None)

    def _embed(self, prompts: list[list[int]], loop: asyncio.AbstractEventLoop, fut: asyncio.Future) -> None:
        try:
            _call(loop, _resolve_value, fut, self.engine.embed(prompts))
        except Exception as e:  # noqa: BLE001 - ValueError → 400; anything else → 500 for this request only
            _call(loop, _resolve, fut, e)

    def _abort(self, ids: list[str]) -> None:
        for rid in ids:
            st = self._streams.pop(rid, None)
            r = self.engine.abort(rid)
            if r is not None and self.metrics:
                self.metrics.on_finish(r)
            if st is not None:  # a consumer may still wait (e.g. client gone mid-request): end it
                meta = request_meta(r, self.engine) if r is not None else None
                _call(st.loop, _deliver, [(st.queue, Delta(st.index, finished=True, finish_reason="abort", meta=meta))])

    def _fail_all(self, message: str) -> None:
        for rid in list(self.engine.requests):
            try:
                r = self.engine.abort(rid)
            except Exception:  # noqa: BLE001 - state may be broken; drop the request regardless
                log.exception("abort of %s failed", rid)
                r = self.engine.requests.pop(rid, None)
            if r is not None:
                r.status, r.finish_reason, r.error = Status.FINISHED, "error", message
        out: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
        for rid, st in self._streams.items():
            out[st.loop].append((st.queue, Delta(st.index, finished=True, finish_reason="error", error=message)))
        self._streams.clear()
        for loop, items in out.items():
            _call(loop, _deliver, items)

    def _publish(self, touched: list[Request]) -> None:
        now = time.perf_counter()
        out: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
        for r in touched:
            st = self._streams.get(r.request_id)
            if st is None:
                continue
            new = r.output_ids[st.sent :]
            d = Delta(st.index, new, r.logprobs[st.sent :] if r.params.logprobs is not None else [])
            if st.sent == 0 and r.params.prompt_logprobs is not None:
                d.prompt_logprobs = list(r.prompt_logprobs)
            st.sent = len(r.output_ids)
            self.stats_logger.tokens += len(new)
            if self.metrics:
                self.metrics.on_tokens(r, len(new), now)
            if r.finished:
                d.finished, d.finish_reason, d.error, d.stop_text = True, r.finish_reason, r.error, r.stop_text
                d.meta = request_meta(r, self.engine)
                del self._streams[r.request_id]
                if self.metrics:
                    self.metrics.on_finish(r)
            if new or d.finished:
                out[st.loop].append((st.queue, d))
        for loop, items in out.items():
            _call(loop, _deliver, items)


def _call(loop: asyncio.AbstractEventLoop, fn: Callable, *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the event loop is closed: the server is shutting down
        pass


def _resolve_value(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _resolve(fut: asyncio.Future, exc: BaseException | None) -> None:
    if fut.done():  # the handler was cancelled meanwhile (it aborts its ids itself)
        return
    if exc is None:
        fut.set_result(None)
    else:
        fut.set_exception(exc)


def _deliver(items: list[tuple[asyncio.Queue, Delta]]) -> None:
    for q, d in items:
        q.put_nowait(d)

"""The scorer: batches of items scored in worker processes, with a deadline per item.

    score(items) ──► check the batch (empty, too big, repeated ids) ──bad──► raise InvalidArgument
         │
         ├─► check each item (verifier, answer, size) ──bad──► INVALID_ARGUMENT result for that item
         │
         └─► a thread per worker slot ──[(index, item), ...]──► worker process: RewardFunction.score
                          ▲    (one message per worker per batch)           │
                          └─────────────── a ScoreResult per item ◄─────────┘
             no reply within timeout_s   → kill that worker; DEADLINE_EXCEEDED for the item
             worker died (os._exit, ...) → INTERNAL for the item
             either way the slot starts a fresh worker for the batch's items after it

Verifiers run math-verify (sympy can spin in C code) and user code (which can hang or end the
interpreter). Neither a thread nor a ProcessPoolExecutor task can be interrupted, so the scorer owns
its worker processes and kills exactly the stuck one, by handle, while the others keep working.
Workers are forked from a forkserver that has already imported this module and math-verify, so
replacing one costs milliseconds rather than a fresh interpreter's imports.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import queue
import signal
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from multiprocessing.context import ForkServerContext

import structlog
from prometheus_client import CollectorRegistry

from pipelinerl.common.errors import DeadlineExceeded, InvalidArgument, PipelineError, Unavailable
from pipelinerl.reward.metrics import RewardMetrics
from pipelinerl.reward.types import ScoreItem, ScoreResult, ScorerStats, VerifierInfo, check_batch
from pipelinerl.reward.verifiers import (
    BadAnswer,
    RewardFunction,
    RewardSpec,
    Verifier,
    available_verifiers,
    describe_verifiers,
)

log = structlog.get_logger()


class WorkerStartError(RuntimeError):
    """A worker process could not build the verifiers (bad python_function, missing math-verify)."""


class Scorer:
    """Scores batches of items in `workers` processes; each item gets at most `timeout_s` seconds of a worker.

    Construction blocks until every worker has built its verifiers, so a bad spec fails here, once,
    rather than on every item. `score` may be awaited concurrently; items queue for free workers.
    """

    def __init__(
        self,
        spec: RewardSpec,
        *,
        workers: int = 2,
        timeout_s: float = 10.0,
        start_timeout_s: float = 120.0,
        metrics: RewardMetrics | None = None,
    ) -> None:
        if workers < 1 or timeout_s <= 0:
            raise ValueError(f"need workers >= 1 and timeout_s > 0, got {workers} and {timeout_s}")
        self._spec = spec
        self._timeout_s = timeout_s
        self._verifiers = available_verifiers(spec)
        self._outcomes: Counter[str] = Counter()
        self._metrics = metrics or RewardMetrics(CollectorRegistry())
        self._closed = False
        context = multiprocessing.get_context("forkserver")
        # Takes effect only if this process has not started its forkserver yet; otherwise each
        # worker imports these itself, which is slower to start but equally correct.
        context.set_forkserver_preload([__name__, "math_verify"])
        self._slots: list[_WorkerSlot] = []
        try:
            for _ in range(workers):
                self._slots.append(_WorkerSlot(context, spec, start_timeout_s))
            for slot in self._slots:
                slot.worker.wait_ready(start_timeout_s)
        except BaseException:
            self._stop_workers()
            raise
        self._idle: queue.SimpleQueue[_WorkerSlot] = queue.SimpleQueue()
        for slot in self._slots:
            self._idle.put(slot)
        # One thread per slot, so a thread taking a slot from `_idle` never waits for one.
        self._threads = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="reward-worker")
        log.info("scorer started", workers=workers, timeout_s=timeout_s, verifiers=sorted(self._verifiers))

    async def score(self, items: list[ScoreItem]) -> list[ScoreResult]:
        """One result per item, in order. Raises InvalidArgument only when the batch itself is malformed."""
        if self._closed:
            raise Unavailable("the scorer is closed")
        check_batch(items)
        checked = [_check_item(self._spec, self._verifiers, index, item) for index, item in enumerate(items)]
        loop = asyncio.get_running_loop()
        todo = [(index, items[index]) for index, result in enumerate(checked) if result is None]
        # One job per worker at most: a job goes to its worker as one message (not one per item).
        chunks = [todo[i :: len(self._slots)] for i in range(min(len(self._slots), len(todo)))]
        done = await asyncio.gather(
            *(loop.run_in_executor(self._threads, self._score_in_worker, chunk) for chunk in chunks)
        )
        scored = {index: result for chunk, results in zip(chunks, done, strict=True)
                  for (index, _), result in zip(chunk, results, strict=True)}  # fmt: skip
        results = [scored[index] if result is None else result for index, result in enumerate(checked)]
        for result in results:
            outcome = _outcome(result)
            self._outcomes[outcome] += 1
            emit = log.debug if outcome == "scored" else log.warning  # a failed item is news at any level
            emit("item scored", sample_id=result.sample_id, status=outcome, reward=result.reward)
        return results

    def list_verifiers(self) -> list[VerifierInfo]:
        """The verifiers items may name, sorted by name."""
        return describe_verifiers(self._spec)

    @property
    def stats(self) -> ScorerStats:
        return ScorerStats(
            scored=self._outcomes["scored"],
            invalid=self._outcomes["invalid"],
            timed_out=self._outcomes["timed_out"],
            failed=self._outcomes["failed"],
            worker_restarts=sum(slot.restarts for slot in self._slots),
            workers=len(self._slots),
        )

    def close(self) -> None:
        """Finishes the items already in a worker (each bounded by the timeout) and stops the workers.

        Items still queued are dropped: the `score` calls awaiting them are cancelled.
        """
        if self._closed:
            return
        self._closed = True
        self._threads.shutdown(wait=True, cancel_futures=True)
        self._stop_workers()
        log.info("scorer closed", **vars(self.stats))

    def _score_in_worker(self, jobs: list[tuple[int, ScoreItem]]) -> list[ScoreResult]:
        slot = self._idle.get()
        try:
            return slot.score(jobs, self._timeout_s, self._metrics.item_scored)
        finally:
            self._idle.put(slot)

    def _stop_workers(self) -> None:
        for slot in self._slots:
            slot.worker.stop(grace_s=1.0)


def _check_item(
    spec: RewardSpec, verifiers: dict[str, type[Verifier]], index: int, item: ScoreItem
) -> ScoreResult | None:
    """An INVALID_ARGUMENT result if the item cannot be scored as sent, else None."""
    problem = _item_problem(spec, verifiers, item)
    if problem is None:
        return None
    field, description = problem
    error = InvalidArgument.field(f"items[{index}].{field}", f"sample {item.sample_id!r}: {description}")
    return ScoreResult.failed(item.sample_id, error)


def _item_problem(
    spec: RewardSpec, verifiers: dict[str, type[Verifier]], item: ScoreItem
) -> tuple[str, str] | None:
    """(field, description) of the first thing wrong with the item, or None."""
    if not item.sample_id:
        return "sample_id", "is empty"
    if item.verifier not in verifiers:
        return "verifier", f"unknown verifier {item.verifier!r}; available: {', '.join(sorted(verifiers))}"
    names = [item.verifier, *(term.verifier for term in spec.extra_terms)]
    needing = [name for name in names if verifiers[name].needs_answer]
    if needing and not item.answer.strip():
        return "answer", f"is empty, and verifier {needing[0]!r} compares against it"
    if len(item.completion) > spec.max_completion_chars:
        return (
            "completion",
            f"has {len(item.completion)} characters; the limit is {spec.max_completion_chars}",
        )
    return None


def _outcome(result: ScoreResult) -> str:
    if result.error is None:
        return "scored"
    if result.timed_out:
        return "timed_out"
    return "invalid" if result.error.code == "INVALID_ARGUMENT" else "failed"


class _WorkerSlot:
    """A place for one worker process, used by one thread at a time. After a timeout or a crash the
    process is gone, and the slot starts a fresh one before its next item."""

    def __init__(self, context: ForkServerContext, spec: RewardSpec, start_timeout_s: float) -> None:
        self._context = context
        self._spec = spec
        self._start_timeout_s = start_timeout_s
        self.worker = _Worker(context, spec)
        self.restarts = 0

    def score(
        self, jobs: list[tuple[int, ScoreItem]], timeout_s: float, observe: Callable[[float], None]
    ) -> list[ScoreResult]:
        """A result per job, in order; `observe` gets the seconds each took. A job that times out
        or kills the worker fails alone: the jobs after it go to a fresh worker."""
        results: list[ScoreResult] = []
        while len(results) < len(jobs):
            if not self.worker.alive:
                self.worker.stop(grace_s=0)
                self.worker = _Worker(self._context, self._spec)
                self.restarts += 1
                try:
                    self.worker.wait_ready(self._start_timeout_s)
                except WorkerStartError as exc:
                    _, item = jobs[len(results)]
                    results.append(
                        ScoreResult.failed(item.sample_id, PipelineError(f"sample {item.sample_id!r}: {exc}"))
                    )
                    continue
            results += self.worker.score(jobs[len(results) :], timeout_s, observe)
        return results


class _Worker:
    """A started worker process and the parent's end of its pipe. Once stopped, it stays stopped."""

    def __init__(self, context: ForkServerContext, spec: RewardSpec) -> None:
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(
            target=_worker_main, args=(child_conn, spec), name="reward-worker", daemon=True
        )
        self._process.start()
        # Only the worker may hold its end, so that the worker's death reads as EOF here.
        child_conn.close()
        self._pid = self._process.pid
        self._exit_code: int | None = None
        self._stopped = False

    @property
    def alive(self) -> bool:
        return not self._stopped and self._process.is_alive()

    def wait_ready(self, timeout_s: float) -> None:
        """Waits until the worker has built its verifiers; else stops it and raises WorkerStartError."""
        problem = f"no reply within {timeout_s}s"
        try:
            if self._conn.poll(timeout_s):
                problem = self._conn.recv()
        except EOFError:
            problem = "it exited"
        if problem is not None:
            self.stop(grace_s=1.0)
            raise WorkerStartError(f"reward worker failed to start: {problem} (exit code {self._exit_code})")
        log.debug("reward worker ready", pid=self._pid)

    def score(
        self, jobs: list[tuple[int, ScoreItem]], timeout_s: float, observe: Callable[[float], None]
    ) -> list[ScoreResult]:
        """Sends the jobs as one message; the worker answers each as it is scored, each within
        `timeout_s` (`observe` gets the seconds each took). Stops at the first that does not
        answer (the worker is stopped then), so the results may be fewer than the jobs: the
        caller sends the rest to a fresh worker."""
        results: list[ScoreResult] = []
        last = time.perf_counter()
        try:
            self._conn.send(jobs)
            for _ in jobs:
                if not self._conn.poll(timeout_s):
                    break
                results.append(self._conn.recv())
                now = time.perf_counter()
                observe(now - last)
                last = now
            else:
                return results
        except (EOFError, OSError):
            observe(time.perf_counter() - last)
            sample_id = jobs[len(results)][1].sample_id
            exit_code = self.stop(grace_s=1.0)
            log.warning("worker died while scoring", sample_id=sample_id, pid=self._pid, exit_code=exit_code)
            message = f"sample {sample_id!r}: the verifier's process exited with code {exit_code}"
            return [*results, ScoreResult.failed(sample_id, PipelineError(message))]
        observe(time.perf_counter() - last)
        sample_id = jobs[len(results)][1].sample_id
        self.stop(grace_s=0)
        log.warning(
            "verifier timed out; worker killed", sample_id=sample_id, pid=self._pid, timeout_s=timeout_s
        )
        error = DeadlineExceeded(f"sample {sample_id!r}: not scored within {timeout_s}s")
        return [*results, ScoreResult.failed(sample_id, error)]

    def stop(self, grace_s: float) -> int | None:
        """Stops the worker, killing it if it has not exited after `grace_s`; returns its exit code."""
        if not self._stopped:
            self._stopped = True
            # An idle worker reads EOF and exits by itself; a busy or stuck one gets killed.
            self._conn.close()
            self._process.join(grace_s)
            if self._process.exitcode is None:
                self._process.kill()
                self._process.join()
            self._exit_code = self._process.exitcode
            self._process.close()
        return self._exit_code


def _worker_main(conn: Connection, spec: RewardSpec) -> None:
    """Body of a worker process: builds the verifiers, then scores lists of `(index, item)` jobs,
    answering each job as it is scored, until EOF."""
    # Ctrl-C reaches the whole process group; the parent decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # math-verify warns that its timeouts are off, which is deliberate (see MathVerifier).
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    try:
        reward = RewardFunction(spec)
    except Exception as exc:
        conn.send(f"{type(exc).__name__}: {exc}")
        return
    conn.send(None)
    while True:
        try:
            jobs = conn.recv()
        except EOFError:
            return
        for index, item in jobs:
            conn.send(_score_item(reward, index, item))


def _score_item(reward: RewardFunction, index: int, item: ScoreItem) -> ScoreResult:
    try:
        value, details = reward.score(item)
    except BadAnswer as exc:
        error = InvalidArgument.field(f"items[{index}].answer", f"sample {item.sample_id!r}: {exc}")
        return ScoreResult.failed(item.sample_id, error)
    except Exception as exc:
        message = f"sample {item.sample_id!r}: verifier raised {type(exc).__name__}: {exc}"
        return ScoreResult.failed(item.sample_id, PipelineError(message))
    return ScoreResult(item.sample_id, value, details)

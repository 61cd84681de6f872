"""The coordinator's own cost under load: a real coordinator (a subprocess, journal on disk) drives a
pipeline run against fakes on loopback that cost nothing but a fixed generation time — an inference
server (the real servicer over a fake engine of `--window` rows, each holding a request
`--generation-ms`, then answering with a fixed completion; `--queue-ahead` more requests wait for a
row), an instant reward service and an instant trainer. Ends with one JSON line on stdout, measured
over `--duration` seconds after `--warmup`:

    requests_per_s     attempts acknowledged by the trainer per second
    p99_ms             99th percentile of an attempt's latency from the server receiving its Generate
                       request to the trainer acknowledging its sample: waiting for a row,
                       generation, the completion's way back, waiting for the rest of its group,
                       scoring and submission
    rss_growth_mb      growth of the coordinator process's resident memory over the measured time
    overhead_fraction  engine row time not spent generating, over generation time:
                       (window × seconds − Σ generation) / Σ generation, where generation is the fake
                       engine's nominal hold time from when a row starts a request. A row idles when
                       no request waits for it: with no queue, while each completion travels back, the
                       coordinator handles it and sends the next attempt (gRPC plus coordinator time,
                       once per generation); with one, only while the coordinator or the fakes stall
                       for longer than the queue lasts. 0 means every row is always busy.

    python benchmarks/load.py [--duration 20] [--generation-ms 20] [--window 16] [--queue-ahead 32]
                              [--group-size 8]
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog

from pipelinerl.common.channel import free_port
from pipelinerl.common.errors import FailedPrecondition
from pipelinerl.common.health import wait_until_serving
from pipelinerl.common.server import GrpcServer
from pipelinerl.common.settings import ServiceSettings
from pipelinerl.common.types import FinishReason, Sample, SamplingParams, TokenSequence, WeightVersion
from pipelinerl.coordinator.client import CoordinatorClient
from pipelinerl.coordinator.types import RunSpec
from pipelinerl.inference import server as inference_server
from pipelinerl.inference.config import EngineSettings
from pipelinerl.inference.types import GenerationRequest, GenerationUpdate, InferenceStatus, Limits, ModelInfo
from pipelinerl.reward import server as reward_server
from pipelinerl.reward.types import ScoreItem, ScoreResult, ScorerStats, VerifierDetail, VerifierInfo
from pipelinerl.trainer import server as trainer_server
from pipelinerl.trainer.types import Disposition, Malformed, SampleAck, TrainerStatus
from pipelinerl.weights.types import WatchRequest, WeightChunk, WeightNotice

log = structlog.get_logger()


class FixedEngine:
    """`window` rows, each holding a request for `generation_s`, then finishing it with the same
    completion; a request that finds every row taken waits for one (at most `queue_ahead` do, as
    the servicer allows). A row's next request starts when its last one was due to end, not when
    the timer woke: asyncio's sleep wakes a millisecond or two late, which a real engine, stepping
    back to back, does not. It serves `trainer`'s newest version, as a server whose updates cost
    nothing would, so that the coordinator never holds prompts back from it for lag."""

    def __init__(self, window: int, queue_ahead: int, generation_s: float, trainer: InstantTrainer) -> None:
        self.limits = Limits(max_running=window, max_new_tokens=64, max_context=1024, queue_ahead=queue_ahead)
        self.model_info = ModelInfo("fixed", 91, (2,), None, None, "fixed", "0" * 64)
        self.generation_s = generation_s
        self.trainer = trainer
        self.received: dict[str, float] = {}
        """Request (attempt) id -> when its Generate request reached the engine."""
        self.started: dict[str, float] = {}
        """Request (attempt) id -> when a row started generating it."""
        self._rows = asyncio.Semaphore(window)
        self._free_at = [0.0] * window
        """When each free row became free: a heap, one entry per free row."""

    def tokenize(self, text: str) -> list[int]:
        return [1 + ord(c) % 90 for c in text]

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationUpdate]:
        received = self.received[request.request_id] = time.perf_counter()
        async with self._rows:
            start = max(received, heapq.heappop(self._free_at))
            self.started[request.request_id] = start
            end = start + self.generation_s
            try:
                await asyncio.sleep(end - time.perf_counter())
            finally:  # a cancelled request frees its row at once
                heapq.heappush(self._free_at, min(end, time.perf_counter()))
        completion = TokenSequence([14, 15, 2], [-0.1, -0.2, -0.3], [self.trainer.version] * 3)
        yield GenerationUpdate(request.request_id, completion, FinishReason.STOP, text="42")

    def status(self) -> InferenceStatus:
        version = WeightVersion(self.trainer.version, "load")
        return InferenceStatus(version, 0, 0, 0.0, 0, 0, "fixed", self.model_info)


class InstantReward:
    """Exact match, scored in the servicer's event loop."""

    async def score(self, items: list[ScoreItem]) -> list[ScoreResult]:
        results = []
        for item in items:
            score = float(item.completion == item.answer)
            results.append(
                ScoreResult(item.sample_id, score, [VerifierDetail(item.verifier, score, 1.0, "")])
            )
        return results

    def list_verifiers(self) -> list[VerifierInfo]:
        return [VerifierInfo("digits", "exact match")]

    @property
    def stats(self) -> ScorerStats:
        return ScorerStats(0, 0, 0, 0, 0, workers=1)


class InstantTrainer:
    """Trains every message of samples at once as one durable version."""

    def __init__(self) -> None:
        self.version = 0
        self.acked: list[tuple[str, float]] = []
        """(sample id, when it was acknowledged), in order."""
        self._stepped = asyncio.Condition()

    async def admit(self, samples: Sequence[Sample | Malformed], on_ack: Callable[[SampleAck], None]) -> None:
        self.version += 1
        now = time.perf_counter()
        for sample in samples:
            on_ack(SampleAck(sample.sample_id, Disposition.TRAINED, self.version))
            self.acked.append((sample.sample_id, now))
        async with self._stepped:
            self._stepped.notify_all()

    async def flush(self, checkpoint: bool) -> None:
        """Nothing is ever held."""

    @property
    def durable_version(self) -> int:
        return self.version

    async def wait_durable(self, after: int) -> int:
        async with self._stepped:
            await self._stepped.wait_for(lambda: self.version > after)
        return self.version

    def watch(self, receiver: WatchRequest) -> AsyncIterator[WeightNotice]:
        raise FailedPrecondition("this trainer trains only; it serves no weights")

    def fetch(self, version: WeightVersion, buckets: Sequence[int]) -> AsyncIterator[WeightChunk]:
        raise FailedPrecondition("this trainer trains only; it serves no weights")

    def release(self, receiver_id: str, version: WeightVersion) -> None:
        """No weights are served, so none are held."""

    def status(self) -> TrainerStatus:
        return TrainerStatus(
            WeightVersion(self.version, "load"), 0, len(self.acked), 0, 0, 0.0, 0, self.version, 2**31 - 1
        )


@dataclass(frozen=True)
class Snapshot:
    """The clock, the coordinator's resident memory and CPU time, and this process's CPU time."""

    at: float
    rss_mb: float
    cpu_s: float
    own_cpu_s: float

    @classmethod
    def of(cls, pid: int) -> Snapshot:
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
        rss_kb = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        cpu_s = (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")
        return cls(time.perf_counter(), rss_kb / 1024, cpu_s, time.process_time())


def start_coordinator(fakes: str, journal: Path, port: int) -> subprocess.Popen[bytes]:
    """The coordinator on core 0 and this process (the fakes) on the others, where there are others."""
    cores = os.sched_getaffinity(0)
    pinned = {min(cores)} if len(cores) > 1 else cores
    os.sched_setaffinity(0, cores - pinned or cores)
    command = [sys.executable, "-m", "pipelinerl.coordinator", "--port", str(port), "--log-level", "warning"]
    command += ["--inference-addresses", json.dumps([fakes]), "--reward-address", fakes]
    command += ["--trainer-address", fakes, "--journal-path", str(journal)]
    # stdout carries only the final JSON line.
    return subprocess.Popen(command, stdout=sys.stderr, preexec_fn=lambda: os.sched_setaffinity(0, pinned))


def busy_seconds(engine: FixedEngine, start: float, end: float) -> float:
    """Nominal generation time inside [start, end], summed over requests."""
    g = engine.generation_s
    return sum(max(0.0, min(t + g, end) - max(t, start)) for t in engine.started.values())


async def measure(args: argparse.Namespace) -> dict[str, object]:
    trainer = InstantTrainer()
    engine = FixedEngine(args.window, args.queue_ahead, args.generation_ms / 1000, trainer)
    registrations = [
        inference_server.registration(inference_server.InferenceServicer(engine)),
        reward_server.registration(InstantReward()),
        trainer_server.registration(trainer),
    ]
    fakes_port, port = free_port(), free_port()
    fakes = GrpcServer(ServiceSettings(host="127.0.0.1", port=fakes_port, drain_seconds=0), registrations)
    with tempfile.TemporaryDirectory() as tmp:
        # Forked before this process runs any gRPC thread: a fork beside them can leave this
        # process's gRPC poller on a closed descriptor, and the coordinator then never answers.
        coordinator = start_coordinator(f"127.0.0.1:{fakes_port}", Path(tmp) / "journal.sqlite", port)
        try:
            await fakes.start()
            if not await wait_until_serving(f"127.0.0.1:{port}", timeout_s=60):
                raise RuntimeError("the coordinator did not start")
            async with CoordinatorClient(f"127.0.0.1:{port}") as client:
                spec = RunSpec(
                    "builtin:copy:2",
                    group_size=args.group_size,
                    sampling=SamplingParams(max_new_tokens=16),
                    max_in_flight=args.max_in_flight or 4 * args.window,
                )
                await client.start_run(spec, run_id="load")
                await asyncio.sleep(args.warmup)
                before = Snapshot.of(coordinator.pid)
                await asyncio.sleep(args.duration)
                after = Snapshot.of(coordinator.pid)
                await client.stop_run("load", timeout_s=60)
        finally:
            coordinator.send_signal(signal.SIGTERM)
            coordinator.wait(30)
    await fakes.stop(grace=0)

    seconds = after.at - before.at
    latencies = [at - engine.received[i] for i, at in trainer.acked if before.at <= at <= after.at]
    generation = busy_seconds(engine, before.at, after.at)
    return {
        "requests_per_s": round(len(latencies) / seconds, 1),
        "p99_ms": round(statistics.quantiles(latencies, n=100)[98] * 1000, 2),
        "rss_growth_mb": round(after.rss_mb - before.rss_mb, 1),
        "overhead_fraction": round((args.window * seconds - generation) / generation, 4),
        "p50_ms": round(statistics.median(latencies) * 1000, 2),
        "attempts": len(latencies),
        "seconds": round(seconds, 1),
        "window": args.window,
        "queue_ahead": args.queue_ahead,
        "generation_ms": args.generation_ms,
        "group_size": args.group_size,
        "coordinator_cpu_fraction": round((after.cpu_s - before.cpu_s) / seconds, 3),
        "coordinator_rss_mb": round(after.rss_mb, 1),
        # Near 1, the fakes (one process, one core) rather than the coordinator limit the rate.
        "fakes_cpu_fraction": round((after.own_cpu_s - before.own_cpu_s) / seconds, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--generation-ms", type=float, default=20.0)
    parser.add_argument("--window", type=int, default=16, help="requests the fake engine runs at once")
    parser.add_argument(
        "--queue-ahead",
        type=int,
        default=EngineSettings.model_fields["queue_ahead"].default,
        help="requests the fake server takes beyond its window (default: the inference server's)",
    )
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-in-flight", type=int, help="the run's limit; default 4 × window")
    args = parser.parse_args()
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    report = asyncio.run(measure(args))
    log.info("load benchmark done", **report)
    print(json.dumps(report))


if __name__ == "__main__":
    main()

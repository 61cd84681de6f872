"""In-flight weight updates through the real transport, measured against what the bytes cost raw.

Two processes on one machine. The trainer process holds a >= 50M-parameter float32 Llama (random,
from a seed) behind a real WeightPublisher served over gRPC; the main process runs the built-in
engine decoding fixed-length requests, with a WeightReceiver following the trainer:

    main process                                         trainer process (spawned)
    ──────────────────────────────────────────          ─────────────────────────────────────
    decode thread: engine.step() loop, logs each          ◄─pipe── "publish v"
      step's end time and weight version                  nudge weights (a stand-in optimizer step)
    WeightReceiver ◄── WatchWeights (gRPC) ─────────────  WeightPublisher.publish: pack + CRC-32
                   ◄── gloo broadcast of the buckets ───  announce loop: broadcast to the member
      verify CRC-32 ──► engine.stage_weights(v)           ──pipe─► publisher stats of version v
      next step swaps v in between two decode steps

Updates are sent one at a time, each once the previous one has been swapped in and decoding has
gone on a few steps, so every swap is measured on its own. Figures, side by side in one run:

- stall_ms: the longest hold-up of decoding by a swap at steady state, the engine's
  `stats().last_swap_s` (the copy of the staged buckets into the parameters), over every version
  but the first; first_swap_ms: the first version's, which also moves the parameters into flat
  buffers laid out like the buckets and touches that memory for the first time (see
  `inference/flat_weights.py`). stall_gap_ms cross-checks stall_ms from outside: the gap between
  the end of the step before a swap and the end of the swapping step, less the median step
  interval.
- memcpy_ms: one contiguous torch copy of the same number of bytes in this process, pages touched
  beforehand, best of --repeats. stall_ratio = stall_ms / memcpy_ms (target <= 1.5).
- broadcast_gib_per_s: the publisher's own `stats.last_broadcast_gib_per_s` (trainer side, bytes
  over the time of the bucket broadcasts, measured while the engine decodes), median over updates,
  sent back over the pipe. raw_broadcast_gib_per_s: a plain `torch.distributed.broadcast` of one
  tensor of the same size between the same two processes, with nothing else running, median of
  --repeats, timed on the sender like the publisher. broadcast_ratio = library / raw (target >= 0.8).
- tokens_lost: tokens asked for minus tokens received over all requests (must be 0);
  versions_seen_per_request shows that every request decoded across every update.
- transport: how the versions arrived, from the receiver's own counters (`broadcast`, `fetch`,
  `cuda_ipc`, joined by `+` when mixed); cuda_ipc_updates: how many came by CUDA IPC.

With `--device cuda` both processes run on the GPU: the trainer publishes CUDA tensors with
broadcast off, the engine decodes on the GPU and its receiver declares that GPU, so every version
arrives by cuda_ipc (its device buffers opened, checked and copied in). memcpy_ms is then one
device-to-device copy of the same bytes (timed with `torch.cuda.synchronize`), the broadcast
figures are null, and stall_over_copy (= stall_ratio) is the figure to read. Publishing still packs
and checksums on the host, seconds for a 1.5B model, so raise --max-new until decoding outlasts
the updates (a run where it does not stops with that advice). `--preset` takes a preset's shape
instead of --layers/--hidden/--intermediate.

With `--fan-out 1,2,4` it measures instead what one version costs as the number of receivers N
grows, for the tiny preset's weights and a synthetic version of `--fan-out-mib` MiB (100): a
WeightPublisher in this process serves N receiver processes (spawned, each a WeightReceiver), first
as broadcast members, then fetch-only. Each N gets a version that forms the group (rendezvous),
then --repeats timed versions (median):

- broadcast_s_by_receivers: the publisher's `stats.last_broadcast_s`, the trainer's time in the
  bucket broadcasts to the N members (gloo);
- broadcast_receive_s_by_receivers: the slowest member's time from its notice to every bucket
  received and its CRC-32 checked;
- fetch_s_by_receivers: the same for N fetch-only receivers, all fetching the version at once with
  FetchWeights (gRPC, 4 MiB chunks, CRC-32 per chunk and per bucket).

Every process uses --threads torch threads (default 1: the two processes share two cores).
Progress goes to stderr; the last line of stdout is one JSON object:

    python benchmarks/weight_update.py [--layers 5] [--hidden 1024] [--updates 4] [--max-new 320]
    python benchmarks/weight_update.py --device cuda --preset qwen2-0.5b --updates 3 --max-new 2500
    python benchmarks/weight_update.py --fan-out 1,2,4 [--fan-out-mib 100] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import multiprocessing as mp
import random
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist
from standin import PublisherOnlyTrainer
from timing import clock
from torch.distributed import TCPStore  # pyright: ignore[reportPrivateImportUsage]  # public, re-exported without `as`
from transformers import AutoModelForCausalLM, PreTrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from pipelinerl.common.channel import ChannelConfig
from pipelinerl.common.log import configure_logging, get_logger
from pipelinerl.common.model import build_preset, preset_config
from pipelinerl.common.presets import PRESETS
from pipelinerl.common.server import GrpcServer
from pipelinerl.common.settings import ServiceSettings
from pipelinerl.common.tokenizer import build_tokenizer
from pipelinerl.common.types import SamplingParams, WeightVersion
from pipelinerl.inference.config import EngineSettings
from pipelinerl.inference.engine import InferenceEngine
from pipelinerl.inference.types import GenerationRequest, GenerationUpdate
from pipelinerl.trainer.client import TrainerClient
from pipelinerl.trainer.server import registration
from pipelinerl.weights import buckets as bucketing
from pipelinerl.weights.publisher import WeightPublisher
from pipelinerl.weights.receiver import ReceiverStats, WeightReceiver
from pipelinerl.weights.settings import PublisherSettings
from pipelinerl.weights.types import WeightLayout, WeightNotice

log = get_logger("benchmarks.weight_update")

RUN_ID = "bench"
ALPHABET = "0123456789+-*/= abcdefghijklmnopqrstuvwxyz?"
WAIT_S = 120.0
"""Longest wait for any one event (a broadcast, a swap); a slower run is broken, not slow."""


# ---- the model, the same on both sides ---------------------------------------------------------


def model_config(args: argparse.Namespace, tokenizer: PreTrainedTokenizerBase) -> PreTrainedConfig:
    """`--preset`, or else the `small` preset widened and deepened: head_dim stays 64, the
    vocabulary the tiny one's, so nearly every parameter sits in the layers the transport moves."""
    if args.preset is not None:
        return preset_config(args.preset, tokenizer)
    config = preset_config("small", tokenizer)
    config.update(
        {
            "hidden_size": args.hidden,
            "intermediate_size": args.intermediate,
            "num_hidden_layers": args.layers,
            "num_attention_heads": args.hidden // 64,
            "num_key_value_heads": args.hidden // 128,
        }
    )
    return config


def build_model(args: argparse.Namespace, tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
    """Drawn on `--device` itself: a 1.5B model's initialisation on one CPU thread takes minutes."""
    with torch.random.fork_rng(devices=[]), torch.device(args.device):
        torch.manual_seed(args.seed)
        model = AutoModelForCausalLM.from_config(
            model_config(args, tokenizer), dtype=getattr(torch, args.dtype), attn_implementation="sdpa"
        )
    return model.eval()


def parameter_bytes(model: PreTrainedModel) -> tuple[int, int]:
    """(parameters, bytes), each tied tensor counted once, as the publisher sends them."""
    params = list(model.parameters())
    return sum(p.numel() for p in params), sum(p.numel() * p.element_size() for p in params)


# ---- trainer process ---------------------------------------------------------------------------


def trainer_main(conn: Connection, args: argparse.Namespace) -> None:
    """Entry point of the spawned trainer process; obeys the main process's messages on `conn`."""
    configure_logging("trainer")
    torch.set_num_threads(args.threads)
    asyncio.run(_serve_trainer(conn, args))


async def _serve_trainer(conn: Connection, args: argparse.Namespace) -> None:
    model = build_model(args, build_tokenizer())
    # On one GPU, NCCL cannot pair the two processes; the version goes out by CUDA IPC instead.
    backend = "none" if args.device == "cuda" else "gloo"
    publisher = WeightPublisher(
        PublisherSettings(broadcast_backend=backend, broadcast_timeout_s=WAIT_S), RUN_ID
    )
    await publisher.start()
    core = PublisherOnlyTrainer(publisher, RUN_ID)
    server = GrpcServer(ServiceSettings(port=0, drain_seconds=1), [registration(core)])
    await server.start()
    conn.send(("ready", server.port))
    try:
        while True:
            message = await asyncio.to_thread(conn.recv)
            if message[0] == "publish":
                conn.send(await _publish(publisher, model, message[1]))
                core.version = message[1]
            elif message[0] == "raw":
                conn.send(await asyncio.to_thread(_raw_broadcast_sender, *message[1:]))
            else:
                break
    finally:
        await server.stop(grace=1)
        await publisher.close()


async def _publish(publisher: WeightPublisher, model: PreTrainedModel, version: int) -> dict[str, float]:
    """Publish `version` and return the publisher's figures once its broadcast has ended (at
    once without broadcast: the notice itself carries the device buffers)."""
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(1.0 - 1e-3)  # every weight moves, as after an optimizer step
    stats = publisher.stats
    ok_before, failed_before = stats.broadcasts, stats.failed_broadcasts
    await publisher.publish(version, dict(model.named_parameters()))
    if publisher.settings.broadcast_backend == "none":
        return {"version": version, "pack_s": stats.last_pack_s, "broadcast_ok": False}
    deadline = time.perf_counter() + WAIT_S
    while (stats.broadcasts, stats.failed_broadcasts) == (ok_before, failed_before):
        if time.perf_counter() > deadline:
            raise TimeoutError(f"the broadcast of v{version} never ended")
        await asyncio.sleep(0.005)
    return {
        "version": version,
        "pack_s": stats.last_pack_s,
        "broadcast_s": stats.last_broadcast_s,
        "gib_per_s": stats.last_broadcast_gib_per_s,
        # A failed broadcast leaves the previous figures in the stats: they are not this version's.
        "broadcast_ok": stats.broadcasts > ok_before,
    }


def _raw_broadcast_sender(port: int, num_bytes: int, repeats: int) -> list[float]:
    """Rank 0 of the plain broadcast: seconds of each repeat, timed like the publisher times."""
    store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=WAIT_S))
    dist.init_process_group("gloo", store=store, rank=0, world_size=2)
    try:
        tensor = torch.ones(num_bytes, dtype=torch.uint8)
        seconds = []
        for _ in range(repeats):
            dist.barrier()  # the receiver is waiting, so only the transfer is timed
            started = time.perf_counter()
            dist.broadcast(tensor, src=0)
            seconds.append(time.perf_counter() - started)
        return seconds
    finally:
        dist.destroy_process_group()


# ---- inference side (main process) -------------------------------------------------------------


@dataclass
class StepRecord:
    end: float
    swapped: bool
    swap_s: float


@dataclass
class Decoder:
    """Steps the engine in its own thread until it runs out of work, recording every step."""

    engine: InferenceEngine
    started: float = 0.0
    steps: list[StepRecord] = field(default_factory=list)
    finished: list[GenerationUpdate] = field(default_factory=list)
    error: BaseException | None = None
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="decode", daemon=True)
        self.started = time.perf_counter()
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def join(self) -> None:
        assert self._thread is not None
        self._thread.join()
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        try:
            while self.engine.has_work:
                version = self.engine.weight_version
                updates = self.engine.step()
                swapped = self.engine.weight_version != version
                swap_s = self.engine.stats().last_swap_s if swapped else 0.0
                self.steps.append(StepRecord(time.perf_counter(), swapped, swap_s))
                self.finished += [u for u in updates if u.finish_reason is not None]
        except BaseException as exc:  # surfaced by join(): a broken engine must fail the run
            self.error = exc


def make_requests(
    args: argparse.Namespace, tokenizer: PreTrainedTokenizerBase, prefix: str, max_new: int
) -> list[GenerationRequest]:
    rng = random.Random(args.seed)
    requests = []
    for i in range(args.requests):
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(8, 64)))
        sampling = SamplingParams(max_new_tokens=max_new, seed=i)
        requests.append(GenerationRequest(f"{prefix}{i}", tokenizer(text)["input_ids"], sampling))
    return requests


async def start_decoding(
    args: argparse.Namespace, engine: InferenceEngine, requests: list[GenerationRequest]
) -> Decoder:
    """Queue `requests` and step the engine until the batch is past its prefill and decoding."""
    for request in requests:
        engine.add_request(request)
    decoder = Decoder(engine)
    decoder.start()
    await wait_for(lambda: len(decoder.steps) >= args.settle_steps, "the first steps", decoder)
    return decoder


async def wait_for(condition: Callable[[], bool], what: str, decoder: Decoder | None = None) -> None:
    """Poll `condition` until true; fail if decoding ended first or it takes longer than WAIT_S."""
    deadline = time.perf_counter() + WAIT_S
    while not condition():
        if decoder is not None and not decoder.running:
            raise RuntimeError(f"decoding ended before {what}; raise --max-new or lower --updates")
        if time.perf_counter() > deadline:
            raise TimeoutError(f"waited {WAIT_S}s for {what}")
        await asyncio.sleep(0.002)


async def receive(conn: Connection) -> Any:
    """The trainer's next message; EOFError if it died."""
    return await asyncio.to_thread(conn.recv)


async def run_updates(
    args: argparse.Namespace, conn: Connection, port: int, engine: InferenceEngine
) -> tuple[Decoder, list[dict[str, float]], ReceiverStats]:
    """Decode the requests while `args.updates` versions are published, received and swapped in."""
    trainer = TrainerClient(ChannelConfig(f"127.0.0.1:{port}"))

    async def apply(version: WeightVersion, layout: WeightLayout, buckets: list[torch.Tensor]) -> None:
        # As the server's runner does: return once swapped in, so the receiver's buffers (or the
        # trainer's, opened by CUDA IPC) are let go only after the copy.
        engine.stage_weights(bucketing.unpack(layout, buckets), version.version)
        await wait_for(lambda: engine.weight_version >= version.version, f"the swap of v{version.version}")

    on_gpu = args.device == "cuda"
    cuda_device = torch.device(args.device) if on_gpu else None
    receiver = WeightReceiver(
        trainer, "bench-inference", apply, accepts_broadcast=not on_gpu, cuda_device=cuda_device
    )
    follow = asyncio.create_task(receiver.run())
    try:
        # A receiver watching before the first version is a broadcast member from the start.
        await wait_for_watcher(trainer)
        decoder = await start_decoding(args, engine, make_requests(args, engine.tokenizer, "r", args.max_new))
        published = [await update_once(args, conn, decoder, v) for v in range(1, args.updates + 1)]
        await asyncio.to_thread(decoder.join)
    finally:
        follow.cancel()
        await asyncio.gather(follow, return_exceptions=True)
        await trainer.close()
    received = receiver.stats
    if received.failed_updates or received.fetches:
        log.warning("not every update came by broadcast or cuda_ipc", **vars(received))
    return decoder, published, received


async def update_once(
    args: argparse.Namespace, conn: Connection, decoder: Decoder, version: int
) -> dict[str, float]:
    """Have the trainer publish `version`; return once it is swapped in and decoding has gone on."""
    conn.send(("publish", version))
    published = await receive(conn)
    log.info("version published", **published)
    engine = decoder.engine
    await wait_for(lambda: engine.weight_version == version, f"the swap of v{version}", decoder)
    # Quiet steps after each swap keep the next update's traffic out of this swap's step gap.
    swapped_at = len(decoder.steps)
    await wait_for(lambda: len(decoder.steps) >= swapped_at + args.settle_steps, "later steps", decoder)
    return published


def warm_up(engine: InferenceEngine, tokenizer: PreTrainedTokenizerBase) -> None:
    """A few steps first, so one-off allocations do not count as step time."""
    prompt = tokenizer("warm up")["input_ids"]
    engine.add_request(GenerationRequest("warm-up", prompt, SamplingParams(max_new_tokens=8)))
    while engine.has_work:
        engine.step()


async def wait_for_watcher(trainer: TrainerClient) -> None:
    deadline = time.perf_counter() + WAIT_S
    while (await trainer.status(timeout_s=5)).watchers < 1:
        if time.perf_counter() > deadline:
            raise TimeoutError("the receiver never started watching")
        await asyncio.sleep(0.02)


async def raw_broadcast(conn: Connection, num_bytes: int, repeats: int) -> list[float]:
    """Rank 1 of the plain broadcast (this process hosts its store); returns the sender's seconds.
    The receive tensor is zeroed once (pages touched) and reused, as the receiver reuses its buckets."""
    store = TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=WAIT_S))
    conn.send(("raw", store.port, num_bytes, repeats))
    await asyncio.to_thread(dist.init_process_group, "gloo", store=store, rank=1, world_size=2)
    try:
        tensor = torch.zeros(num_bytes, dtype=torch.uint8)
        for _ in range(repeats):
            await asyncio.to_thread(dist.barrier)
            await asyncio.to_thread(dist.broadcast, tensor, 0)
        return await receive(conn)
    finally:
        dist.destroy_process_group()


def memcpy_seconds(num_bytes: int, repeats: int, device: str) -> float:
    """Best time of one contiguous copy of `num_bytes` on `device`, source and destination
    already touched."""
    source = torch.ones(num_bytes, dtype=torch.uint8, device=device)
    target = torch.zeros(num_bytes, dtype=torch.uint8, device=device)
    best = float("inf")
    for _ in range(repeats):
        started = clock(device)
        target.copy_(source)
        best = min(best, clock(device) - started)
    return best


# ---- results -----------------------------------------------------------------------------------


def step_gaps(decoder: Decoder) -> tuple[float, list[float]]:
    """Median step interval (the first step prefills, so it is left out) and, per swapping step,
    how much longer its interval was than that median."""
    ends = [decoder.started] + [s.end for s in decoder.steps]
    intervals = [b - a for a, b in itertools.pairwise(ends)]
    plain = [dt for dt, s in zip(intervals[1:], decoder.steps[1:], strict=True) if not s.swapped]
    median = statistics.median(plain)
    return median, [dt - median for dt, s in zip(intervals, decoder.steps, strict=True) if s.swapped]


def token_counts(args: argparse.Namespace, decoder: Decoder) -> tuple[int, list[int]]:
    """Tokens lost over all requests, and the number of weight versions each request saw."""
    expected = args.requests * args.max_new
    received = sum(len(u.tokens) for u in decoder.finished)
    return expected - received, sorted(len(set(u.tokens.versions)) for u in decoder.finished)


def report(
    args: argparse.Namespace,
    sizes: tuple[int, int],
    decoder: Decoder,
    published: list[dict[str, float]],
    raw_s: list[float],
    memcpy_s: float,
    received: ReceiverStats,
) -> dict[str, object]:
    params, num_bytes = sizes
    swaps_ms = [s.swap_s * 1e3 for s in decoder.steps if s.swapped]
    median_step, gaps = step_gaps(decoder)
    steady = swaps_ms[1:] or swaps_ms  # the first version moves the parameters: see the docstring
    stall_ms, memcpy_ms = max(steady), memcpy_s * 1e3
    broadcast = [p for p in published if p["broadcast_ok"]]
    if not broadcast and not received.cuda_ipc:
        raise RuntimeError("neither broadcast nor cuda_ipc delivered: the receiver fetched every version")
    library = statistics.median(p["gib_per_s"] for p in broadcast) if broadcast else None
    raw = [num_bytes / 2**30 / s for s in raw_s]
    raw_median = statistics.median(raw) if raw else None
    tokens_lost, versions_seen = token_counts(args, decoder)
    paths = {"cuda_ipc": received.cuda_ipc, "broadcast": received.broadcasts, "fetch": received.fetches}
    digits = 3 if args.device == "cuda" else 1  # a GPU copies a model in milliseconds
    return {
        "stall_ms": round(stall_ms, digits),
        "stall_gap_ms": round(max(gaps[1:] or gaps) * 1e3, digits),
        "first_swap_ms": round(swaps_ms[0], digits),
        "memcpy_ms": round(memcpy_ms, digits),
        "stall_ratio": round(stall_ms / memcpy_ms, 2),
        "broadcast_gib_per_s": round(library, 3) if library is not None else None,
        "raw_broadcast_gib_per_s": round(raw_median, 3) if raw_median is not None else None,
        "broadcast_ratio": round(library / raw_median, 2) if library is not None and raw_median else None,
        "stall_over_copy": round(stall_ms / memcpy_ms, 2),
        "device": args.device,
        "transport": "+".join(name for name, count in paths.items() if count) or "none",
        "cuda_ipc_updates": received.cuda_ipc,
        "tokens_lost": tokens_lost,
        "params": params,
        "bytes": num_bytes,
        "updates": len(swaps_ms),
        "versions_seen_per_request": versions_seen,
        "swap_ms_each": [round(ms, digits) for ms in swaps_ms],
        "gap_ms_each": [round(g * 1e3, digits) for g in gaps],
        "median_step_ms": round(median_step * 1e3, 1),
        "broadcast_gib_per_s_each": [round(p["gib_per_s"], 3) for p in broadcast],
        "broadcast_measured_by": "publisher stats.last_broadcast_gib_per_s (trainer side), during decoding",
        "raw_broadcast_gib_per_s_each": [round(r, 3) for r in raw],
        "pack_s_each": [round(p["pack_s"], 3) for p in published],
        "failed_broadcasts": len(published) - len(broadcast) if args.device == "cpu" else 0,
        "requests": args.requests,
        "max_new_tokens": args.max_new,
        "threads": args.threads,
        "preset": args.preset,
        "dtype": args.dtype,
    }


# ---- fan-out: one version to N receivers ------------------------------------------------------


def receiver_main(conn: Connection, index: int, threads: int) -> None:
    """Entry point of a spawned receiver process for --fan-out; obeys ("follow", port, broadcast)
    and ("leave",), and reports each version it applies as (version, via, seconds)."""
    configure_logging(f"receiver-{index}")
    torch.set_num_threads(threads)
    asyncio.run(_follow_on_command(conn, index))


async def _follow_on_command(conn: Connection, index: int) -> None:
    following: tuple[asyncio.Task[None], TrainerClient] | None = None
    while (message := await asyncio.to_thread(conn.recv))[0] != "stop":
        if following is not None:  # "leave", or a new "follow": the old stream ends first
            following[0].cancel()
            await asyncio.gather(following[0], return_exceptions=True)
            await following[1].close()
            following = None
        if message[0] == "follow":
            _, port, broadcast = message
            trainer = TrainerClient(ChannelConfig(f"127.0.0.1:{port}"))
            receiver = ReportingReceiver(conn, trainer, f"receiver-{index}", broadcast)
            following = (asyncio.create_task(receiver.run()), trainer)
        conn.send(("done", message[0]))


class ReportingReceiver(WeightReceiver):
    """A WeightReceiver that reports each version it applies over `conn`: (version, via, seconds
    from its notice to verified buckets)."""

    def __init__(self, conn: Connection, trainer: TrainerClient, receiver_id: str, broadcast: bool) -> None:
        super().__init__(trainer, receiver_id, self._report, accepts_broadcast=broadcast)
        self._conn = conn
        self._notice_at = 0.0
        self._broadcasts = 0

    async def receive(self, notice: WeightNotice) -> bool:
        self._notice_at = time.perf_counter()
        return await super().receive(notice)

    async def _report(
        self, version: WeightVersion, layout: WeightLayout, buckets: list[torch.Tensor]
    ) -> None:
        seconds = time.perf_counter() - self._notice_at
        via = "broadcast" if self.stats.broadcasts > self._broadcasts else "fetch"
        self._broadcasts = self.stats.broadcasts
        self._conn.send((version.version, via, seconds))


@dataclass
class FanOut:
    """The trainer's side of --fan-out: a publisher in this process, receivers in others."""

    publisher: WeightPublisher
    port: int
    receivers: list[tuple[Connection, Any]]
    version: int = 0

    async def command(self, count: int, *message: object) -> None:
        for conn, _ in self.receivers[:count]:
            conn.send(message)
        for conn, _ in self.receivers[:count]:
            while (await receive(conn))[0] != "done":
                pass  # a late report of a version applied before this command

    async def publish(self, tensors: dict[str, torch.Tensor], count: int) -> tuple[float, list[tuple]]:
        """Publish the next version; returns the trainer's broadcast seconds (0 if it went out
        fetch-only) and each receiver's (version, via, seconds)."""
        self.version += 1
        stats = self.publisher.stats
        before = stats.broadcasts + stats.failed_broadcasts
        await self.publisher.publish(self.version, tensors)
        reports = [await receive(conn) for conn, _ in self.receivers[:count]]
        if any(r[0] != self.version for r in reports):
            raise RuntimeError(f"expected v{self.version} everywhere, got {reports}")
        ended = stats.broadcasts + stats.failed_broadcasts > before
        return (stats.last_broadcast_s if ended else 0.0), reports


async def fan_out_trial(
    bench: FanOut, tensors: dict[str, torch.Tensor], count: int, broadcast: bool, repeats: int
) -> tuple[float, float]:
    """N receivers follow; a warm-up version forms the group; then the median over `repeats`
    versions of (trainer's broadcast seconds, slowest receiver's notice-to-verified seconds)."""
    await bench.command(count, "follow", bench.port, broadcast)
    deadline = time.perf_counter() + WAIT_S
    while bench.publisher.watchers < count:
        if time.perf_counter() > deadline:
            raise TimeoutError(f"{count} receivers never watched")
        await asyncio.sleep(0.02)
    await asyncio.gather(*(receive(conn) for conn, _ in bench.receivers[:count]))  # the current version
    await bench.publish(tensors, count)  # forms the group (rendezvous), or warms fetch-only
    sender, slowest = [], []
    for _ in range(repeats):
        seconds, reports = await bench.publish(tensors, count)
        want = "broadcast" if broadcast else "fetch"
        if any(via != want for _, via, _ in reports):
            raise RuntimeError(f"a receiver did not get v{bench.version} by {want}: {reports}")
        sender.append(seconds)
        slowest.append(max(s for _, _, s in reports))
    await bench.command(count, "leave")
    while bench.publisher.watchers:
        await asyncio.sleep(0.02)
    return statistics.median(sender), statistics.median(slowest)


async def run_fan_out(args: argparse.Namespace) -> dict[str, object]:
    """One version's broadcast and fetch to N = each of --fan-out receivers, for the tiny preset
    and a synthetic version of --fan-out-mib."""
    counts = sorted(int(n) for n in args.fan_out.split(","))
    sizes = {
        "tiny": dict(build_preset("tiny", seed=args.seed).model.named_parameters()),
        f"{args.fan_out_mib}MiB": {"big.weight": torch.randn(args.fan_out_mib * 2**18)},
    }
    publisher = WeightPublisher(PublisherSettings(broadcast_timeout_s=WAIT_S), RUN_ID)
    await publisher.start()
    server = GrpcServer(
        ServiceSettings(port=0, drain_seconds=1), [registration(PublisherOnlyTrainer(publisher, RUN_ID))]
    )
    await server.start()
    context = mp.get_context("spawn")
    receivers = []
    for index in range(max(counts)):
        conn, child = context.Pipe()
        process = context.Process(
            target=receiver_main, args=(child, index, args.threads), name=f"receiver-{index}"
        )
        process.start()
        receivers.append((conn, process))
    bench = FanOut(publisher, server.port, receivers)
    await publisher.publish(0, sizes["tiny"])  # what a receiver gets first, as it starts watching
    result: dict[str, Any] = {"broadcast_s_by_receivers": {}, "broadcast_receive_s_by_receivers": {},
                              "fetch_s_by_receivers": {}, "bytes": {}}  # fmt: skip
    try:
        for name, tensors in sizes.items():
            result["bytes"][name] = sum(t.numel() * t.element_size() for t in tensors.values())
            for key in (
                "broadcast_s_by_receivers",
                "broadcast_receive_s_by_receivers",
                "fetch_s_by_receivers",
            ):
                result[key][name] = {}
            for count in counts:
                sender_s, broadcast_receive_s = await fan_out_trial(bench, tensors, count, True, args.repeats)
                _, fetch_s = await fan_out_trial(bench, tensors, count, False, args.repeats)
                result["broadcast_s_by_receivers"][name][count] = round(sender_s, 4)
                result["broadcast_receive_s_by_receivers"][name][count] = round(broadcast_receive_s, 4)
                result["fetch_s_by_receivers"][name][count] = round(fetch_s, 4)
                log.info("fan-out", size=name, receivers=count, broadcast_s=round(sender_s, 3),
                         receive_s=round(broadcast_receive_s, 3), fetch_s=round(fetch_s, 3))  # fmt: skip
    finally:
        for conn, _ in receivers:
            conn.send(("stop",))
        for _, process in receivers:
            await asyncio.to_thread(process.join, 30)
            if process.is_alive():
                process.terminate()
        await server.stop(grace=1)
        await publisher.close()
    return {**result, "repeats": args.repeats, "threads": args.threads, "backend": "gloo"}


async def run(args: argparse.Namespace) -> dict[str, object]:
    tokenizer = build_tokenizer()
    model = build_model(args, tokenizer)
    sizes = parameter_bytes(model)
    log.info("model", params=sizes[0], mib=round(sizes[1] / 2**20, 1), device=args.device)
    settings = EngineSettings(device=args.device, max_running=args.requests, ignore_eos=True)
    engine = InferenceEngine(model, tokenizer, settings)
    warm_up(engine, tokenizer)
    context = mp.get_context("spawn")  # a fresh interpreter: no forked grpc or torch thread state
    conn, child_conn = context.Pipe()
    trainer = context.Process(target=trainer_main, args=(child_conn, args), name="trainer")
    trainer.start()
    try:
        _, port = await receive(conn)
        decoder, published, received = await run_updates(args, conn, port, engine)
        raw_s = await raw_broadcast(conn, sizes[1], args.repeats) if args.device == "cpu" else []
        conn.send(("stop",))
    finally:
        await asyncio.to_thread(trainer.join, 30)
        if trainer.is_alive():
            trainer.terminate()
    memcpy_s = memcpy_seconds(sizes[1], args.repeats, args.device)
    return report(args, sizes, decoder, published, raw_s, memcpy_s, received)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--preset", choices=sorted(PRESETS), help="instead of the three shape flags")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--layers", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=1024, help="a multiple of 128 (head_dim 64)")
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-new", type=int, default=320)
    parser.add_argument("--updates", type=int, default=4)
    parser.add_argument("--settle-steps", type=int, default=8, help="decode steps between updates")
    parser.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="of the raw broadcast and the memcpy; timed versions of --fan-out",
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--fan-out", metavar="N,N,...", help="instead: one version's broadcast and fetch to N receivers"
    )
    parser.add_argument("--fan-out-mib", type=int, default=100, help="the synthetic version's size")
    args = parser.parse_args()
    configure_logging("benchmark")  # stderr; stdout carries only the final JSON line
    torch.set_num_threads(args.threads)
    result = asyncio.run(run_fan_out(args) if args.fan_out else run(args))
    log.info("done", **{k: v for k, v in result.items() if not isinstance(v, list)})
    print(json.dumps(result))


if __name__ == "__main__":
    main()

"""The running rows' decode state, kept between steps, so that a decode step does no per-row
Python work (vLLM v1's persistent input batch).

Row r of every array belongs to the engine's r-th running sequence. On the device: what the next
forward and draw read (each row's last token and its position, tokens drawn so far, its limit,
stop token ids, sampling parameters and the stream of uniform numbers its seed gives), written at
admission and advanced by each draw in place.
On the host: what the host must know without asking the device (positions, for the attention
length and cache copies; which rows are greedy or truncated) and every generated token with its
logprob and weight version, filled from the one read of each step.

    add(start, sequences) ─ admission: one small upload per field for all newcomers
    sample(rows, logits) ── on the device: draw, match stop tokens and limits, advance the rows,
                            pack (token, logprob, ended, valid) per row; nothing is read yet
    read(version) ───────── the step's only device-to-host copy (`to_host`): every pack at once
    move(sources, targets)  rows leaving the batch: later rows move into the holes
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pipelinerl.common.types import SamplingParams, TokenSequence
from pipelinerl.inference.sampling import RowSampling, sample, uniform_stream
from pipelinerl.inference.sequence import SequenceState

STOP_TOKEN, LENGTH = 1, 2
"""Why a row ended, as `Drawn.ended` says it (0: it goes on)."""


def to_host(packed: torch.Tensor) -> np.ndarray:
    """The one read from the device per step."""
    return packed.cpu().numpy()


@dataclass(frozen=True)
class Drawn:
    """What the host learns of one draw over consecutive rows: numpy arrays, one entry per row."""

    rows: range
    token_ids: np.ndarray
    ended: np.ndarray
    """0, STOP_TOKEN (the token is one of the row's stop tokens) or LENGTH (max_new_tokens reached)"""
    valid: np.ndarray
    """False where the row's logits were NaN or infinite"""


class RunningBatch:
    """State of up to `max_rows` running rows; see the module docstring."""

    def __init__(self, max_rows: int, max_new_tokens: int, device: torch.device) -> None:
        def longs(*shape: int, fill: int = 0) -> torch.Tensor:
            return torch.full(shape, fill, dtype=torch.long, device=device)

        self.device = device
        self.row_ids = torch.arange(max_rows, device=device)
        self.last_ids = longs(max_rows)
        """Each row's newest token, the input of its next decode."""
        self.positions = longs(max_rows)
        """Its position, which is also where its keys go in the cache."""
        self._drawn = longs(max_rows)
        """Tokens drawn so far: where the row's next number is in its uniform stream."""
        self._uniforms = torch.zeros(max_rows, max_new_tokens, device=device)
        """Each row's `uniform_stream`, from its request's seed."""
        self._max_new = longs(max_rows)
        self._stop_ids = longs(max_rows, 1, fill=-1)
        """Stop token ids of each row, padded with -1."""
        self._sampling = RowSampling.of([SamplingParams()] * max_rows, device)
        self.host_positions = np.zeros(max_rows, np.int64)
        self.watched = np.zeros(max_rows, bool)
        """Rows whose request has stop strings: the host checks their text after each draw."""
        self.streams = np.zeros(max_rows, bool)
        """Rows whose request wants an update per step."""
        self._greedy = np.zeros(max_rows, bool)
        self._truncated = np.zeros(max_rows, bool)
        self._lengths = np.zeros(max_rows, np.int64)
        self._token_ids = np.zeros((max_rows, 64), np.int64)
        self._logprobs = np.zeros((max_rows, 64), np.float32)
        self._versions = np.zeros((max_rows, 64), np.int64)
        self._pending: list[tuple[range, torch.Tensor]] = []

    def add(self, start: int, sequences: list[SequenceState]) -> None:
        """Newcomers take rows start, start + 1, ...: nothing drawn yet, next position their
        prompt's length - 1 (the prefill's draw moves it to the prompt's length)."""
        rows = slice(start, start + len(sequences))
        params = [s.request.sampling for s in sequences]
        positions = [len(s.request.prompt_token_ids) - 1 for s in sequences]
        width = max(len(s.stop_ids) for s in sequences)
        if width > self._stop_ids.shape[1]:
            grown = torch.full((self._stop_ids.shape[0], width), -1, dtype=torch.long, device=self.device)
            grown[:, : self._stop_ids.shape[1]] = self._stop_ids
            self._stop_ids = grown
        stops = [sorted(s.stop_ids) + [-1] * (self._stop_ids.shape[1] - len(s.stop_ids)) for s in sequences]
        device = self.device
        self.positions[rows] = torch.tensor(positions, device=device)
        self._drawn[rows] = 0
        self._max_new[rows] = torch.tensor([p.max_new_tokens for p in params], device=device)
        self._stop_ids[rows] = torch.tensor(stops, dtype=torch.long, device=device)
        self._sampling.write(rows, RowSampling.of(params, device))
        for row, (sequence, p) in enumerate(zip(sequences, params, strict=True), start):
            if p.temperature > 0:  # a greedy row draws nothing
                self._uniforms[row, : p.max_new_tokens] = uniform_stream(
                    sequence.seed, p.max_new_tokens, device
                )
        self.host_positions[rows] = positions
        self.watched[rows] = [s.watcher is not None for s in sequences]
        self.streams[rows] = [s.request.stream_tokens for s in sequences]
        self._greedy[rows] = [p.temperature == 0 for p in params]
        self._truncated[rows] = [p.top_k > 0 or p.top_p < 1 for p in params]
        self._lengths[rows] = 0

    def sample(self, rows: range, logits: torch.Tensor) -> None:
        """Draw the next token of these rows from their logits [len(rows), vocab] and advance them;
        the host learns the tokens at `read`."""
        index = slice(rows.start, rows.stop)
        greedy = self._greedy[index]
        drawn = sample(
            logits,
            self._sampling[index],
            self._uniforms[index].gather(1, self._drawn[index, None]).squeeze(1),
            greedy=bool(greedy.any()),
            sampled=not greedy.all(),
            truncated=bool(self._truncated[index].any()),
        )
        tokens = drawn.token_ids
        stopped = (tokens[:, None] == self._stop_ids[index]).any(dim=-1)
        full = self._drawn[index] + 1 >= self._max_new[index]
        ended = torch.where(stopped, STOP_TOKEN, torch.where(full, LENGTH, 0))
        packed = torch.stack([tokens.double(), drawn.logprobs.double(), ended.double(), drawn.valid.double()])
        self.last_ids[index] = tokens
        self.positions[index] += 1
        self._drawn[index] += 1
        self.host_positions[index] += 1
        self._pending.append((rows, packed))

    def read(self, version: int) -> list[Drawn]:
        """The draws since the last read, in one copy to the host; their tokens are recorded with
        `version`, the weight version that produced them."""
        if not self._pending:
            return []
        pending, self._pending = self._pending, []
        host = to_host(torch.cat([packed for _, packed in pending], dim=1))
        drawn, offset = [], 0
        for rows, _ in pending:
            token_ids, logprobs, ended, valid = host[:, offset : offset + len(rows)]
            offset += len(rows)
            token_ids, valid = token_ids.astype(np.int64), valid.astype(bool)
            self._record(rows, token_ids, logprobs.astype(np.float32), valid, version)
            drawn.append(Drawn(rows, token_ids, ended.astype(np.int64), valid))
        return drawn

    def _record(
        self, rows: range, token_ids: np.ndarray, logprobs: np.ndarray, valid: np.ndarray, version: int
    ) -> None:
        index = np.arange(rows.start, rows.stop)
        columns = self._lengths[index]
        if len(columns) and columns.max() >= self._token_ids.shape[1]:
            self._grow()
        self._token_ids[index, columns] = token_ids
        self._logprobs[index, columns] = logprobs
        self._versions[index, columns] = version
        self._lengths[index] += valid  # an invalid row's token is not kept: the row fails

    def _grow(self) -> None:
        def doubled(array: np.ndarray) -> np.ndarray:
            return np.concatenate([array, np.zeros_like(array)], axis=1)

        self._token_ids = doubled(self._token_ids)
        self._logprobs = doubled(self._logprobs)
        self._versions = doubled(self._versions)

    def token_ids(self, row: int) -> list[int]:
        """The row's generated token ids."""
        return self._token_ids[row, : self._lengths[row]].tolist()

    def tokens(self, row: int, start: int = 0) -> TokenSequence:
        """The row's generated tokens from index `start` on."""
        end = self._lengths[row]
        return TokenSequence(
            self._token_ids[row, start:end].tolist(),
            self._logprobs[row, start:end].tolist(),
            self._versions[row, start:end].tolist(),
        )

    def move(self, sources: list[int], targets: list[int]) -> None:
        """Row targets[i] takes the state of row sources[i]."""
        source = torch.tensor(sources, device=self.device)
        target = torch.tensor(targets, device=self.device)
        device_rows = (
            self.last_ids,
            self.positions,
            self._drawn,
            self._max_new,
            self._stop_ids,
            self._uniforms,
        )
        for tensor in device_rows:
            tensor[target] = tensor[source]
        self._sampling.write(target, self._sampling[source])
        for array in self._host_arrays():
            array[targets] = array[sources]

    def _host_arrays(self) -> tuple[np.ndarray, ...]:
        rows = (self.host_positions, self.watched, self.streams, self._greedy, self._truncated, self._lengths)
        return (*rows, self._token_ids, self._logprobs, self._versions)

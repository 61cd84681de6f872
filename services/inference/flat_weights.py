"""A weight swap in as few copies as the layout allows: one per received bucket.

A version arrives as views into a few flat buckets (`weights.buckets.unpack`). `Swap.of` groups the
staged tensors by the buffer they live in: each group is a `Piece`, the bytes it spans and where
each tensor lies in them. The first time a piece of a layout is staged, `FlatParameters.prepared`
copies it into a buffer of its own on the parameters' device, in the staging thread (the first
touch of that memory does not hold up decoding); its swap re-homes the parameters there, each
becoming a view of the buffer. From then on a piece of the same layout is one copy of its bytes
into that buffer, instead of one copy per tensor (on a GPU, one launch each, which costs more than
the bytes for hundreds of small tensors).

Tensors that cannot be copied as bytes (not contiguous, or of another dtype than the parameter,
which the copy converts) are copied one by one, as are the pieces of a version that names only
some of a layout's tensors.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import torch

Entry = tuple[str, int, int]
"""A tensor's name, byte offset in its piece and byte count."""


@dataclass(frozen=True)
class Piece:
    """Staged tensors that share one buffer: the bytes they span, and where each lies in them."""

    source: torch.Tensor
    """uint8 [bytes]"""
    entries: tuple[Entry, ...]
    fresh: torch.Tensor | None = None
    """The same bytes in a buffer of their own on the parameters' device, made while staging a
    layout the parameters do not live in yet: the swap moves them there without a copy."""


@dataclass(frozen=True)
class Swap:
    """One staged version: its pieces and the tensors copied one by one."""

    pieces: tuple[Piece, ...]
    loose: dict[str, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def of(cls, tensors: Mapping[str, torch.Tensor], params: Mapping[str, torch.Tensor]) -> Swap:
        groups: dict[int, list[tuple[str, torch.Tensor]]] = {}
        loose = {}
        for name, tensor in tensors.items():
            if tensor.is_contiguous() and tensor.dtype == params[name].dtype:
                groups.setdefault(tensor.untyped_storage().data_ptr(), []).append((name, tensor))
            else:
                loose[name] = tensor
        return cls(tuple(_piece(group) for group in groups.values()), loose)

    @property
    def names(self) -> set[str]:
        return {name for piece in self.pieces for name, _, _ in piece.entries} | set(self.loose)

    @property
    def nbytes(self) -> int:
        return sum(p.source.nbytes for p in self.pieces) + sum(t.nbytes for t in self.loose.values())

    def copied(self, device: torch.device | str) -> Swap:
        """The same version in fresh memory on `device`: one copy per piece."""
        pieces = tuple(Piece(p.source.to(device, copy=True), p.entries) for p in self.pieces)
        return Swap(pieces, {name: t.to(device, copy=True) for name, t in self.loose.items()})


def _piece(group: list[tuple[str, torch.Tensor]]) -> Piece:
    storage = group[0][1].untyped_storage()
    whole = torch.empty(0, dtype=torch.uint8, device=group[0][1].device).set_(storage)
    starts = [t.data_ptr() - storage.data_ptr() for _, t in group]
    low = min(starts)
    high = max(start + t.nbytes for start, (_, t) in zip(starts, group, strict=True))
    entries = tuple((name, start - low, t.nbytes) for start, (name, t) in zip(starts, group, strict=True))
    return Piece(whole[low:high], entries)


class FlatParameters:
    """The model's parameters, re-homed piece by piece into flat buffers as versions arrive."""

    def __init__(self, params: Mapping[str, torch.nn.Parameter]) -> None:
        self._params = params
        self._buffers: dict[tuple[Entry, ...], torch.Tensor] = {}
        """Flat buffer by the layout of the piece its parameters are views of."""
        self._home: dict[str, tuple[Entry, ...]] = {}

    def prepared(self, swap: Swap) -> Swap:
        """`swap`, each piece of a layout the parameters do not live in yet copied into a buffer of
        its own (`Piece.fresh`). Any thread; the copy is the first touch of the memory."""
        return Swap(
            tuple(
                piece
                if piece.entries in self._buffers
                else replace(piece, fresh=piece.source.to(self._device(piece), copy=True))
                for piece in swap.pieces
            ),
            swap.loose,
        )

    @torch.no_grad()
    def copy_in(self, swap: Swap) -> int:
        """Copy a staged version into the parameters; returns the number of copies it took."""
        targets, sources = [], []
        for piece in swap.pieces:
            buffer = self._buffers.get(piece.entries)
            if buffer is None:
                self._rehome(piece)
            else:
                targets.append(buffer)
                sources.append(piece.source)
        for name, tensor in swap.loose.items():
            targets.append(self._params[name])
            sources.append(tensor)
        if targets:  # one grouped call: on a GPU, a launch per copy at most
            torch._foreach_copy_(targets, sources)  # pyright: ignore[reportPrivateImportUsage]  # no public name
        return len(swap.pieces) + len(swap.loose)

    def _rehome(self, piece: Piece) -> None:
        """Move the piece's parameters into a buffer that holds the piece's bytes, as views."""
        buffer = piece.fresh if piece.fresh is not None else piece.source.to(self._device(piece), copy=True)
        for name, start, nbytes in piece.entries:
            stale = self._home.pop(name, None)
            if stale is not None:  # that buffer no longer holds every parameter of its layout
                self._buffers.pop(stale, None)
            param = self._params[name]
            param.data = buffer[start : start + nbytes].view(param.dtype).view(param.shape)
            self._home[name] = piece.entries
        self._buffers[piece.entries] = buffer

    def _device(self, piece: Piece) -> torch.device:
        return self._params[piece.entries[0][0]].device

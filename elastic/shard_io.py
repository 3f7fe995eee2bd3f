"""How a checkpoint's shards lie in storage: each rank's tensors as raw bytes, back to back.

DCP decides what a save holds (which rank writes which item, a replicated tensor once) and
records in its ``.metadata`` each tensor's dtype, shape and chunks and where each item's bytes
went; a storage writer and reader decide the bytes. DCP's own file writer wraps every tensor in a
``torch.save`` archive (its reader unpacks each with ``torch.load``): for the ResNet-50 training
state (481 tensors) that took about 1.75 times as long as writing the same bytes
(``bench/checkpoint.py``). Here each rank writes one file, its items' bytes in plan order, so the
file is the state's memory verbatim, hashed from that memory as it is written, with no copy and
no read-back. Checkpoints in DCP's own layout (manifest format 1) load with DCP's reader.
"""

from __future__ import annotations

import io
import os
from typing import Any

import torch
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _metadata_fn, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from elastic.manifest import PieceDigest

METADATA = _metadata_fn  # the name of DCP's .metadata file


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A tensor's bytes in row-major order; no copy for a contiguous CPU tensor."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


WRITEBACK_BYTES = 16 << 20  # how much a local shard's writer writes before it starts writeback


def _descriptor(stream: Any) -> int | None:
    """A local file's descriptor; None for an object store's file, which has none.

    An object store's upload is complete, and atomic, when the file is closed."""
    try:
        return stream.fileno()
    except (AttributeError, io.UnsupportedOperation):
        return None


def _start_writeback(stream: Any, start: int, end: int) -> None:
    """Start writing bytes ``start:end`` of a local file to disk now, without waiting.

    Left to itself, the kernel writes a file's dirty pages back at the fsync, after the last
    write: the copies into the page cache and the disk's transfer then take their times one after
    the other. Started per ``WRITEBACK_BYTES``, they overlap. For the ResNet-50 state on this
    machine the write and fsync took 0.073-0.080 s instead of 0.105-0.111 s, where
    ``dd conv=fsync`` takes about the latter. Linux's ``POSIX_FADV_DONTNEED`` starts the writeback
    of a range's dirty pages; elsewhere the advice may do nothing, and the fsync does it all."""
    if hasattr(os, "posix_fadvise") and (fd := _descriptor(stream)) is not None:
        stream.flush()
        os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_DONTNEED)


def _sync(stream: Any) -> None:
    """Make a written file durable on a local file system (an object store's is, once closed)."""
    stream.flush()
    if (fd := _descriptor(stream)) is not None:
        os.fsync(fd)  # an error here (EIO) fails the save, as it must


class ShardWriter(FsspecWriter):
    """DCP's fsspec writer (any URL fsspec opens) with this module's layout: one file per rank.

    Each file is fsynced where local. Its manifest entry (size and digest) is in ``written`` by
    file name once :meth:`write_data` returns.

    The file holds a tensor item as its memory is, and a non-tensor item as the pickle DCP's
    planner made of it. Its digest is taken from that memory, in pieces on threads of its own,
    while the file is written (``elastic.manifest.PieceDigest``). The caller keeps the memory
    unchanged until the write returns (the staged copy of a background save is:
    ``elastic.checkpoint_save.SaveGuard``).
    """

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.written: dict[str, dict[str, Any]] = {}
        self.wrote: list[torch.Tensor] = []  # the tensors this rank's plan gave it, as written
        self.results: list[WriteResult] = []  # where each item went, as DCP gets it

    def storage_meta(self) -> StorageMeta | None:
        """None, so that DCP's ``.metadata`` names no folder and no save.

        The same bytes then serve every save of a round (``elastic.checkpoint_save.Plan``); the
        manifest says which step a checkpoint is."""
        return None

    def write_metadata(self, data: bytes) -> None:
        """Write DCP's ``.metadata`` as pickled at an earlier save, durably where local.

        It is recorded in ``written`` as :meth:`write_data` records a shard."""
        with (
            PieceDigest(threads=1) as digest,
            self.fs.create_stream(self.fs.concat_path(self.path, METADATA), "wb") as stream,
        ):
            stream.write(data)
            digest.update(memoryview(data))
            _sync(stream)
        self.written[METADATA] = digest.record()

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        name = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
        results, offset, unsynced = [], 0, 0
        with (
            PieceDigest(threads=torch.get_num_threads()) as digest,
            self.fs.create_stream(self.fs.concat_path(self.path, name), "wb") as stream,
        ):
            for item in plan.items:
                data = planner.resolve_data(item)
                if isinstance(data, io.BytesIO):
                    buffer = data.getbuffer()
                else:
                    buffer = tensor_bytes(data)
                    self.wrote.append(data)
                stream.write(buffer)
                digest.update(buffer)
                where = _StorageInfo(name, offset, buffer.nbytes)
                results.append(WriteResult(item.index, buffer.nbytes, where))
                offset += buffer.nbytes
                if self.sync_files and offset - unsynced >= WRITEBACK_BYTES:
                    _start_writeback(stream, unsynced, offset)
                    unsynced = offset
            if self.sync_files:
                _sync(stream)
        self.written[name] = digest.record()
        self.results = results
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future


def _read_exact(stream: Any, length: int) -> bytearray:
    data = bytearray(length)
    view, got = memoryview(data), 0
    while got < length:
        n = stream.readinto(view[got:])
        if not n:
            raise EOFError(f"the shard ends {length - got} bytes before the item it holds")
        got += n
    return data


class ShardReader(FsspecReader):
    """Reads what :class:`ShardWriter` wrote into the tensors DCP's planner asks for.

    It reads at any world size. Each item's bytes become a tensor of the dtype and chunk shape
    that ``.metadata`` records, narrowed to what the loading rank asks for, so resharding works
    as with DCP's reader. :meth:`elastic.checkpoint.CheckpointManager.load` picks this reader or
    DCP's by the manifest's format."""

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._tensors = metadata.state_dict_metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        by_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            by_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in by_file.items():
            with self.fs.create_stream(self.fs.concat_path(self.path, name), "rb") as stream:
                for item in sorted(items, key=lambda i: self.storage_data[i.storage_index].offset):
                    where = self.storage_data[item.storage_index]
                    stream.seek(where.offset)
                    data = _read_exact(stream, where.length)
                    if item.type == LoadItemType.BYTE_IO:
                        planner.load_bytes(item, io.BytesIO(data))
                    else:
                        self._load_tensor(item, data, planner)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _load_tensor(self, item: ReadItem, data: bytearray, planner: LoadPlanner) -> None:
        """The saved chunk ``item`` reads from, narrowed to the part the planner asked for."""
        saved = self._tensors[item.storage_index.fqn]
        assert isinstance(saved, TensorStorageMetadata)
        chunk = next(c for c in saved.chunks if c.offsets == item.storage_index.offset)
        dtype = saved.properties.dtype
        flat = torch.frombuffer(data, dtype=dtype) if data else torch.empty(0, dtype=dtype)
        tensor = flat.reshape(chunk.sizes)
        for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths, strict=True)):
            tensor = tensor.narrow(dim, start, length)
        target = planner.resolve_tensor(item).detach()
        if target.size() != tensor.size():
            raise ValueError(
                f"{item.storage_index.fqn}: the checkpoint holds {tuple(tensor.size())} where "
                f"{tuple(target.size())} was asked for"
            )
        target.copy_(tensor)
        planner.commit_tensor(item, target)

"""A file's record: its sha256 in pieces, hashed on threads, the same written as read back."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

import fsspec
import pytest

from elastic.manifest import PieceDigest, file_record


def pieces_sha256(data: bytes, piece: int) -> str:
    """The record's digest by its definition, on one thread."""
    digests = b"".join(
        hashlib.sha256(data[i : i + piece]).digest() for i in range(0, len(data), piece)
    )
    return hashlib.sha256(digests).hexdigest()


@pytest.mark.parametrize("size", [0, 1, 30, 31, 1000])
def test_buffers_of_any_size_give_the_pieces_digest_on_any_number_of_threads(size: int) -> None:
    data = random.Random(size).randbytes(size)
    expected = {"size": size, "pieces_sha256": pieces_sha256(data, 10), "piece_bytes": 10}
    for threads in (1, 3):
        cuts = sorted(random.Random(threads).sample(range(size + 1), min(size + 1, 12)))
        with PieceDigest(threads, piece_bytes=10) as digest:
            for start, end in zip([0, *cuts], [*cuts, size], strict=True):
                digest.update(memoryview(data)[start:end])  # empty ones too
        assert digest.record() == expected


def test_a_file_reads_back_to_the_record_it_was_written_with_in_either_form(
    tmp_path: Path,
) -> None:
    fs = fsspec.filesystem("file")
    data = random.Random(0).randbytes(100_003)
    path = tmp_path / "shard"
    path.write_bytes(data)
    with PieceDigest(2, piece_bytes=4096) as digest:
        digest.update(memoryview(data))
    assert file_record(fs, str(path), digest.record(), threads=3) == digest.record()
    whole = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}  # formats 1 and 2
    assert file_record(fs, str(path), whole) == whole
    with pytest.raises(ValueError, match="piece_bytes"):
        file_record(fs, str(path), {"size": 1, "pieces_sha256": "", "piece_bytes": 0})

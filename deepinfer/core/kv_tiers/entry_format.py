"""The disk entry format: one entry per file (a plain payload, or a run of blocks), raw bytes behind a small
checked head.

Layout (all integers little-endian)::

    offset  size  field
    0       8     magic  b"DIKVBLK\\0"
    8       4     format version (u32), FORMAT_VERSION
    12      4     header length H (u32): the JSON header's bytes
    16      32    sha256 of the head: everything from offset 48 up to the payload (header, members, chunk
                  checksums, padding)
    48      H     header: UTF-8 JSON {"identity": str, "key": hex, "members": n, "payload_bytes": int,
                  "tensors": [[name, dtype, shape, offset], ...]}
    48+H    n*K   the run's members (block hashes, K = the key's length each) in chain order, members[0] ==
                  key; none (n = 0) for a plain entry
    ...     4*C   the payload's chunk checksums: crc32 (u32) of each CHUNK_BYTES stretch of it in order, the
                  last one shorter; C = ceil(P / CHUNK_BYTES). Then zero padding up to a multiple of ALIGN: S
    S       P     payload: each tensor's row-major bytes at its offset (relative to S, a multiple of ALIGN;
                  zero padding between tensors); P == payload_bytes. A run's tensors all have shape[0] == n.

The file is exactly S + P bytes. Nothing is pickled and nothing is executed: a reader parses JSON and reads
the bytes into tensors. Magic and version come first and stay where they are in every version, so a reader
knows a file of another version before it parses anything else. The members sit before the payload, so a
reader learns which blocks a file holds from its first 48 + H + n*K bytes (``read_head``; the disk tier's
start-up index), without reading or checking the payload.

Checksums: the head (small: the header, 32 KB of members for a 1024-block run, the chunk checksums) is
covered by one sha256; the payload by a crc32 per CHUNK_BYTES chunk, which the reader checks as it reads the
payload straight into the tensors it returns (``read_entry``: each chunk checked on a worker thread right
after it is read, while the next one is read, no intermediate copy; zlib's crc32 ran at 4.0 GB/s against sha256's 1.3 GB/s on the 2-core CPU of
docs/benchmarks.md). A crc32 detects every error burst of up to 32 bits in its chunk and misses a random
corruption with probability 2**-32 per damaged chunk; like the sha256 over the whole file before it, it
guards against damage, not against a writer forging entries (anyone who may write the directory may write a
valid file).

Versions: 2 (runs, one sha256 over the whole file) replaced 1 (one block per file, no members); 3 (a sha256
over the head, a crc32 per payload chunk) replaced 2. A file of another version reads as foreign.

read_entry() checks, in order: the magic, the version (another version is EntryForeign: another writer may
share the directory, so the file is left alone), that the header parses, the head's sha256, the file's size
against the header (a truncated or extended file), the key and the members (a file under another key's name
is EntryCorrupt), the identity (another model, dtype or cache layout is EntryForeign, found before the
payload is read), each tensor's dtype, shape and offset (tensors may not overlap), then every payload
chunk's crc32, padding included. Corruption
anywhere, a truncation included, is EntryCorrupt before any tensor is returned, and no header field is
trusted before the head's sha256 matched.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor

import torch

from deepinfer.core.kv_tiers.payload import DTYPES, MAX_KEY_BYTES, dtype_name, tensor_bytes

MAGIC = b"DIKVBLK\0"
FORMAT_VERSION = 3
ALIGN = 64
CHUNK_BYTES = 1 << 20  # a payload checksum's stretch; the reader checks each chunk right after reading it
_PREFIX = struct.Struct("<8sII32s")  # magic, version, header length, sha256 of the head
PREFIX_BYTES = _PREFIX.size  # 48
MAX_HEADER_BYTES = 1 << 20
MAX_MEMBERS = 1 << 20


class EntryCorrupt(ValueError):
    """The file is damaged (truncated, bit flips, a bad header, or stored under the wrong name)."""


class EntryForeign(ValueError):
    """The file is intact but not ours to serve: another format version or another identity."""


def _pad(n: int) -> int:
    return -n % ALIGN


def _chunk_sums(pieces) -> bytes:
    """crc32 of each CHUNK_BYTES stretch of the bytes of pieces (buffers) laid end to end, as u32s."""
    sums, crc, filled = [], 0, 0
    for p in pieces:
        with memoryview(p).cast("B") as view:
            at = 0
            while at < len(view):
                take = min(CHUNK_BYTES - filled, len(view) - at)
                crc = zlib.crc32(view[at:at + take], crc)
                at += take
                filled += take
                if filled == CHUNK_BYTES:
                    sums.append(crc)
                    crc = filled = 0
    if filled:
        sums.append(crc)
    return struct.pack(f"<{len(sums)}I", *sums)


def encode(key: bytes, identity: str, payload: dict, members=()) -> list:
    """The entry's bytes as a list of chunks to write in order: the prefix, the header, the rest of the head,
    then the payload's (the tensors' chunks are views, not copies). members: a run's block hashes
    (payload.check_run holds), () for a plain entry."""
    chunks, tensors, offset = [], [], 0
    for name, t in payload.items():
        data = tensor_bytes(t)
        tensors.append([name, dtype_name(t.dtype), list(t.shape), offset])
        chunks += [data, bytes(_pad(data.nbytes))]
        offset += data.nbytes + _pad(data.nbytes)
    header = json.dumps({"identity": identity, "key": key.hex(), "members": len(members), "payload_bytes": offset,
                         "tensors": tensors}, separators=(",", ":")).encode()
    head = b"".join(members) + _chunk_sums(chunks)
    head += bytes(_pad(PREFIX_BYTES + len(header) + len(head)))
    digest = hashlib.sha256(header)
    digest.update(head)
    return [_PREFIX.pack(MAGIC, FORMAT_VERSION, len(header), digest.digest()), header, head, *chunks]


def read_prefix(prefix: bytes) -> int:
    """The header length from a file's first PREFIX_BYTES bytes; raises EntryCorrupt or EntryForeign."""
    if len(prefix) < PREFIX_BYTES:
        raise EntryCorrupt(f"{len(prefix)} bytes, shorter than the {PREFIX_BYTES}-byte prefix")
    magic, version, header_len, _ = _PREFIX.unpack_from(prefix)
    if magic != MAGIC:
        raise EntryCorrupt(f"bad magic {magic!r}")
    if version != FORMAT_VERSION:
        raise EntryForeign(f"format version {version}, this reader knows {FORMAT_VERSION}")
    if header_len > MAX_HEADER_BYTES:
        raise EntryCorrupt(f"header length {header_len} over {MAX_HEADER_BYTES}")
    return header_len


def parse_header(data: bytes) -> dict:
    """The JSON header from its H bytes (not checked against the digest: a caller that trusts a field must go
    on to read_entry(), or check what it read some other way)."""
    try:
        header = json.loads(bytes(data))
    except (UnicodeDecodeError, ValueError) as e:
        raise EntryCorrupt(f"header is not JSON: {e}") from None
    if not isinstance(header, dict) or not isinstance(header.get("key"), str) \
            or not isinstance(header.get("members"), int) or not 0 <= header["members"] <= MAX_MEMBERS:
        raise EntryCorrupt("header is not a JSON object with a key and a member count")
    return header


def read_head(read) -> tuple:
    """(header, members, payload start) of a file, from ``read(n)`` (its next n bytes, as a file's read):
    the prefix, the header and the members, not the chunk checksums or the payload. Unchecked, as
    parse_header."""
    header, members, _, start = _read_head(read, checked=False)
    return header, members, start


def _read_head(read, checked: bool) -> tuple:
    """(header, members, chunk checksums, payload start); with ``checked``, the chunk checksums and the
    padding are read too and the head's sha256 is checked (EntryCorrupt), else the checksums are None."""
    prefix = read(PREFIX_BYTES)
    header_len = read_prefix(prefix)
    raw = read(header_len)
    if len(raw) < header_len:
        raise EntryCorrupt(f"{PREFIX_BYTES + len(raw)} bytes, shorter than the {PREFIX_BYTES + header_len}-byte header")
    header = parse_header(raw)
    key = bytes.fromhex(header["key"]) if _is_hex(header["key"]) else b""
    k, n = len(key), header["members"]
    data = bytes(read(n * k)) if n else b""
    if not key or len(data) < n * k:
        raise EntryCorrupt("the header's key or the members are cut short")
    members = tuple([data[i:i + k] for i in range(0, n * k, k)])
    payload_bytes = header.get("payload_bytes")
    if not isinstance(payload_bytes, int) or not 0 <= payload_bytes < 1 << 48:
        raise EntryCorrupt(f"bad payload_bytes {payload_bytes!r:.40}")
    count = -(-payload_bytes // CHUNK_BYTES)
    used = PREFIX_BYTES + header_len + n * k + 4 * count
    start = used + _pad(used)
    if not checked:
        return header, members, None, start
    rest = bytes(read(start - used + 4 * count))
    if len(rest) < start - used + 4 * count:
        raise EntryCorrupt("the chunk checksums are cut short")
    digest = hashlib.sha256(raw)
    digest.update(data)
    digest.update(rest)
    if digest.digest() != _PREFIX.unpack_from(prefix)[3]:
        raise EntryCorrupt("head checksum mismatch")
    return header, members, struct.unpack_from(f"<{count}I", rest), start


def _is_hex(s: str) -> bool:
    return len(s) % 2 == 0 and 0 < len(s) <= 2 * MAX_KEY_BYTES and all(c in "0123456789abcdef" for c in s)


def read_entry(f, size: int, key: bytes, identity: str, alloc=torch.empty) -> tuple:
    """(payload, members) of the entry file open as f (read, readinto; at its start) of ``size`` bytes; or
    EntryCorrupt/EntryForeign. Each tensor is a new ``alloc(shape, dtype=dtype)`` (the disk tier's is pinned
    where CUDA is) that its bytes are read straight into, the payload's chunk checksums checked as they go."""
    header, members, sums, start = _read_head(f.read, checked=True)
    try:
        payload_bytes, tensors = header["payload_bytes"], header["tensors"]
        if size != start + payload_bytes:
            raise EntryCorrupt(f"{size} bytes, the header says {start + payload_bytes}")
        if header["key"] != key.hex() or (members and members[0] != key):
            raise EntryCorrupt(f"the file holds key {header['key']:.128}")
        if header["identity"] != identity:
            raise EntryForeign(f"written for identity {header['identity']!r:.200}")
        layout = []
        for name, dtype, shape, offset in tensors:
            dt = DTYPES[dtype]
            numel = 1
            for s in shape:
                if not isinstance(s, int) or s < 0:
                    raise EntryCorrupt(f"tensor {name!r} has shape {shape}")
                numel *= s
            if members and (not shape or shape[0] != len(members)):
                raise EntryCorrupt(f"run tensor {name!r} has shape {shape} for {len(members)} members")
            nbytes = numel * dt.itemsize
            if not isinstance(offset, int) or offset < 0 or offset % ALIGN or offset + nbytes > payload_bytes:
                raise EntryCorrupt(f"tensor {name!r} at {offset} (+{nbytes}) outside {payload_bytes} payload bytes")
            layout.append((offset, nbytes, name, dt, tuple(shape)))
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, (EntryCorrupt, EntryForeign)):
            raise
        raise EntryCorrupt(f"bad header field: {e!r}") from None
    reader, read, at = _CheckedReader(f, sums), {}, 0
    for offset, nbytes, name, dt, shape in sorted(layout, key=lambda x: x[:2]):  # in file order
        if offset < at:
            raise EntryCorrupt(f"tensor {name!r} at {offset} overlaps the one before it (to {at})")
        reader.skip(offset - at)  # the padding after the tensor before
        t = alloc(shape, dtype=dt)
        if nbytes:
            with memoryview(t.reshape(-1).view(torch.uint8).numpy()) as view:
                reader.read_into(view)
        read[name], at = t, offset + nbytes
    reader.skip(payload_bytes - at)
    reader.finish()
    return {name: read[name] for _, _, name, _, _ in layout}, members


def _crc(pieces: list) -> int:
    crc = 0
    for piece in pieces:
        crc = zlib.crc32(piece, crc)
    return crc


_CHECKERS = (None, None)  # (pid, pool): threads that check chunks while the reader reads on (zlib drops the GIL)


def _checkers() -> ThreadPoolExecutor:
    global _CHECKERS
    pid, pool = _CHECKERS
    if pid != os.getpid():  # none yet, or a forked child's copy, whose threads are not running
        pool = ThreadPoolExecutor(max(1, min(4, (os.cpu_count() or 1) - 1)), thread_name_prefix="kv-crc")
        _CHECKERS = (os.getpid(), pool)
    return pool


class _CheckedReader:
    """Reads a payload from f in order and checks each CHUNK_BYTES stretch's crc32 against its sum: a payload
    of several chunks has each chunk checked on a worker thread as soon as its last byte is in (the next
    chunk is read meanwhile), and ``finish`` waits for every check, so nothing is returned unchecked."""

    def __init__(self, f, sums: tuple):
        self.f, self.sums = f, sums
        self.pieces: list = []  # the views of the chunk being filled
        self.filled = self.chunk = 0
        self.pool = _checkers() if len(sums) > 1 else None
        self.checks: list = []  # (chunk, crc future)

    def read_into(self, view: memoryview) -> None:
        at = 0
        while at < len(view):
            piece = view[at:at + min(CHUNK_BYTES - self.filled, len(view) - at)]
            n = 0
            while n < len(piece) and (got := self.f.readinto(piece[n:])):
                n += got
            if n < len(piece):
                raise EntryCorrupt(f"the payload ends early, in chunk {self.chunk} of {len(self.sums)}")
            self.pieces.append(piece)
            self.filled += n
            at += n
            if self.filled == CHUNK_BYTES:
                self._close()

    def skip(self, n: int) -> None:
        """Read (and check) n bytes that belong to no tensor (a buffer of their own: a check may still read it)."""
        if n:
            self.read_into(memoryview(bytearray(n)))

    def finish(self) -> None:
        if self.filled:
            self._close()
        bad = [i for i, crc in self.checks if (crc if isinstance(crc, int) else crc.result()) != self.sums[i]]
        if bad:
            raise EntryCorrupt(f"checksum mismatch in payload chunk {bad[0]} of {len(self.sums)}")
        if self.chunk != len(self.sums):
            raise EntryCorrupt(f"the payload holds {self.chunk} chunks, the head lists {len(self.sums)}")

    def _close(self) -> None:
        if self.chunk >= len(self.sums):
            raise EntryCorrupt(f"the payload holds more than the {len(self.sums)} chunks the head lists")
        pieces, self.pieces = self.pieces, []
        crc = _crc(pieces) if self.pool is None else self.pool.submit(_crc, pieces)
        self.checks.append((self.chunk, crc))
        self.chunk += 1
        self.filled = 0

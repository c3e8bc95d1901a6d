"""The disk entry format: one entry per file (a plain payload, or a run of blocks), raw bytes behind a small
checked header.

Layout (all integers little-endian)::

    offset  size  field
    0       8     magic  b"DIKVBLK\\0"
    8       4     format version (u32), FORMAT_VERSION
    12      4     header length H (u32): the JSON header's bytes
    16      32    sha256 of everything after this field: the header, the members, the padding, the payload
    48      H     header: UTF-8 JSON {"identity": str, "key": hex, "members": n, "payload_bytes": int,
                  "tensors": [[name, dtype, shape, offset], ...]}
    48+H    n*K   the run's members (block hashes, K = the key's length each) in chain order, members[0] ==
                  key; none (n = 0) for a plain entry. Then zero padding up to a multiple of ALIGN: S
    S       P     payload: each tensor's row-major bytes at its offset (relative to S, a multiple of ALIGN;
                  zero padding between tensors); P == payload_bytes. A run's tensors all have shape[0] == n.

The file is exactly S + P bytes. Nothing is pickled and nothing is executed: a reader parses JSON and views
the bytes with torch.frombuffer. Magic and version come first and stay where they are in every version, so a
reader knows a file of another version before it parses anything else. The members sit before the payload,
so a reader learns which blocks a file holds from its first 48 + H + n*K bytes (``read_head``; the disk
tier's start-up index), without reading or checking the payload.

Version 2 (runs) replaced version 1 (one block per file, no members); a version-1 file reads as foreign.

decode() checks, in order: the magic, the version (another version is EntryForeign: a newer writer may share
the directory, so the file is left alone), that the header parses, the checksum, the file's size against the
header, the key and the members (a file under another key's name is EntryCorrupt), the identity (another
model, dtype or cache layout is EntryForeign), then each tensor's dtype, shape and offset. Corruption
anywhere, a truncation included, fails the checksum before any header field is trusted.
"""

from __future__ import annotations

import hashlib
import json
import struct

from deepinfer.core.kv_tiers.payload import DTYPES, MAX_KEY_BYTES, dtype_name, tensor_bytes, tensor_from_bytes

MAGIC = b"DIKVBLK\0"
FORMAT_VERSION = 2
ALIGN = 64
_PREFIX = struct.Struct("<8sII32s")  # magic, version, header length, sha256
PREFIX_BYTES = _PREFIX.size  # 48
MAX_HEADER_BYTES = 1 << 20
MAX_MEMBERS = 1 << 20


class EntryCorrupt(ValueError):
    """The file is damaged (truncated, bit flips, a bad header, or stored under the wrong name)."""


class EntryForeign(ValueError):
    """The file is intact but not ours to serve: another format version or another identity."""


def _pad(n: int) -> int:
    return -n % ALIGN


def encode(key: bytes, identity: str, payload: dict, members=()) -> list:
    """The entry's bytes as a list of chunks to write in order (the tensors' chunks are views, not copies).
    members: a run's block hashes (payload.check_run holds), () for a plain entry."""
    chunks, tensors, offset = [], [], 0
    for name, t in payload.items():
        data = tensor_bytes(t)
        tensors.append([name, dtype_name(t.dtype), list(t.shape), offset])
        chunks += [data, bytes(_pad(data.nbytes))]
        offset += data.nbytes + _pad(data.nbytes)
    header = json.dumps({"identity": identity, "key": key.hex(), "members": len(members), "payload_bytes": offset,
                         "tensors": tensors}, separators=(",", ":")).encode()
    head = b"".join(members)
    head += bytes(_pad(PREFIX_BYTES + len(header) + len(head)))
    digest = hashlib.sha256(header)
    digest.update(head)
    for c in chunks:
        digest.update(c)
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
    on to decode(), or check what it read some other way)."""
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
    the prefix, the header and the members, not the payload. Unchecked, as parse_header."""
    header_len = read_prefix(read(PREFIX_BYTES))
    raw = read(header_len)
    if len(raw) < header_len:
        raise EntryCorrupt(f"{PREFIX_BYTES + len(raw)} bytes, shorter than the {PREFIX_BYTES + header_len}-byte header")
    header = parse_header(raw)
    key = bytes.fromhex(header["key"]) if _is_hex(header["key"]) else b""
    n = header["members"]
    data = bytes(read(n * len(key))) if n else b""
    if not key or len(data) < n * len(key):
        raise EntryCorrupt("the header's key or the members are cut short")
    members = tuple(data[i * len(key):(i + 1) * len(key)] for i in range(n))
    used = PREFIX_BYTES + header_len + n * len(key)
    return header, members, used + _pad(used)


def _is_hex(s: str) -> bool:
    return len(s) % 2 == 0 and 0 < len(s) <= 2 * MAX_KEY_BYTES and all(c in "0123456789abcdef" for c in s)


def decode(buf: bytearray, key: bytes, identity: str) -> tuple:
    """(payload, members) stored in buf (a whole file), the tensors sharing buf's memory; or
    EntryCorrupt/EntryForeign."""
    view = memoryview(buf)
    pos = [0]

    def read(n):
        out = view[pos[0]:pos[0] + n]
        pos[0] += n
        return out

    header, members, start = read_head(read)
    if hashlib.sha256(view[PREFIX_BYTES:]).digest() != _PREFIX.unpack_from(buf)[3]:
        raise EntryCorrupt("checksum mismatch")
    try:
        payload_bytes, tensors = header["payload_bytes"], header["tensors"]
        if len(buf) != start + payload_bytes:
            raise EntryCorrupt(f"{len(buf)} bytes, the header says {start + payload_bytes}")
        if header["key"] != key.hex() or (members and members[0] != key):
            raise EntryCorrupt(f"the file holds key {header['key']:.128}")
        if header["identity"] != identity:
            raise EntryForeign(f"written for identity {header['identity']!r:.200}")
        payload = {}
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
            payload[name] = tensor_from_bytes(buf, start + offset, dt, tuple(shape))
        return payload, members
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, (EntryCorrupt, EntryForeign)):
            raise
        raise EntryCorrupt(f"bad header field: {e!r}") from None

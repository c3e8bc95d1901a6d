"""The disk entry format: one KV block payload per file, raw bytes behind a small checked header.

Layout (all integers little-endian)::

    offset  size  field
    0       8     magic  b"DIKVBLK\\0"
    8       4     format version (u32), FORMAT_VERSION
    12      4     header length H (u32): the JSON header's bytes, padded with spaces
    16      32    sha256 of everything after this field: the header's H bytes, then the payload bytes
    48      H     header: UTF-8 JSON {"identity": str, "key": hex, "payload_bytes": int,
                  "tensors": [[name, dtype, shape, offset], ...]}, padded with spaces so that the payload
                  starts at a multiple of ALIGN
    48+H    P     payload: each tensor's row-major bytes at its offset (relative to the payload start, a
                  multiple of ALIGN; zero padding between tensors); P == payload_bytes

The file is exactly 48 + H + P bytes. Nothing is pickled and nothing is executed: a reader parses JSON and
views the bytes with torch.frombuffer. Magic and version come first and stay where they are in every
version, so a reader knows a file of another version before it parses anything else.

decode() checks, in order: the magic, the version (another version is EntryForeign: a newer writer may share
the directory, so the file is left alone), that the header parses, the checksum, the file's size against the
header, the key (a file under another key's name is EntryCorrupt), the identity (another model, dtype or cache
layout is EntryForeign), then each tensor's dtype, shape and offset. Corruption anywhere, a truncation
included, fails the checksum before any header field is trusted.
"""

from __future__ import annotations

import hashlib
import json
import struct

from deepinfer.core.kv_tiers.payload import DTYPES, dtype_name, tensor_bytes, tensor_from_bytes

MAGIC = b"DIKVBLK\0"
FORMAT_VERSION = 1
ALIGN = 64
_PREFIX = struct.Struct("<8sII32s")  # magic, version, header length, sha256
PREFIX_BYTES = _PREFIX.size  # 48
MAX_HEADER_BYTES = 1 << 20


class EntryCorrupt(ValueError):
    """The file is damaged (truncated, bit flips, a bad header, or stored under the wrong name)."""


class EntryForeign(ValueError):
    """The file is intact but not ours to serve: another format version or another identity."""


def _pad(n: int) -> int:
    return -n % ALIGN


def encode(key: bytes, identity: str, payload: dict) -> list:
    """The entry's bytes as a list of chunks to write in order (the tensors' chunks are views, not copies)."""
    chunks, tensors, offset = [], [], 0
    for name, t in payload.items():
        data = tensor_bytes(t)
        tensors.append([name, dtype_name(t.dtype), list(t.shape), offset])
        chunks += [data, bytes(_pad(data.nbytes))]
        offset += data.nbytes + _pad(data.nbytes)
    header = json.dumps({"identity": identity, "key": key.hex(), "payload_bytes": offset, "tensors": tensors},
                        separators=(",", ":")).encode()
    header += b" " * _pad(PREFIX_BYTES + len(header))
    digest = hashlib.sha256(header)
    for c in chunks:
        digest.update(c)
    return [_PREFIX.pack(MAGIC, FORMAT_VERSION, len(header), digest.digest()), header, *chunks]


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


def read_header(buf: bytes) -> tuple:
    """(header length, parsed JSON header) from a file's first PREFIX_BYTES + header length bytes; the digest
    is not checked here, so a caller that trusts a field must go on to decode()."""
    header_len = read_prefix(buf)
    if len(buf) < PREFIX_BYTES + header_len:
        raise EntryCorrupt(f"{len(buf)} bytes, shorter than the {PREFIX_BYTES + header_len}-byte header")
    try:
        header = json.loads(bytes(buf[PREFIX_BYTES:PREFIX_BYTES + header_len]))
    except (UnicodeDecodeError, ValueError) as e:
        raise EntryCorrupt(f"header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise EntryCorrupt("header is not a JSON object")
    return header_len, header


def decode(buf: bytearray, key: bytes, identity: str) -> dict:
    """The payload stored in buf (a whole file), as tensors sharing buf's memory; or EntryCorrupt/EntryForeign."""
    header_len, header = read_header(buf)
    body = memoryview(buf)[PREFIX_BYTES:]
    if hashlib.sha256(body).digest() != _PREFIX.unpack_from(buf)[3]:
        raise EntryCorrupt("checksum mismatch")
    try:
        payload_bytes, tensors = header["payload_bytes"], header["tensors"]
        if len(buf) != PREFIX_BYTES + header_len + payload_bytes:
            raise EntryCorrupt(f"{len(buf)} bytes, the header says {PREFIX_BYTES + header_len + payload_bytes}")
        if header["key"] != key.hex():
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
            nbytes = numel * dt.itemsize
            if not isinstance(offset, int) or offset < 0 or offset % ALIGN or offset + nbytes > payload_bytes:
                raise EntryCorrupt(f"tensor {name!r} at {offset} (+{nbytes}) outside {payload_bytes} payload bytes")
            payload[name] = tensor_from_bytes(buf, PREFIX_BYTES + header_len + offset, dt, tuple(shape))
        return payload
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, (EntryCorrupt, EntryForeign)):
            raise
        raise EntryCorrupt(f"bad header field: {e!r}") from None

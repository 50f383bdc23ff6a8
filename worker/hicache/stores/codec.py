"""The self-checking byte format of a stored KV page, shared by every ``PageStore`` backend.

A stored page is three parts, back to back::

    prefix  52 bytes, little-endian: magic b"PDKV", version u16, 2 pad bytes,
            header length u32, data length u64, checksum (CRC-32, u32)
    header  the ``StoredPageHeader`` fields, msgpack (msgspec), ``header length`` bytes
    data    the page's KV bytes, ``data length`` bytes

The checksum is CRC-32 over the prefix's fields before it (magic, version, lengths), the header
and the data, so a flipped bit anywhere (every burst of up to 32 bits, any other corruption but
for a 2**-32 chance), a truncated or extended value, or a page stored under another page's key
(the header's digest is checked against the key asked for) is caught. CRC-32, not a
cryptographic hash: the threat is a bad disk or a torn write, not an adversary who can write
the store's files (who could as well rewrite the checksum), and zlib's CRC-32 runs at ~4 GiB/s
where blake2b runs at ~0.6 GiB/s, which held the prefetch to a fraction of the disk's speed
(``bench/kv_tiers/main.py``).
Everything that fails is ``PageCorrupt``; the backend deletes it and re-raises.

Why a custom format and not msgpack of the whole page: the data part is written and read as-is
(no copy through an encoder), and a backend can read the small prefix first to bound the rest.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from worker.hicache.stores.base import PageCorrupt, StoredPage, StoredPageHeader

__all__ = [
    "MAX_HEADER_BYTES",
    "PREFIX",
    "PagePrefix",
    "decode_page",
    "encode_page",
    "page_checksum",
    "parse_prefix",
    "read_page",
    "verify_page",
]

MAGIC = b"PDKV"
VERSION = 2  # 1: blake2b checksums (read as foreign: such a page is dropped and recomputed)
# magic, version, pad, header length, data length, checksum
PREFIX = struct.Struct("<4sH2xIQI")
_CHECKED = struct.Struct("<4sH2xIQ")  # the prefix's fields that the checksum covers
# a header is a page's token ids plus two digests: far below this even for huge pages
MAX_HEADER_BYTES = 1 << 20

_header_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(StoredPageHeader)


@dataclass(frozen=True, slots=True)
class PagePrefix:
    """The fixed prefix of a stored page, parsed and bounds-checked (not yet verified)."""

    header_len: int
    data_len: int
    checksum: int

    @property
    def total_len(self) -> int:
        """The whole stored page's length in bytes."""
        return PREFIX.size + self.header_len + self.data_len


def page_checksum(header_len: int, data_len: int, header: bytes, data: bytes | memoryview) -> int:
    """CRC-32 over the checked prefix fields, the header and the data (zlib releases the GIL
    for large buffers, so checking a big page in a worker thread does not stall the event loop)."""
    crc = zlib.crc32(_CHECKED.pack(MAGIC, VERSION, header_len, data_len))
    crc = zlib.crc32(header, crc)
    return zlib.crc32(data, crc)


def encode_page(page: StoredPage) -> tuple[bytes, bytes]:
    """``(prefix + header, data)``: write both, in order, or join them (``data`` is not copied)."""
    header = _header_encoder.encode(page.header)
    checksum = page_checksum(len(header), len(page.data), header, page.data)
    prefix = PREFIX.pack(MAGIC, VERSION, len(header), len(page.data), checksum)
    return prefix + header, page.data


def parse_prefix(prefix: bytes | memoryview, max_data_bytes: int) -> PagePrefix:
    """The fixed prefix's fields; ``PageCorrupt`` when it is short, foreign or out of bounds."""
    if len(prefix) < PREFIX.size:
        raise PageCorrupt(
            f"truncated: {len(prefix)} bytes, shorter than the {PREFIX.size}-byte prefix"
        )
    magic, version, header_len, data_len, checksum = PREFIX.unpack_from(prefix)
    if magic != MAGIC:
        raise PageCorrupt(f"not a stored page (magic {magic!r})")
    if version != VERSION:
        raise PageCorrupt(f"unknown page format version {version}")
    if header_len > MAX_HEADER_BYTES:
        raise PageCorrupt(f"header length {header_len} is over {MAX_HEADER_BYTES}")
    if data_len > max_data_bytes:
        raise PageCorrupt(f"data length {data_len} is over the limit {max_data_bytes}")
    return PagePrefix(header_len, data_len, checksum)


def verify_page(prefix: PagePrefix, header: bytes, data: bytes, digest: bytes) -> StoredPage:
    """The page, once its parts match ``prefix`` (lengths, checksum) and its header names
    ``digest``; ``PageCorrupt`` otherwise."""
    if len(header) != prefix.header_len or len(data) != prefix.data_len:
        raise PageCorrupt(
            f"truncated: header {len(header)}/{prefix.header_len} bytes, "
            f"data {len(data)}/{prefix.data_len} bytes"
        )
    if page_checksum(prefix.header_len, prefix.data_len, header, data) != prefix.checksum:
        raise PageCorrupt("checksum mismatch")
    try:
        decoded = _header_decoder.decode(header)
    except msgspec.DecodeError as exc:  # a checksummed but foreign header: not ours either
        raise PageCorrupt(f"undecodable header: {exc}") from exc
    if decoded.digest != digest:
        raise PageCorrupt(f"stored under {digest.hex()} but holds page {decoded.digest.hex()}")
    return StoredPage(decoded, data)


def decode_page(blob: bytes, digest: bytes, max_data_bytes: int) -> StoredPage:
    """Decode and verify a whole stored page held in memory (the distributed backends)."""
    prefix = parse_prefix(blob, max_data_bytes)
    if len(blob) != prefix.total_len:
        raise PageCorrupt(f"length {len(blob)} bytes, expected {prefix.total_len}")
    view = memoryview(blob)
    header_end = PREFIX.size + prefix.header_len
    header = bytes(view[PREFIX.size : header_end])
    data = bytes(view[header_end:])
    return verify_page(prefix, header, data, digest)


def read_page(read: Callable[[int], bytes], digest: bytes, max_data_bytes: int) -> StoredPage:
    """Decode and verify a page from a stream (``read(n)`` as ``BinaryIO.read``): the prefix
    first, so a garbled length never makes it read more than the limit; trailing bytes are
    corruption too."""
    prefix = parse_prefix(read(PREFIX.size), max_data_bytes)
    header = read(prefix.header_len)
    data = read(prefix.data_len)
    if read(1):
        raise PageCorrupt(f"longer than the {prefix.total_len} bytes its prefix declares")
    return verify_page(prefix, header, data, digest)

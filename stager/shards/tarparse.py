"""Count the samples of an uncompressed tar from its bytes as they stream past during a copy.

Counting after the copy means opening and parsing every shard a second time (about a
millisecond of CPU per shard, which matters at thousands of small shards on 2 cores). The copy
already holds every byte once, so this parser walks the 512-byte headers in flight: it reads
each header's name, type and size, honours GNU long names and PAX ``path`` records, skips
payloads arithmetically, and counts a sample whenever the WebDataset key changes.

Anything unexpected (a bad size field, no end-of-archive block) makes :attr:`samples` None, and
the caller falls back to :func:`stager.shards.tarindex.count_samples` on the local copy, which raises
an error naming the member. It never guesses.
"""

from __future__ import annotations

from stager.shards.tarindex import TarIndex, split_key

__all__ = ["TarSampleCounter"]

_BLOCK = 512
_MAX_META = 1 << 20  # a PAX or long-name payload larger than this is not a name: give up


def _octal(field: bytes) -> int:
    if field and field[0] & 0x80:  # GNU base-256 for sizes past 8 GiB
        value = int.from_bytes(field[1:], "big")
        return value
    text = field.rstrip(b"\0 ").lstrip(b" ")
    return int(text, 8) if text else 0


def _pax_path(payload: bytes) -> str | None:
    """The ``path`` record of a PAX extended header, if any."""
    pos, found = 0, None
    while pos < len(payload):
        space = payload.find(b" ", pos)
        if space < 0:
            break
        length = int(payload[pos:space])
        if length <= 0:
            raise ValueError("bad PAX record length")
        key, _, value = payload[space + 1 : pos + length - 1].partition(b"=")
        if key == b"size":
            raise ValueError("PAX size record (a member past 8 GiB): left to tarfile")
        if key == b"path":
            found = value.decode("utf-8", "surrogateescape")
        pos += length
    return found


class TarSampleCounter:
    """Feed it the tar's bytes in order (any chunking); read :attr:`samples` at the end."""

    def __init__(self) -> None:
        self._pending = bytearray()  # a header, or a metadata payload, being assembled
        self._skip = 0  # payload and padding bytes still to pass over
        self._meta_type: bytes | None = None  # b"x" or b"L" while a metadata payload is assembled
        self._meta_size = 0
        self._next_name: str | None = None  # from a preceding PAX/long-name header
        self._last_key: str | None = None
        self._count = 0
        self._zero_blocks = 0
        self._failed = False
        self._base = 0  # stream bytes before the current chunk
        self._data_at = 0  # stream offset just past the header being parsed
        # Per member, for the loader's index: sample key, extension, payload offset and size.
        self._keys: list[str] = []
        self._starts: list[int] = []
        self._exts: list[str] = []
        self._offsets: list[int] = []
        self._sizes: list[int] = []

    @property
    def finished(self) -> bool:
        """True once the end-of-archive block was seen, or the stream was found malformed."""
        return self._failed or self._zero_blocks > 0

    def skip_ahead(self) -> int:
        """Hand over the payload bytes the parser would pass over next, and account them as passed.

        A reader that can seek (:func:`stager.shards.tarindex.index_tar` on a local file) jumps over
        them instead of reading them; a copy feeds every byte anyway and never calls this.
        """
        skipped, self._skip = self._skip, 0
        self._base += skipped
        return skipped

    @property
    def samples(self) -> int | None:
        """The count, or None if the stream was not a complete, well-formed tar."""
        return None if self._failed or self._zero_blocks == 0 else self._count

    def index(self) -> TarIndex | None:
        """Where each sample's members sit, as :func:`stager.shards.tarindex.index_tar` would say."""
        if self.samples is None:
            return None
        import numpy as np  # deferred like tarindex's: only a finished copy pays for it

        return TarIndex(
            keys=list(self._keys),
            member_start=np.asarray([*self._starts, len(self._exts)], dtype=np.int64),
            exts=list(self._exts),
            offsets=np.asarray(self._offsets, dtype=np.int64),
            sizes=np.asarray(self._sizes, dtype=np.int64),
        )

    def feed(self, chunk: bytes | memoryview) -> None:
        if self._failed or self._zero_blocks:
            return
        view = memoryview(chunk)
        pos, end = 0, len(view)
        base, self._base = self._base, self._base + end
        try:
            while pos < end and not self._zero_blocks:
                if self._skip:
                    step = min(self._skip, end - pos)
                    self._skip -= step
                    pos += step
                    continue
                want = self._meta_size if self._meta_type is not None else _BLOCK
                step = min(want - len(self._pending), end - pos)
                self._pending += view[pos : pos + step]
                pos += step
                if len(self._pending) < want:
                    continue
                if self._meta_type is not None:
                    self._finish_meta(bytes(self._pending))
                else:
                    self._data_at = base + pos
                    self._header(bytes(self._pending))
                self._pending.clear()
        except (ValueError, UnicodeDecodeError):
            self._failed = True

    def _finish_meta(self, payload: bytes) -> None:
        if self._meta_type == b"L":
            self._next_name = payload.rstrip(b"\0").decode("utf-8", "surrogateescape")
        else:
            self._next_name = _pax_path(payload) or self._next_name
        self._skip = -self._meta_size % _BLOCK
        self._meta_type = None

    def _header(self, header: bytes) -> None:
        if header == bytes(_BLOCK):
            self._zero_blocks += 1  # end of archive
            return
        if sum(header[:148]) + 256 + sum(header[156:]) != _octal(header[148:156]):
            raise ValueError("header checksum mismatch")
        size = _octal(header[124:136])
        kind = header[156:157]
        if kind in (
            b"S",
            b"M",
            b"V",
            b"g",
        ):  # sparse, multi-volume, volume, global PAX: left to tarfile
            raise ValueError(f"tar member type {kind!r} not handled here")
        if kind in (b"x", b"L"):
            if size > _MAX_META:
                raise ValueError("metadata payload too large")
            self._meta_type, self._meta_size = kind, size
            if size == 0:
                self._finish_meta(b"")
            return
        name = header[0:100].split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
        if header[257:262] == b"ustar":
            prefix = header[345:500].split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
            if prefix:
                name = f"{prefix}/{name}"
        if self._next_name is not None:
            name, self._next_name = self._next_name, None
        if kind in (b"0", b"\0", b"7"):
            parts = split_key(name)
            if parts is not None:
                if parts[0] != self._last_key:
                    self._count += 1
                    self._last_key = parts[0]
                    self._keys.append(parts[0])
                    self._starts.append(len(self._exts))
                self._exts.append(parts[1])
                self._offsets.append(self._data_at)
                self._sizes.append(size)
        if kind not in (b"5", b"3", b"4", b"6", b"1", b"2"):  # those carry no payload
            self._skip = size + (-size % _BLOCK)

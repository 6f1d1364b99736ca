"""The SSD tier of the prompt cache: entries as files that outlive the process.

One safetensors file per entry, ``<layout key[:16]>-<entry key>.safetensors``, its metadata holding
the full layout key (``layout.py``), the tokens, the layers' description and a CRC-32 of the data.
A background thread writes them, so the engine thread only hands over evaluated arrays: to
``<name>.tmp-<pid>``, fsync, rename, fsync the folder. A process killed while writing leaves a temp
file, never a partial file under an entry's name; the next start removes temp files whose process
is gone.

A file is read only if its header parses, names this format and this exact layout, its size is
what the header says, its data matches the CRC and its arrays fit the layout; otherwise it is
removed with one log line and the lookup goes on without it. Files of other layouts (another model
sharing the folder) are never read.

The folder's entry files (every layout's) are kept within ``min(max_bytes, half of the free space
plus what they hold)``, oldest modification first; a hit touches its file, so that is least
recently used first, across restarts. A write that fails (full disk, read-only or missing folder)
is logged once and stops the writing; requests never see it.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import shutil
import threading
import time
import zlib
from pathlib import Path
from typing import Hashable

import mlx.core as mx
import numpy as np

from ..errors import one_line
from .index import PrefixIndex
from .layout import Layout, flatten, raw

MAGIC = "dflash-mlx prompt cache"
NAME = re.compile(r"^([0-9a-f]{16})-([0-9a-f]{32})\.safetensors$")
TEMP = re.compile(r"\.tmp-(\d+)$")
STALE_TEMP_SECONDS = 3600.0  # a temp file this old is a dead writer's, whatever its pid says
MAX_PENDING = 4  # writes queued at most; past that a save stays in RAM only
# safetensors dtype name, the numpy dtype holding it bit for bit, the mlx dtype
DTYPES = {
    "F32": (np.float32, mx.float32), "F16": (np.float16, mx.float16), "BF16": (np.uint16, mx.bfloat16),
    "I32": (np.int32, mx.int32), "U32": (np.uint32, mx.uint32), "I64": (np.int64, mx.int64),
    "U8": (np.uint8, mx.uint8), "I8": (np.int8, mx.int8),
}
_NAMES = {m: name for name, (_, m) in DTYPES.items()}
log = logging.getLogger("dflash_mlx.prompt_cache")


class Damaged(Exception):
    """An entry file that must not be read; the message says why."""


def _data_bytes(a: np.ndarray) -> memoryview:
    return memoryview(np.ascontiguousarray(a)).cast("B")


def write_entry(path: Path, arrays: dict[str, tuple[str, np.ndarray]], metadata: dict[str, str]) -> None:
    """A safetensors file of ``arrays`` (name -> (safetensors dtype, data)) whose metadata adds the
    CRC-32 of the data, written under a temp name, synced, then renamed to ``path``."""
    header, data, offset, crc = {}, [], 0, 0
    for name, (dtype, a) in arrays.items():
        view = _data_bytes(a)
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [offset, offset + view.nbytes]}
        offset += view.nbytes
        crc = zlib.crc32(view, crc)
        data.append(view)
    header["__metadata__"] = {**metadata, "crc32": str(crc)}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    temp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        with open(temp, "wb") as f:
            f.write(len(text).to_bytes(8, "little"))
            f.write(text)
            for view in data:
                f.write(view)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    _sync_folder(path.parent)


def _sync_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_header(path: Path) -> tuple[dict, int]:
    """(header, file size) of an entry file; ``Damaged`` unless the header is whole and the file as
    long as it says."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little") if size >= 8 else -1
        if not 0 < n <= size - 8:
            raise Damaged("its header is missing or cut off")
        try:
            header = json.loads(f.read(n))
            ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"]
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
            raise Damaged(f"its header is unreadable ({type(e).__name__})") from None
    if size != 8 + n + max(ends, default=0):
        raise Damaged(f"it is {size} bytes, its header says {8 + n + max(ends, default=0)} (truncated or cut short)")
    return header, size


def entry_tokens(header: dict, layout_key: str) -> list[int]:
    """The tokens an entry file holds; ``Damaged`` if it is not this format and layout."""
    meta = header.get("__metadata__")
    if not isinstance(meta, dict) or meta.get("format") != MAGIC:
        raise Damaged("it is not a dflash-mlx prompt cache entry")
    if meta.get("layout") != layout_key:
        raise Damaged("it was written for another model, cache layout or software version")
    try:
        tokens = json.loads(meta["tokens"])
        assert isinstance(tokens, list) and tokens and all(isinstance(t, int) for t in tokens)
    except (KeyError, ValueError, AssertionError):
        raise Damaged("its token list is unreadable") from None
    return tokens


def read_entry(path: Path, layout_key: str) -> tuple[list[int], dict, dict[str, mx.array]]:
    """(tokens, layers, arrays) of an entry file, every check passed; ``Damaged`` otherwise."""
    header, size = read_header(path)
    tokens = entry_tokens(header, layout_key)
    meta = header.pop("__metadata__")
    blob = path.read_bytes()
    if len(blob) != size:
        raise Damaged("it changed while being read")
    start = 8 + int.from_bytes(blob[:8], "little")
    data = memoryview(blob)[start:]
    try:
        if zlib.crc32(data) != int(meta.get("crc32", -1)):
            raise Damaged("its data does not match its checksum")
        layers = json.loads(meta["layers"])
        arrays = {}
        for name, t in header.items():
            holder, dtype = DTYPES[t["dtype"]]
            begin, end = t["data_offsets"]
            a = np.frombuffer(data[begin:end], holder).reshape(t["shape"])
            arrays[name] = mx.array(a).view(dtype) if holder is np.uint16 and dtype == mx.bfloat16 else mx.array(a)
    except (KeyError, ValueError, TypeError) as e:
        raise Damaged(f"its arrays are unreadable ({type(e).__name__}: {one_line(e, 80)})") from None
    return tokens, layers, arrays


class DiskTier:
    """Entry files of one layout in ``directory``, found by prefix, written in the background."""

    def __init__(self, directory: str | os.PathLike, max_bytes: int, layout: Layout):
        self.directory, self.max_bytes, self.layout = Path(directory).expanduser(), max_bytes, layout
        self.prefix = layout.key[:16]
        self.index = PrefixIndex()
        self.sizes: dict[Hashable, int] = {}
        self.lock = threading.Lock()  # the index and sizes: the engine thread reads, the writer changes
        self.stopped: str | None = None  # why writing stopped, if it did
        self._writes: queue.Queue = queue.Queue()
        self._writer: threading.Thread | None = None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            self._stop(e)
        self._scan()

    @property
    def nbytes(self) -> int:
        with self.lock:
            return sum(self.sizes.values())

    def path(self, key: Hashable) -> Path:
        return self.directory / f"{self.prefix}-{key}.safetensors"

    def _stop(self, error: BaseException) -> None:
        if self.stopped is None:
            self.stopped = one_line(error)
            log.warning("prompt cache: cannot write to %s (%s); entries are kept in memory only from now on "
                        "(fix: free space, or give --prompt-cache-dir a writable folder)", self.directory, self.stopped)

    def _discard(self, path: Path, reason: str) -> None:
        log.warning("prompt cache: removed %s: %s", path, reason)
        try:
            path.unlink(missing_ok=True)
        except OSError as e:
            log.warning("prompt cache: could not remove %s (%s); it is ignored", path, one_line(e))

    def _scan(self) -> None:
        """Index this layout's entry files; remove damaged ones and dead writers' temp files."""
        try:
            listing = list(os.scandir(self.directory))
        except OSError:
            return
        now = time.time()
        for item in listing:
            path = Path(item.path)
            if (temp := TEMP.search(item.name)) is not None:
                try:
                    if _gone(int(temp.group(1))) or now - item.stat().st_mtime > STALE_TEMP_SECONDS:
                        path.unlink(missing_ok=True)
                        log.info("prompt cache: removed %s, left by a writer that stopped", path)
                except OSError:
                    pass
                continue
            match = NAME.match(item.name)
            if match is None or match.group(1) != self.prefix:
                continue
            try:
                header, size = read_header(path)
                tokens = entry_tokens(header, self.layout.key)
            except Damaged as e:
                self._discard(path, str(e))
                continue
            except OSError:
                continue
            self.index.add(match.group(2), tokens)
            self.sizes[match.group(2)] = size

    def longest(self, prompt: list[int]) -> tuple[int, Hashable] | None:
        with self.lock:
            return self.index.longest(prompt, self.layout.usable)

    def prefixes(self, tokens: list[int]) -> list[Hashable]:
        with self.lock:
            return self.index.prefixes(tokens)

    def __contains__(self, key: Hashable) -> bool:
        return key in self.index

    def _forget(self, key: Hashable) -> None:
        with self.lock:
            self.index.remove(key)
            self.sizes.pop(key, None)

    def load(self, key: Hashable) -> tuple[list[int], list, list] | None:
        """(tokens, target caches, drafter caches) of an entry; None if its file is gone or damaged
        (then removed)."""
        path = self.path(key)
        try:
            tokens, layers, arrays = read_entry(path, self.layout.key)
            if tokens != self.index.tokens.get(key):
                raise Damaged("its tokens are not the ones it was indexed with")
            cache, draft = self.layout.restore(arrays, layers)
        except FileNotFoundError:  # evicted by the writer, or by another process sharing the folder
            self._forget(key)
            return None
        except (Damaged, ValueError, KeyError, TypeError) as e:
            self._forget(key)
            self._discard(path, one_line(e))
            return None
        except OSError as e:
            self._forget(key)
            log.warning("prompt cache: cannot read %s (%s); it is ignored", path, one_line(e))
            return None
        mx.eval([c.state for c in cache], [c.state for c in draft])
        self.touch(key)
        return tokens, cache, draft

    def touch(self, key: Hashable) -> None:
        """Mark an entry used now (its file's modification time orders eviction)."""
        try:
            os.utime(self.path(key))
        except OSError:
            pass

    def put(self, key: Hashable, tokens: list[int], cache: list, draft: list, superseded: list[Hashable]) -> None:
        """Queue an entry (materialised caches) for writing, then the removal of the entries it
        supersedes. The arrays are evaluated here; the rest happens on the writer thread."""
        if self.stopped is not None or self._writes.unfinished_tasks >= MAX_PENDING:
            return
        arrays, layers = flatten(len(tokens), cache, draft)
        arrays = {name: (_NAMES[a.dtype], raw(a)) for name, a in arrays.items()}
        mx.eval([a for _, a in arrays.values()])
        metadata = {"format": MAGIC, "layout": self.layout.key, "tokens": json.dumps(tokens),
                    "layers": json.dumps(layers)}
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_all, name="dflash-prompt-cache-writer", daemon=True)
            self._writer.start()
        self._writes.put((key, tokens, arrays, metadata, superseded))

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for the queued writes (at most ``timeout`` seconds); whether they are done."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._writes.unfinished_tasks:
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def close(self, timeout: float | None = None) -> None:
        """Finish the queued writes (at most ``timeout`` seconds), then stop the writer thread."""
        self.flush(timeout)
        if self._writer is not None:
            self._writes.put(None)
            self._writer = None

    def _write_all(self) -> None:
        while True:
            item = self._writes.get()
            try:
                if item is None:  # closed
                    return
                if self.stopped is None:
                    self._write(*item)
            except OSError as e:
                self._stop(e)
            except Exception:  # a bug: say so, and keep requests going
                log.exception("prompt cache: writing an entry failed")
            finally:
                item = None  # the arrays are not held while the thread waits for the next entry
                self._writes.task_done()

    def _write(self, key: Hashable, tokens: list[int], arrays: dict, metadata: dict, superseded: list) -> None:
        size = sum(a.nbytes for _, a in arrays.values())  # and a header of a few kilobytes
        if not self._make_room(size):
            return
        path = self.path(key)
        write_entry(path, {name: (dtype, np.asarray(a)) for name, (dtype, a) in arrays.items()}, metadata)
        with self.lock:
            self.index.add(key, tokens)
            self.sizes[key] = path.stat().st_size
        for old in superseded:
            if old != key:
                self._forget(old)
                self.path(old).unlink(missing_ok=True)

    def _make_room(self, size: int) -> bool:
        """Evict the oldest entry files (any layout's) until ``size`` more bytes fit the bound."""
        files = []
        for item in os.scandir(self.directory):
            match = NAME.match(item.name)
            if match is not None:
                try:
                    st = item.stat()
                except FileNotFoundError:
                    continue
                files.append((st.st_mtime, st.st_size, Path(item.path), match))
        held = sum(f[1] for f in files)
        budget = min(self.max_bytes, (held + shutil.disk_usage(self.directory).free) // 2)
        if size > budget:
            return False
        for _, nbytes, path, match in sorted(files, key=lambda f: f[0]):
            if held + size <= budget:
                break
            if match.group(1) == self.prefix:
                self._forget(match.group(2))
            path.unlink(missing_ok=True)
            held -= nbytes
        return True


def _gone(pid: int) -> bool:
    """Whether no process ``pid`` runs (a dead writer's temp file)."""
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False

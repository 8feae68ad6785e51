"""rfs-io for Python: reads and writes of files on an rfs mount through a ring in shared
memory, beside the mount (docs/ring.md). Pure ctypes over librfs_io.so: nothing to build but
the library (`cargo build --release -p rfs-io`), found through $RFS_IO_LIB, next to this file,
or in the repository's target/release.

    ring = Ring("/mnt/rfs", buffer_len=64 << 20, entries=64)
    f = ring.register(open("/mnt/rfs/shard-0", "rb"))
    ring.prep_read(f, offset=0, length=4096, buf_off=0, user_data=7)
    for user_data, result in ring.wait(1):
        data = ring.buffer[0:result]          # a memoryview of the shared buffer: no copy

`ring.buffer` is a writable memoryview of the shared buffer (numpy.frombuffer takes it
without a copy). The ring's memory stays mapped as long as any view of it lives: close()
ends the ring for new calls at once, and gives the memory back when the last view goes.
One ring serves one call at a time (a lock orders threads). Errors raise OSError with the
request's errno.
"""

import ctypes
import os
import threading
import weakref

READ, WRITE, FSYNC = 1, 2, 3


class _Completion(ctypes.Structure):
    _fields_ = [("user_data", ctypes.c_uint64), ("result", ctypes.c_int64)]


def _find_library():
    here = os.path.dirname(os.path.abspath(__file__))
    candidates = [
        os.environ.get("RFS_IO_LIB"),
        os.path.join(here, "librfs_io.so"),
        os.path.join(here, "..", "..", "target", "release", "librfs_io.so"),
        os.path.join(here, "..", "..", "target", "debug", "librfs_io.so"),
    ]
    for path in candidates:
        if path and os.path.exists(path):
            return path
    raise OSError("librfs_io.so not found: build it (cargo build --release -p rfs-io) "
                  "or set RFS_IO_LIB")


_lib = ctypes.CDLL(_find_library(), use_errno=True)
_lib.rfs_ring_open.restype = ctypes.c_void_p
_lib.rfs_ring_open.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint32]
_lib.rfs_ring_close.argtypes = [ctypes.c_void_p]
_lib.rfs_ring_buffer.restype = ctypes.c_void_p
_lib.rfs_ring_buffer.argtypes = [ctypes.c_void_p]
_lib.rfs_ring_buffer_len.restype = ctypes.c_size_t
_lib.rfs_ring_buffer_len.argtypes = [ctypes.c_void_p]
_lib.rfs_ring_register.restype = ctypes.c_int64
_lib.rfs_ring_register.argtypes = [ctypes.c_void_p, ctypes.c_int]
_lib.rfs_ring_unregister.argtypes = [ctypes.c_void_p, ctypes.c_uint32]
_lib.rfs_ring_prep.argtypes = [ctypes.c_void_p, ctypes.c_uint8, ctypes.c_uint32,
                               ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint64,
                               ctypes.c_uint64]
_lib.rfs_ring_wait.restype = ctypes.c_int64
_lib.rfs_ring_wait.argtypes = [ctypes.c_void_p, ctypes.c_size_t,
                               ctypes.POINTER(_Completion), ctypes.c_size_t]
_lib.rfs_ring_in_flight.restype = ctypes.c_uint32
_lib.rfs_ring_in_flight.argtypes = [ctypes.c_void_p]


def _check(n):
    if n < 0:
        raise OSError(-n, os.strerror(-n))
    return n


class Ring:
    """A ring of an rfs mount, with its shared buffer."""

    _ring = None

    def __init__(self, mount, buffer_len=16 << 20, entries=64):
        ring = _lib.rfs_ring_open(os.fsencode(mount), buffer_len, entries)
        if not ring:
            e = ctypes.get_errno()
            raise OSError(e, f"{mount}: {os.strerror(e)}")
        self._ring = ring
        self._lock = threading.Lock()
        self._entries = entries
        self._out = (_Completion * entries)()
        address = _lib.rfs_ring_buffer(ring)
        length = _lib.rfs_ring_buffer_len(ring)
        memory = (ctypes.c_char * length).from_address(address)
        # Every view of the buffer holds `memory`: the ring (and its mapping) goes only once
        # `memory` does, whatever close() was called before.
        weakref.finalize(memory, _lib.rfs_ring_close, ring)
        self.buffer = memoryview(memory).cast("B")

    def close(self):
        """Ends the ring for this object's calls; its memory goes with the last view."""
        with getattr(self, "_lock", threading.Lock()):
            self._ring = None
            self.buffer = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _call(self, fn, *args):
        with self._lock:
            if not self._ring:
                raise ValueError("the ring is closed")
            return fn(self._ring, *args)

    def register(self, file):
        """Registers a file (an object with fileno(), or a descriptor) opened through the
        mount; returns its number."""
        fd = file if isinstance(file, int) else file.fileno()
        return _check(self._call(_lib.rfs_ring_register, fd))

    def unregister(self, file):
        _check(self._call(_lib.rfs_ring_unregister, file))

    def prep_read(self, file, offset, length, buf_off, user_data=0):
        _check(self._call(_lib.rfs_ring_prep, READ, file, offset, length, buf_off, user_data))

    def prep_write(self, file, offset, length, buf_off, user_data=0):
        _check(self._call(_lib.rfs_ring_prep, WRITE, file, offset, length, buf_off, user_data))

    def prep_fsync(self, file, user_data=0):
        _check(self._call(_lib.rfs_ring_prep, FSYNC, file, 0, 0, 0, user_data))

    def wait(self, min_complete=1):
        """Submits what is queued and waits for at least `min_complete` completions (0:
        those there are): [(user_data, bytes or -errno)], at most `entries` at a time."""
        out = self._out
        n = _check(self._call(_lib.rfs_ring_wait, min_complete, out, self._entries))
        return [(out[k].user_data, out[k].result) for k in range(n)]

    def in_flight(self):
        return self._call(_lib.rfs_ring_in_flight)

    def _one(self):
        if self.in_flight():
            raise ValueError("other requests are in flight")

    def pread(self, file, length, offset):
        """One blocking read through the start of the buffer (nothing else in flight): the
        bytes, copied out."""
        self._one()
        self.prep_read(file, offset, length, 0)
        [(_, n)] = self.wait(1)
        _check(n)
        return bytes(self.buffer[:n])

    def pwrite(self, file, data, offset):
        """One blocking write through the start of the buffer (nothing else in flight): the
        bytes written."""
        self._one()
        self.buffer[:len(data)] = data
        self.prep_write(file, offset, len(data), 0)
        [(_, n)] = self.wait(1)
        return _check(n)

    def fsync(self, file):
        self._one()
        self.prep_fsync(file)
        [(_, n)] = self.wait(1)
        _check(n)

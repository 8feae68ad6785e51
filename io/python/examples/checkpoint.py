"""A checkpoint writer's pattern: one large file written in large pieces, several in flight,
then fsync; read back and compared.

    python3 io/python/examples/checkpoint.py MOUNT FILE [--size 256M] [--piece 4M] [--depth 4]
"""

import argparse
import hashlib
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from rfs_io import Ring  # noqa: E402


def size(text):
    units = {"K": 10, "M": 20, "G": 30}
    return int(text[:-1]) << units[text[-1].upper()] if text[-1].isalpha() else int(text)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("mount")
    p.add_argument("file")
    p.add_argument("--size", type=size, default=256 << 20)
    p.add_argument("--piece", type=size, default=4 << 20)
    p.add_argument("--depth", type=int, default=4)
    a = p.parse_args()
    path = os.path.join(a.mount, a.file)
    pieces = a.size // a.piece
    state = hashlib.sha256()
    with Ring(a.mount, buffer_len=a.piece * a.depth, entries=a.depth) as ring, \
            open(path, "wb+") as f:
        fid = ring.register(f)
        start, written, next_piece = time.monotonic(), 0, 0
        # A slot of the buffer is filled again only once its write completed.
        free, slot_of = list(range(a.depth)), {}
        while written < pieces:
            while next_piece < pieces and free:
                slot = free.pop()
                block = hashlib.sha256(next_piece.to_bytes(8, "little")).digest()
                data = block * (a.piece // len(block))
                ring.buffer[slot * a.piece:(slot + 1) * a.piece] = data
                ring.prep_write(fid, next_piece * a.piece, a.piece, slot * a.piece, next_piece)
                slot_of[next_piece] = slot
                next_piece += 1
            for piece, n in ring.wait(1):
                if n != a.piece:
                    sys.exit(f"piece {piece}: {n}")
                free.append(slot_of.pop(piece))
                written += 1
        ring.fsync(fid)
        took = time.monotonic() - start
        ring.unregister(fid)
    for k in range(pieces):
        state.update(hashlib.sha256(k.to_bytes(8, "little")).digest() * (a.piece // 32))
    with open(path, "rb") as f:
        back = hashlib.sha256()
        while chunk := f.read(1 << 20):
            back.update(chunk)
    if back.digest() != state.digest():
        sys.exit("read back through the mount: not what was written")
    print(f"{a.size >> 20} MiB in {a.piece >> 20} MiB pieces, depth {a.depth}: "
          f"{a.size / took / 1e6:.0f} MB/s, then fsync; read back through the mount: same")


if __name__ == "__main__":
    main()

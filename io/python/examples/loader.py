"""A data loader's pattern: random samples of fixed size read from many files at once into
one shared buffer, as views without copies (numpy arrays if numpy is there).

    python3 io/python/examples/loader.py MOUNT DIR [--sample 65536] [--batch 64] [--batches 100]

DIR (inside MOUNT) holds the sample files; each batch reads `batch` random samples, all in
flight together, and checks nothing: it prints samples/s and MB/s.
"""

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from rfs_io import Ring  # noqa: E402

try:
    import numpy
except ImportError:
    numpy = None


def main():
    p = argparse.ArgumentParser()
    p.add_argument("mount")
    p.add_argument("dir")
    p.add_argument("--sample", type=int, default=64 << 10)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--batches", type=int, default=100)
    a = p.parse_args()
    root = os.path.join(a.mount, a.dir)
    paths = sorted(os.path.join(root, n) for n in os.listdir(root))
    entries = 1 << (a.batch - 1).bit_length()
    with Ring(a.mount, buffer_len=a.sample * entries, entries=entries) as ring:
        files = []
        for path in paths:
            with open(path, "rb") as f:
                files.append((ring.register(f), os.fstat(f.fileno()).st_size))
        samples = [(fid, off) for fid, size in files
                   for off in range(0, size - a.sample + 1, a.sample)]
        if not samples:
            sys.exit(f"no file in {root} holds a {a.sample}-byte sample")
        start, total = time.monotonic(), 0
        for _ in range(a.batches):
            batch = random.sample(samples, min(a.batch, len(samples)))
            for slot, (fid, off) in enumerate(batch):
                ring.prep_read(fid, off, a.sample, slot * a.sample, slot)
            views = {}
            for slot, n in ring.wait(len(batch)):
                if n != a.sample:
                    sys.exit(f"sample {slot}: {n}")
                at = slot * a.sample
                views[slot] = (numpy.frombuffer(ring.buffer, numpy.uint8, n, at)
                               if numpy else ring.buffer[at:at + n])
            total += len(views)
        took = time.monotonic() - start
        print(f"{total} samples of {a.sample} bytes: {total / took:.0f} samples/s, "
              f"{total * a.sample / took / 1e6:.1f} MB/s")


if __name__ == "__main__":
    main()

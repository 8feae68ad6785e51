#!/usr/bin/python3
"""Fragmentation: files of 4 KiB fill a pool, every other one is removed, then one large file
is written 1 MiB at a time until ENOSPC (or --cap). Prints what the large file got, how long
it took, what compaction did (the node's metrics), and whether every kept file reads back.

    sudo python3 iozone/fragmentation.py [--files 100000] [--memory 512M] [--bin DIR]

Needs the release binaries (cargo build --release) and fuse3; runs as root (mounts)."""

import argparse
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

BIN = Path(__file__).resolve().parent.parent / "target" / "release"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--files", type=int, default=100_000)
    p.add_argument("--memory", default="512M", help="the node's pool")
    p.add_argument("--cap", type=int, default=4096, help="MiB the large file stops at")
    p.add_argument("--port", type=int, default=17610)
    p.add_argument("--bin", type=Path, default=BIN, help="where mem-server and fs-client are")
    a = p.parse_args()
    metrics = f"127.0.0.1:{a.port + 1}"
    with tempfile.TemporaryDirectory() as d:
        mnt = Path(d) / "mnt"
        mnt.mkdir()
        node = subprocess.Popen([str(a.bin / "mem-server"), "--listen", f"127.0.0.1:{a.port}",
                                 "--memory", a.memory, "--transport", "tcp", "--metrics", metrics],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            time.sleep(1.5)
            client = subprocess.Popen([str(a.bin / "fs-client"), f"127.0.0.1:{a.port}", str(mnt),
                                       "-o", "transport=tcp"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                for _ in range(100):
                    if os.path.ismount(mnt):
                        break
                    time.sleep(0.1)
                else:
                    sys.exit("the mount did not appear")
                run(mnt, a, metrics)
            finally:
                subprocess.run(["fusermount3", "-u", str(mnt)], check=False)
                client.wait(timeout=20)
        finally:
            node.terminate()
            node.wait(timeout=20)


def run(mnt, a, metrics):
    small = os.urandom(4096)
    start = time.monotonic()
    for i in range(a.files):
        (mnt / f"f{i}").write_bytes(small)
    print(f"{a.files} files of 4 KiB in {time.monotonic() - start:.1f} s", flush=True)
    for i in range(0, a.files, 2):
        (mnt / f"f{i}").unlink()
    time.sleep(12)  # what was freed comes back after the node's lease (10 s), zeroed
    st = os.statvfs(mnt)
    print(f"every other removed: df free {st.f_bfree * st.f_frsize / 2**20:.0f} MiB", flush=True)
    block = os.urandom(1 << 20)
    got, err = 0, "no error"
    start = time.monotonic()
    try:
        with open(mnt / "large", "wb") as f:
            while got < a.cap << 20:
                f.write(block)
                got += len(block)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        err = e.strerror
    print(f"large file: {got >> 20} MiB in {time.monotonic() - start:.1f} s ({err})", flush=True)
    text = urllib.request.urlopen(f"http://{metrics}/metrics").read().decode()
    for line in text.splitlines():
        if "compaction" in line and not line.startswith("#"):
            print(line)
    wrong = sum((mnt / f"f{i}").read_bytes() != small for i in range(1, a.files, 2))
    print(f"kept files that read back wrong: {wrong}")


if __name__ == "__main__":
    main()

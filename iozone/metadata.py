#!/usr/bin/python3
"""Metadata and small-file rates of two builds side by side: N files of 4 KiB through one rfs
mount over tcp, made, stated, read cold by their owner and by another user, chmodded and
unlinked, with build A's and build B's node and mount run in turn, so that both meet the same
machine. Prints each round, then the medians and B / A.

    sudo python3 iozone/metadata.py --a DIR --b DIR [--files 2000] [--rounds 3]

DIR holds mem-server and fs-client (a release build's target/release). The other user is uid
and gid 2000: a read by someone other than the owner is where the kernel asks for the file's
POSIX ACL. Runs as root (drops caches, switches users); needs fuse3."""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

OTHER = 2000
SIZE = 4096


def is_mounted(path):
    return any(line.split()[1] == str(path) for line in Path("/proc/mounts").read_text().splitlines())


def drop_caches():
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def timed(work):
    start = time.monotonic()
    work()
    return time.monotonic() - start


def read_all(paths):
    for p in paths:
        with open(p, "rb") as f:
            f.read()


def read_as_other(paths):
    """Reads every file in a child running as OTHER (the mount lets others in: allow_other)."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setgid(OTHER)
            os.setuid(OTHER)
            read_all(paths)
            os._exit(0)
        except BaseException as e:  # the child must not return into the parent's loop
            print(f"read as uid {OTHER}: {e}", file=sys.stderr)
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    if status != 0:
        sys.exit("the reads as another user failed")


def phases(d, n):
    paths = [d / f"f{i}" for i in range(n)]
    data = b"x" * SIZE

    def create():
        for p in paths:
            with open(p, "wb") as f:
                f.write(data)
            os.chmod(p, 0o644)

    rates = {"creates/s": n / timed(create)}
    rates["stats/s"] = n / timed(lambda: [os.stat(p) for p in paths])
    drop_caches()
    rates["owner's cold reads/s"] = n / timed(lambda: read_all(paths))
    drop_caches()
    rates["other's cold reads/s"] = n / timed(lambda: read_as_other(paths))
    rates["chmods/s"] = n / timed(lambda: [os.chmod(p, 0o640) for p in paths])
    rates["unlinks/s"] = n / timed(lambda: [os.unlink(p) for p in paths])
    return rates


def one(bin_dir, n, port):
    node = subprocess.Popen([str(bin_dir / "mem-server"), "--listen", f"127.0.0.1:{port}",
                             "--memory", "512M", "--transport", "tcp"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            os.chmod(tmp, 0o755)  # the other user passes through it
            mnt = Path(tmp) / "mnt"
            mnt.mkdir()
            time.sleep(1.5)
            client = subprocess.Popen([str(bin_dir / "fs-client"), f"127.0.0.1:{port}", str(mnt),
                                       "-o", "transport=tcp,allow_other"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                for _ in range(100):
                    if is_mounted(mnt):
                        break
                    time.sleep(0.1)
                else:
                    sys.exit(f"the mount of {bin_dir} did not appear")
                d = mnt / "files"
                d.mkdir()
                os.chmod(d, 0o755)
                return phases(d, n)
            finally:
                subprocess.run(["fusermount3", "-u", str(mnt)], check=False)
                client.wait(timeout=20)
    finally:
        node.terminate()
        node.wait(timeout=20)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--a", type=Path, required=True, help="build A's mem-server and fs-client")
    p.add_argument("--b", type=Path, required=True, help="build B's mem-server and fs-client")
    p.add_argument("--files", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--port", type=int, default=17590)
    a = p.parse_args()
    if os.geteuid() != 0:
        sys.exit("run as root: it drops caches and reads as another user")
    runs = {"A": [], "B": []}
    for i in range(a.rounds):
        for name, bin_dir in (("A", a.a), ("B", a.b)):
            got = one(bin_dir, a.files, a.port)
            runs[name].append(got)
            print(f"round {i + 1} {name}: " + ", ".join(f"{k} {v:,.0f}" for k, v in got.items()),
                  flush=True)
    print(f"\n| {a.files} files of 4 KiB, {a.rounds} rounds, median | A | B | B / A |")
    print("|---|---|---|---|")
    for k in runs["A"][0]:
        med = {name: statistics.median(r[k] for r in rs) for name, rs in runs.items()}
        print(f"| {k} | {med['A']:,.0f} | {med['B']:,.0f} | {med['B'] / med['A']:.2f} |")


if __name__ == "__main__":
    main()

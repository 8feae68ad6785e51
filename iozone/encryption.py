#!/usr/bin/python3
"""Encryption on against off, side by side: sequential write and read of one file through an rfs
mount over tcp, with the node and the mount run plain and then with --encrypt / -o encrypt,
alternating, so that both meet the same machine. Prints MB/s, the CPU seconds node and mount
spent per GiB, and the ratios.

    sudo python3 iozone/encryption.py [--size 1G] [--rounds 3] [--pin] [--bin DIR]

--pin puts the node on CPU 0 and the mount and dd on CPU 1, as if each side had a host (of one
core) to itself; without it all three share every core.

--bin takes mem-server and fs-client from DIR (default target/release), to compare builds.

Needs the release binaries (cargo build --release) and fuse3; runs as root (drops caches)."""

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BIN = Path(__file__).resolve().parent.parent / "target" / "release"


def cpu_secs(pid):
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def is_mounted(path):
    return any(line.split()[1] == str(path) for line in Path("/proc/mounts").read_text().splitlines())


def dd(args, pin):
    start = time.monotonic()
    subprocess.run([*pin, "dd", *args, "status=none"], check=True)
    return time.monotonic() - start


def one(size_mib, encrypt, port, pinned):
    node_pin, mount_pin = (["taskset", "-c", "0"], ["taskset", "-c", "1"]) if pinned else ([], [])
    node_args = [*node_pin, str(BIN / "mem-server"), "--listen", f"127.0.0.1:{port}", "--memory",
                 f"{size_mib + 256}M", "--transport", "tcp"]
    mount_opts = "transport=tcp" + (",encrypt" if encrypt else "")
    if encrypt:
        node_args.append("--encrypt")
    with tempfile.TemporaryDirectory() as d:
        mnt = Path(d) / "mnt"
        mnt.mkdir()
        node = subprocess.Popen(node_args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            time.sleep(1.5)
            client = subprocess.Popen([*mount_pin, str(BIN / "fs-client"), f"127.0.0.1:{port}", str(mnt),
                                       "-o", mount_opts],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                for _ in range(100):
                    if is_mounted(mnt):
                        break
                    time.sleep(0.1)
                else:
                    sys.exit("the mount did not appear")
                cpu0 = cpu_secs(node.pid) + cpu_secs(client.pid)
                w = dd(["if=/dev/zero", f"of={mnt}/f", "bs=1M", f"count={size_mib}", "conv=fsync"],
                       mount_pin)
                cpu1 = cpu_secs(node.pid) + cpu_secs(client.pid)
                Path("/proc/sys/vm/drop_caches").write_text("3\n")
                r = dd([f"if={mnt}/f", "of=/dev/null", "bs=1M"], mount_pin)
                cpu2 = cpu_secs(node.pid) + cpu_secs(client.pid)
            finally:
                subprocess.run(["fusermount3", "-u", str(mnt)], check=False)
                client.wait(timeout=20)
        finally:
            node.terminate()
            node.wait(timeout=20)
    gib = size_mib / 1024
    return {"write MB/s": size_mib * 1.048576 / w, "read MB/s": size_mib * 1.048576 / r,
            "write cpu s/GiB": (cpu1 - cpu0) / gib, "read cpu s/GiB": (cpu2 - cpu1) / gib}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="1G", help="file size (M or G)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--port", type=int, default=17490)
    p.add_argument("--pin", action="store_true", help="node on CPU 0, mount and dd on CPU 1")
    p.add_argument("--bin", type=Path, help="where mem-server and fs-client are")
    a = p.parse_args()
    global BIN
    BIN = a.bin or BIN
    size_mib = int(a.size[:-1]) * (1024 if a.size.endswith("G") else 1)
    runs = {False: [], True: []}
    for i in range(a.rounds):
        for encrypt in (False, True):
            got = one(size_mib, encrypt, a.port, a.pin)
            runs[encrypt].append(got)
            print(f"round {i + 1} {'encrypted' if encrypt else 'plain    '}: "
                  + ", ".join(f"{k} {v:.1f}" for k, v in got.items()), flush=True)
    where = ", pinned" if a.pin else ""
    print(f"\n| {a.size}, {a.rounds} rounds{where}, median | plain | encrypted | encrypted / plain |")
    print("|---|---|---|---|")
    for k in runs[False][0]:
        plain = sorted(r[k] for r in runs[False])[a.rounds // 2]
        enc = sorted(r[k] for r in runs[True])[a.rounds // 2]
        print(f"| {k} | {plain:.1f} | {enc:.1f} | {enc / plain:.2f} |")


if __name__ == "__main__":
    main()

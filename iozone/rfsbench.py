#!/usr/bin/python3
"""IOzone and fio against an rfs mount and baselines, side by side, with the RDMABox ablation.

Run through iozone/run.sh, which installs what is missing and builds the binaries. Writes
results/<time>/: results.csv (every number), results.md (tables with ratios), plots/*.png and
environment.txt (machine, versions, settings).
"""

import argparse
import ctypes
import csv
import json
import mmap
import os
import platform
import re
import shutil
import socket
import statistics
import urllib.request
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = ROOT / "target" / "release"

ALL_OFF = {"merge": "off", "chain": "off", "dyn_threshold": "never", "qps": "1",
           "window": "off", "polling": "event"}
ALL_ON = {"merge": "on", "chain": "on", "dyn_threshold": "928K", "qps": "4",
          "window": "7M", "polling": "adaptive"}
# The paper's ablation: its "Verb" baseline (everything off), each mechanism alone, all on.
ABLATION = [("all off (Verb)", ALL_OFF)] + [
    (f"+{label}", {**ALL_OFF, key: ALL_ON[key]})
    for label, key in [("merging", "merge"), ("chaining", "chain"), ("dynMR", "dyn_threshold"),
                       ("4 QPs", "qps"), ("window", "window"), ("adaptive polling", "polling")]
] + [("all on", ALL_ON)]
BASELINES = ("tmpfs", "bindfs on tmpfs", "GlusterFS")
# fs-client's own max_write, and the name of the configuration measured with it.
DEFAULT_MAX_WRITE = "1M"
DEFAULT_MOUNT = "default mount (max_write 1M)"


def times_better(metric, x, y):
    """How many times better x is than y, as a table cell: lower is better for latency (us) and
    CPU per operation."""
    if not x or not y:
        return "n/a"
    lower = metric.endswith(" us") or metric.startswith("cpu") or metric.endswith("per file")
    return f"{(y / x if lower else x / y):.2f}x"


def log(msg):
    print(f"[rfsbench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Progress:
    """Says which step of how many runs, the time spent and an estimate of the time left
    (from the time per unit of work so far: a full measurement weighs FULL, an ablation one 1)."""

    FULL = 4

    def __init__(self, weights):
        self.weights = weights
        self.done = 0
        self.start = time.monotonic()

    def step(self, what):
        elapsed = time.monotonic() - self.start
        done_weight = sum(self.weights[:self.done])
        left = ""
        if done_weight:
            rest = sum(self.weights[self.done:]) * elapsed / done_weight
            left = f", about {self.clock(rest)} left"
        self.done += 1
        log(f"step {self.done} of {len(self.weights)}: {what} ({self.clock(elapsed)} elapsed{left})")

    @staticmethod
    def clock(secs):
        return f"{int(secs) // 60}:{int(secs) % 60:02}"


def run(cmd, **kw):
    return subprocess.run(cmd, check=True, capture_output=True, text=True, **kw)


def cpu_busy():
    """Seconds of CPU time the whole machine has spent busy (not idle or waiting), from /proc."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle, iowait = fields[3], fields[4]
    return (sum(fields[:8]) - idle - iowait) / os.sysconf("SC_CLK_TCK")


def drop_caches(size):
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")
    warm_free_memory(size)


def free_page_reporting():
    """Whether a virtio balloon reports the guest's free pages to the host (feature bit 5): the
    host then takes them back, and the guest's next touch of each page faults in the host."""
    for dev in Path("/sys/bus/virtio/devices").glob("*"):
        try:
            if (dev / "device").read_text().strip() == "0x0005":
                return (dev / "features").read_text()[5] == "1"
        except (OSError, IndexError):
            continue
    return False


def warm_free_memory(size):
    """Touches `size` bytes of memory and frees them again, so that the pages the next phase
    allocates (page cache) are backed by the host. Under free page reporting, memory left free
    for a few seconds (as after dropping caches) is handed back to the host, and a write into
    fresh page cache ran at 0.4-0.8x its speed on such pages: a measurement then depended on
    how long the memory had sat free. Every target gets the same; on bare metal this costs a
    memset."""
    if not free_page_reporting():
        return
    with mmap.mmap(-1, size) as m:
        ctypes.memset(ctypes.addressof(ctypes.c_char.from_buffer(m)), 1, size)


def parse_size(s):
    m = re.fullmatch(r"(\d+)([KMG]?)", s.upper())
    if not m:
        raise argparse.ArgumentTypeError(f"bad size {s!r}")
    return int(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[m.group(2)]


def is_mounted(path):
    return any(line.split()[1] == str(path) for line in Path("/proc/mounts").read_text().splitlines())


class Target:
    """A directory to measure: an rfs mount, tmpfs, or bindfs over tmpfs."""

    def __init__(self, name, path, stats=None, stop=None):
        self.name, self.path, self.stats, self._stop = name, Path(path), stats, stop

    def counters(self):
        if not self.stats:
            return {}
        out = {}
        for line in Path(self.stats).read_text().splitlines():
            k, _, v = line.partition(" ")
            if v.isdigit():
                out[k] = int(v)
        return out

    def stop(self):
        if self._stop:
            self._stop()


class Bench:
    def __init__(self, args):
        self.args = args
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.out = Path(args.results) / (stamp + ("-quick" if args.quick else ""))
        (self.out / "plots").mkdir(parents=True, exist_ok=True)
        self.work = Path(args.workdir)
        # What a phase's page cache can take: its file, and some.
        self.warm_size = args.size + (256 << 20)
        self.work.mkdir(parents=True, exist_ok=True)
        self.rows = []  # target, config, test, metric, value, unit, round
        self.round = 1
        self.server = None
        self.data_nodes = []

    # --- targets -------------------------------------------------------------------------
    def start_server(self):
        mem = max(2 * self.args.size + (512 << 20), 1 << 30)
        log(f"starting mem-server with {mem >> 20} MiB")
        self.data_nodes = []
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.metrics = f"127.0.0.1:{probe.getsockname()[1]}"
        self.server = subprocess.Popen(
            [BIN / "mem-server", "--listen", "127.0.0.1:0", "--memory", str(mem),
             "--transport", self.args.transport, "--replicas", str(self.args.replicas),
             "--metrics", self.metrics],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        banner = self.server.stdout.readline()
        self.addr = banner.split()[3]
        # Each copy of a chunk on a node of its own: one data node per copy beyond the first.
        for _ in range(self.args.replicas - 1):
            node = subprocess.Popen(
                [BIN / "mem-server", "--listen", "127.0.0.1:0", "--memory", str(mem),
                 "--transport", self.args.transport, "--join", self.addr],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            node.stdout.readline()
            self.data_nodes.append(node)
        if self.args.replicas > 1:
            log(f"{self.args.replicas} copies of every chunk, on {self.args.replicas} nodes")

    def mount_rfs(self, label, opts):
        path = self.work / f"rfs-{len(self.rows)}-{int(time.time() * 1000) % 100000}"
        path.mkdir()
        o = {"transport": self.args.transport, "max_write": self.args.max_write, **opts}
        ostr = ",".join(f"{k}={v}" for k, v in o.items())
        proc = subprocess.Popen([BIN / "fs-client", self.addr, str(path), "-o", ostr],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 20
        while not is_mounted(path):
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"fs-client did not mount {path}")
            time.sleep(0.05)

        def stop():
            subprocess.run(["fusermount3", "-u", str(path)], check=False)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
            path.rmdir()
        return Target(label, path, stats=path / ".rfs-stats", stop=stop)

    def mount_tmpfs(self, name):
        """A tmpfs under the work directory, large enough for the run's files."""
        path = self.work / name
        path.mkdir(exist_ok=True)
        size = 2 * self.args.size + (256 << 20)
        run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)])
        return path

    def tmpfs(self):
        path = self.mount_tmpfs("tmpfs")
        return Target("tmpfs", path, stop=lambda: run(["umount", str(path)]))

    def glusterfs(self):
        """GlusterFS, the paper's baseline: one brick on tmpfs, mounted over loopback."""
        path = self.work / "glusterfs"
        path.mkdir(exist_ok=True)
        brick = self.mount_tmpfs("gluster-brick")
        glusterd = None
        if subprocess.run(["pgrep", "-x", "glusterd"], capture_output=True).returncode != 0:
            glusterd = subprocess.Popen(["glusterd", "--no-daemon"], stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL)
        volume, host = f"rfsbench{os.getpid()}", platform.node()
        gluster = ["gluster", "--mode=script"]

        def stop():
            subprocess.run(["umount", str(path)], check=False)
            subprocess.run(gluster + ["volume", "stop", volume, "force"], capture_output=True)
            subprocess.run(gluster + ["volume", "delete", volume], capture_output=True)
            if glusterd:
                glusterd.terminate()
                glusterd.wait()
            subprocess.run(["umount", str(brick)], check=False)
        try:
            deadline = time.time() + 30
            while subprocess.run(gluster + ["volume", "list"], capture_output=True).returncode != 0:
                if time.time() > deadline:
                    raise RuntimeError("glusterd did not answer within 30 s")
                time.sleep(0.3)
            run(gluster + ["volume", "create", volume, f"{host}:{brick}/b", "force"])
            run(gluster + ["volume", "start", volume])
            run(["mount", "-t", "glusterfs", f"{host}:/{volume}", str(path)])
        except Exception:
            stop()
            raise
        return Target("GlusterFS", path, stop=stop)

    def bindfs(self):
        path = self.work / "bindfs"
        path.mkdir(exist_ok=True)
        src = self.mount_tmpfs("bindfs-src")
        run(["bindfs", str(src), str(path)])

        def stop():
            run(["fusermount3", "-u", str(path)])
            run(["umount", str(src)])
        return Target("bindfs on tmpfs", path, stop=stop)

    # --- measurements --------------------------------------------------------------------
    def record(self, target, config, test, metric, value, unit):
        self.rows.append((target.name, config, test, metric, value, unit, self.round))

    def counted(self, target, config, test, fn):
        """Runs fn and records rdmabox work requests and doorbells per MB it moved."""
        before = target.counters()
        fn()
        after = target.counters()
        if before and after:
            moved = (after["bytes_read"] + after["bytes_written"]
                     - before["bytes_read"] - before["bytes_written"]) / 1e6
            if moved > 0:
                for k in ("work_requests", "doorbells"):
                    self.record(target, config, test, f"{k}/MB", (after[k] - before[k]) / moved, "")

    def iozone(self, target, config):
        f = target.path / "iozone.tmp"
        size_k = self.args.size >> 10
        for rec in self.args.records:
            phases = [("0", ["write", "rewrite"]), ("1", ["read", "reread"]),
                      ("2", ["random read", "random write"])]
            for test, names in phases:
                drop_caches(self.warm_size)  # cold reads: nothing of the write phase left in the page cache

                def go():
                    out = run(["iozone", "-i", test, "-r", f"{rec}k", "-s", f"{size_k}k", "-e",
                               "-w", "-f", str(f)], cwd=target.path).stdout
                    values = None
                    for line in out.splitlines():
                        nums = line.split()
                        if len(nums) >= 2 + len(names) and all(n.isdigit() for n in nums[:2 + len(names)]) \
                                and int(nums[0]) == size_k:
                            values = [int(n) for n in nums[2:2 + len(names)]]
                    if values is None:
                        raise RuntimeError(f"no iozone figures in:\n{out}")
                    for n, v in zip(names, values):
                        self.record(target, config, f"iozone {rec}K", n, v / 1024, "MB/s")
                self.counted(target, config, f"iozone {rec}K {names[0]}", go)
            f.unlink(missing_ok=True)

    def fio(self, target, config, name, extra, direct=False, jobs=1):
        # Several jobs share the file size between them: the footprint stays `--size`.
        size = f"{(self.args.size // jobs) >> 20}M"
        cmd = ["fio", f"--name={name}", f"--directory={target.path}", f"--size={size}",
               "--output-format=json", "--group_reporting", "--filename_format=fio.$jobnum"] + extra
        if direct:
            cmd.append("--direct=1")
        busy_before = cpu_busy()
        res = subprocess.run(cmd, capture_output=True, text=True)
        busy = cpu_busy() - busy_before
        if res.returncode != 0:
            if direct and target.stats is None:
                log(f"{target.name}: {name} unsupported here ({res.stderr.strip()[:80]}); skipped")
                return
            raise RuntimeError(f"fio {name} on {target.name} failed: {res.stderr}")
        job = json.loads(res.stdout[res.stdout.index("{"):])["jobs"][0]
        for op in ("read", "write"):
            d = job[op]
            if d["io_bytes"] == 0:
                continue
            self.record(target, config, f"fio {name}", f"{op} MB/s", d["bw_bytes"] / 1e6, "MB/s")
            self.record(target, config, f"fio {name}", f"{op} IOPS", d["iops"], "IOPS")
            if d["total_ios"] > 0 and "--time_based" in extra:
                # The whole machine: client, servers, fio and the kernel's share of each.
                self.record(target, config, f"fio {name}", f"cpu us/{op}", busy * 1e6 / d["total_ios"], "us")
            pct = d["clat_ns"].get("percentile", {})
            for p, key in (("p50", "50.000000"), ("p99", "99.000000")):
                if key in pct:
                    self.record(target, config, f"fio {name}", f"{op} {p} us", pct[key] / 1000, "us")

    def fio_suite(self, target, config):
        t = str(self.args.runtime)
        timed = ["--time_based", f"--runtime={t}"]
        warm_free_memory(self.warm_size)
        self.counted(target, config, "fio seq write 128K", lambda: self.fio(
            target, config, "seq write 128K", ["--rw=write", "--bs=128k", "--end_fsync=1"]))
        drop_caches(self.warm_size)
        self.counted(target, config, "fio seq read 128K", lambda: self.fio(
            target, config, "seq read 128K", ["--rw=read", "--bs=128k"]))
        self.fio(target, config, "rand read 4K qd1 direct",
                 ["--rw=randread", "--bs=4k", "--iodepth=1"] + timed, direct=True)
        self.fio(target, config, "rand write 4K qd1 direct",
                 ["--rw=randwrite", "--bs=4k", "--iodepth=1"] + timed, direct=True)
        self.fio(target, config, "rand read 4K 4 jobs direct",
                 ["--rw=randread", "--bs=4k", "--numjobs=4"] + timed, direct=True, jobs=4)
        for f in target.path.glob("fio.*"):
            f.unlink()

    def ring_suite(self, target, config):
        """The ring beside an rfs mount (rfs-io, through rfs-ring-bench), and the same
        patterns through a baseline's mount: 4K random reads with 4 jobs (the ring with 16
        in flight each; the others O_DIRECT, one each), 1 MiB sequential reads (the ring
        with 4 in flight; the others through their page cache)."""
        size = max(min(self.args.size, 256 << 20), 1 << 20)
        ring = target.stats is not None
        if ring and not (target.path / ".rfs-ring").is_symlink():
            log(f"{target.name}: no ring served (-o ring=off?); the ring's rows skipped")
            return
        data = target.path / "ring.f"
        with open(data, "wb") as f:
            piece = os.urandom(1 << 20)
            for _ in range(size >> 20):
                f.write(piece)
        runs = [("ring 4K rand read 4 jobs",
                 ["--via", "ring", "--depth", "16"] if ring else ["--via", "mount", "--direct", "on"],
                 ["--bs", "4K", "--jobs", "4"]),
                ("ring 1M seq read",
                 ["--via", "ring", "--depth", "4"] if ring else ["--via", "mount"],
                 ["--bs", "1M", "--pattern", "seq"])]
        for test, via, shape in runs:
            drop_caches(self.warm_size)
            cmd = [BIN / "rfs-ring-bench", str(target.path), "ring.f", *via, *shape,
                   "--seconds", str(self.args.runtime)]
            res = subprocess.run(cmd, capture_output=True, text=True)
            m = re.search(r": ([\d.]+) MB/s, ([\d.]+) ops/s, ([\d.]+) us CPU/op", res.stdout)
            if res.returncode != 0 or not m:
                if not ring:
                    log(f"{target.name}: {test} unsupported here ({res.stderr.strip()[:80]}); skipped")
                    continue
                raise RuntimeError(f"{test} on {target.name} failed: {res.stderr}")
            mb, ops, cpu = (float(x) for x in m.groups())
            self.record(target, config, test, "read MB/s", mb, "MB/s")
            self.record(target, config, test, "read IOPS", ops, "IOPS")
            self.record(target, config, test, "cpu us/read", cpu, "us")
        data.unlink()

    def metadata(self, target, config):
        d = target.path / "meta.tmp"
        d.mkdir()
        n = self.args.files
        names = [d / f"f{i:06}" for i in range(n)]
        for phase, fn in (("creates/s", lambda p: os.close(os.open(p, os.O_CREAT | os.O_WRONLY, 0o644))),
                          ("stats/s", os.stat), ("unlinks/s", os.unlink)):
            t = time.perf_counter()
            for p in names:
                fn(p)
            self.record(target, config, f"metadata {n} files", phase, n / (time.perf_counter() - t), "ops/s")
        d.rmdir()

    def small_files(self, target, config):
        """A data set of small files: writing them (create, write, close), the space they take,
        and reading them back cold with 4 jobs (open, read, close), a data loader's pattern."""
        n = self.args.small_files
        d = target.path / "small.tmp"

        def used():
            st = os.statvfs(target.path)
            return (st.f_blocks - st.f_bfree) * st.f_frsize

        for size in (4096, 65536):
            d.mkdir()
            data = os.urandom(size)
            names = [d / f"s{i:06}" for i in range(n)]
            before = used()
            t = time.perf_counter()
            for p in names:
                with open(p, "wb") as f:
                    f.write(data)
            test = f"small files {n} x {size >> 10}K"
            self.record(target, config, test, "writes/s", n / (time.perf_counter() - t), "ops/s")
            # Closes go back to the node off their path: give them a moment to count.
            time.sleep(0.5)
            self.record(target, config, test, "bytes per file", (used() - before) / n, "B")
            drop_caches(self.warm_size)
            jobs = 4
            t = time.perf_counter()
            pids = []
            for j in range(jobs):
                pid = os.fork()
                if pid == 0:
                    code = 0
                    try:
                        for p in names[j::jobs]:
                            with open(p, "rb") as f:
                                if len(f.read()) != size:
                                    code = 1
                    finally:
                        os._exit(code)
                pids.append(pid)
            failed = [pid for pid in pids if os.waitpid(pid, 0)[1] != 0]
            if failed:
                raise RuntimeError(f"{target.name}: small files read back short")
            self.record(target, config, test, f"reads/s {jobs} jobs", n / (time.perf_counter() - t), "ops/s")
            for p in names:
                p.unlink()
            d.rmdir()

    def node_metric(self, name):
        """A metric of the metadata node this run started (None without one)."""
        if not getattr(self, "metrics", None):
            return None
        try:
            text = urllib.request.urlopen(f"http://{self.metrics}/metrics", timeout=5).read().decode()
        except OSError as e:
            log(f"the metadata node's metrics: {e}")
            return None
        for line in text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        return None

    def zeroing(self, target, config, fn):
        """Runs fn, then records what the metadata node zeroed per byte the mount moved to
        data nodes (every copy's; freed space is zeroed before reuse, and issue 39 asks that
        this cost less than the writes), once the zeroing it started is done (30 s at most:
        space still held by clients counts as zeroing too)."""
        zeroed, written = self.node_metric("rfs_node_zeroed_bytes_total"), target.counters()
        fn()
        if zeroed is None or not written:
            return
        deadline = time.time() + 30
        while (self.node_metric("rfs_node_zeroing_bytes") or 0) > 0 and time.time() < deadline:
            time.sleep(0.1)
        moved = target.counters()["bytes_written"] - written["bytes_written"]
        after = self.node_metric("rfs_node_zeroed_bytes_total")
        if moved > 0 and after is not None:
            self.record(target, config, "zeroing", "zeroed bytes per byte written to data nodes",
                         (after - zeroed) / moved, "")

    def measure(self, target, config, full=True):
        self.progress.step(f"measuring {target.name} ({config})")
        if full and target.stats is not None and not self.args.mount:
            return self.zeroing(target, config, lambda: self.measure_all(target, config, full))
        self.measure_all(target, config, full)

    def measure_all(self, target, config, full):
        if full:
            self.iozone(target, config)
        self.fio_suite(target, config)
        if full:
            self.ring_suite(target, config)
            self.metadata(target, config)
            self.small_files(target, config)

    # --- the run ---------------------------------------------------------------------------
    def plan(self):
        """The weight of each measurement step, in the order go() takes them."""
        a = self.args
        steps = [Progress.FULL]
        if not a.mount and a.max_write != DEFAULT_MAX_WRITE:
            steps += [Progress.FULL]
        if not a.mount and not a.skip_ablation:
            steps += [1] * (len(ABLATION) if not a.quick else 2)
        if not a.skip_baselines:
            steps += [Progress.FULL] * len(BASELINES)
        return steps

    def go(self):
        a = self.args
        self.progress = Progress(self.plan() * a.rounds)
        self.write_env()
        # Rounds take every target in turn, so that a slow spell of the machine's falls on
        # all of them rather than on one.
        for self.round in range(1, a.rounds + 1):
            if a.rounds > 1:
                log(f"round {self.round} of {a.rounds}")
            self.one_round()
        log(f"all {len(self.progress.weights)} steps done in "
            f"{Progress.clock(time.monotonic() - self.progress.start)}")
        self.write_outputs()
        return self.check()

    def one_round(self):
        a = self.args
        if a.mount:
            self.measure(Target("rfs", a.mount, stats=Path(a.mount) / ".rfs-stats"), "given mount")
        else:
            self.start_server()
            try:
                t = self.mount_rfs("rfs", {})
                try:
                    self.measure(t, "default")
                finally:
                    t.stop()
                if a.max_write != DEFAULT_MAX_WRITE:
                    # What a mount without options gets, beside the paper's setting.
                    t = self.mount_rfs("rfs", {"max_write": DEFAULT_MAX_WRITE})
                    try:
                        self.measure(t, DEFAULT_MOUNT)
                    finally:
                        t.stop()
                if not a.skip_ablation:
                    plan = ABLATION if not a.quick else [ABLATION[0], ABLATION[-1]]
                    for label, opts in plan:
                        t = self.mount_rfs("rfs ablation", opts)
                        try:
                            self.measure(t, label, full=False)
                        finally:
                            t.stop()
            finally:
                for p in [self.server, *self.data_nodes]:
                    p.kill()
                    p.wait()
        if not a.skip_baselines:
            for make in (self.tmpfs, self.bindfs, self.glusterfs):
                t = make()
                try:
                    self.measure(t, "baseline")
                finally:
                    t.stop()

    def write_env(self):
        def version(cmd):
            try:
                return run(cmd).stdout.strip().splitlines()[0]
            except Exception as e:  # noqa: BLE001 - recorded, not fatal
                return f"unavailable ({e})"
        lines = [
            f"date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}",
            f"host: {platform.node()} kernel {platform.release()} cores {os.cpu_count()}",
            f"cpu: {next((l.split(':', 1)[1].strip() for l in open('/proc/cpuinfo') if l.startswith('model name')), '?')}",
            f"memory: {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') >> 20} MiB",
            f"rfs commit: {version(['git', '-C', str(ROOT), 'rev-parse', '--short', 'HEAD'])}",
            f"iozone: {version(['sh', '-c', 'iozone -v | grep -i version'])}",
            f"fio: {version(['fio', '--version'])}",
            f"bindfs: {version(['bindfs', '--version'])}",
            f"glusterfs: {version(['glusterfs', '--version'])}",
            f"free page reporting (virtio balloon): {'on: free memory is warmed before each phase' if free_page_reporting() else 'off'}",
            f"settings: {vars(self.args)}",
        ]
        (self.out / "environment.txt").write_text("\n".join(lines) + "\n")

    def value(self, target, config, test, metric):
        """The median over the rounds."""
        vals = [r[4] for r in self.rows
                if r[0] == target and r[1] == config and r[2] == test and r[3] == metric]
        return statistics.median(vals) if vals else None

    def write_outputs(self):
        with open(self.out / "results.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["target", "config", "test", "metric", "value", "unit", "round"])
            w.writerows(self.rows)
        md = [f"# rfs benchmark ({'quick' if self.args.quick else 'full'} run)", "",
              (self.out / "environment.txt").read_text().replace("\n", "  \n"), ""]
        tests = sorted({(r[2], r[3]) for r in self.rows if r[1] in ("default", "baseline", "given mount")})
        rounds = f" (medians of {self.args.rounds} rounds)" if self.args.rounds > 1 else ""
        md += [f"## rfs against baselines{rounds}", "",
               "| test | metric | rfs | " + " | ".join(BASELINES) + " | "
               + " | ".join(f"rfs / {b}" for b in BASELINES) + " |",
               "|---|---|---|" + "---|" * (2 * len(BASELINES))]
        md[-3:-3] = ["Ratios above 1 mean rfs is better: for latency (us) and CPU per operation rows "
                     "they are baseline / rfs.", ""]
        rfs_cfg = "given mount" if self.args.mount else "default"
        fmt = lambda v: "n/a" if v is None else f"{v:,.1f}"  # noqa: E731
        for test, metric in tests:
            if metric.endswith("/MB"):
                continue
            r = self.value("rfs", rfs_cfg, test, metric)
            base = [self.value(b, "baseline", test, metric) for b in BASELINES]
            md.append(f"| {test} | {metric} | {fmt(r)} | " + " | ".join(fmt(v) for v in base) + " | "
                      + " | ".join(times_better(metric, r, v) for v in base) + " |")
        if any(r[1] == DEFAULT_MOUNT for r in self.rows):
            md += ["", f"## The {DEFAULT_MOUNT} against max_write {self.args.max_write}", "",
                   f"| test | metric | max_write {self.args.max_write} | {DEFAULT_MOUNT} | "
                   "1M / paper | 1M / GlusterFS |", "|---|---|---|---|---|---|"]
            for test, metric in tests:
                if metric.endswith("/MB"):
                    continue
                paper = self.value("rfs", "default", test, metric)
                one = self.value("rfs", DEFAULT_MOUNT, test, metric)
                gluster = self.value("GlusterFS", "baseline", test, metric)
                md.append(f"| {test} | {metric} | {fmt(paper)} | {fmt(one)} | "
                          f"{times_better(metric, one, paper)} | {times_better(metric, one, gluster)} |")
        abl = [r for r in self.rows if r[0] == "rfs ablation"]
        if abl:
            configs = list(dict.fromkeys(r[1] for r in abl))
            metrics = list(dict.fromkeys((r[2], r[3]) for r in abl))
            md += ["", "## Ablation through the mount (each mechanism alone, then all on)", "",
                   "| test | metric | " + " | ".join(configs) + " |",
                   "|---|---|" + "---|" * len(configs)]
            for test, metric in metrics:
                vals = [self.value("rfs ablation", c, test, metric) for c in configs]
                md.append(f"| {test} | {metric} | " + " | ".join(
                    "n/a" if v is None else f"{v:,.2f}" for v in vals) + " |")
        (self.out / "results.md").write_text("\n".join(md) + "\n")
        self.plots()
        log(f"results in {self.out}")

    def plots(self):
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            log("matplotlib missing: no plots")
            return
        targets = [t for t in ("rfs", *BASELINES) if any(r[0] == t for r in self.rows)]
        groups = {}
        for r in self.rows:
            if r[0] in targets and r[5] in ("MB/s", "IOPS", "ops/s"):
                config = "baseline" if r[0] != "rfs" else ("given mount" if self.args.mount else "default")
                groups.setdefault(r[2], {}).setdefault(r[3], {})[r[0]] = self.value(r[0], config, r[2], r[3])
        for test, metrics in groups.items():
            fig, ax = plt.subplots(figsize=(max(6, len(metrics) * 1.6), 4))
            width = 0.8 / len(targets)
            for i, t in enumerate(targets):
                ax.bar([x + i * width for x in range(len(metrics))],
                       [metrics[m].get(t, 0) for m in metrics], width, label=t)
            ax.set_xticks([x + width * (len(targets) - 1) / 2 for x in range(len(metrics))])
            ax.set_xticklabels(list(metrics), rotation=20, ha="right")
            ax.set_title(test)
            ax.legend()
            fig.tight_layout()
            fig.savefig(self.out / "plots" / (re.sub(r"[^a-z0-9]+", "_", test.lower()) + ".png"))
            plt.close(fig)
        # Throughput against record size, per iozone operation.
        ops = ["write", "rewrite", "read", "reread", "random read", "random write"]
        fig, axes = plt.subplots(2, 3, figsize=(13, 7))
        for ax, op in zip(axes.flat, ops):
            for t in targets:
                xs, ys = [], []
                for rec in self.args.records:
                    v = self.value(t, "baseline" if t != "rfs" else ("given mount" if self.args.mount else "default"),
                                   f"iozone {rec}K", op)
                    if v is not None:
                        xs.append(rec)
                        ys.append(v)
                if xs:
                    ax.plot(xs, ys, marker="o", label=t)
            ax.set_xscale("log", base=2)
            ax.set_title(f"iozone {op}")
            ax.set_xlabel("record KiB")
            ax.set_ylabel("MB/s")
        axes.flat[0].legend()
        fig.tight_layout()
        fig.savefig(self.out / "plots" / "iozone_by_record_size.png")
        plt.close(fig)
        abl = [r for r in self.rows if r[0] == "rfs ablation" and r[5] == "MB/s"]
        if abl:
            configs = list(dict.fromkeys(r[1] for r in abl))
            metrics = list(dict.fromkeys((r[2], r[3]) for r in abl))
            fig, ax = plt.subplots(figsize=(12, 4))
            width = 0.8 / len(configs)
            for i, c in enumerate(configs):
                ax.bar([x + i * width for x in range(len(metrics))],
                       [self.value("rfs ablation", c, t, m) or 0 for t, m in metrics], width, label=c)
            ax.set_xticks([x + 0.4 for x in range(len(metrics))])
            ax.set_xticklabels([f"{t}\n{m}" for t, m in metrics], fontsize=8)
            ax.set_ylabel("MB/s")
            ax.set_title("ablation through the mount")
            ax.legend(fontsize=7)
            fig.tight_layout()
            fig.savefig(self.out / "plots" / "ablation.png")
            plt.close(fig)

    def check(self):
        """Every step must have produced numbers (how fast is not judged here)."""
        missing = []
        expect_tests = [f"iozone {r}K" for r in self.args.records] + [
            "fio seq write 128K", "fio seq read 128K", "fio rand read 4K qd1 direct",
            "fio rand write 4K qd1 direct", "fio rand read 4K 4 jobs direct",
            "ring 4K rand read 4 jobs", "ring 1M seq read", f"metadata {self.args.files} files",
            f"small files {self.args.small_files} x 4K", f"small files {self.args.small_files} x 64K"]
        configs = ["given mount"] if self.args.mount else ["default"]
        if not self.args.mount and self.args.max_write != DEFAULT_MAX_WRITE:
            configs.append(DEFAULT_MOUNT)
        for config in configs:
            for t in expect_tests:
                if not any(r[0] == "rfs" and r[1] == config and r[2] == t and r[4] and r[4] > 0
                           for r in self.rows):
                    missing.append(f"rfs ({config}): {t}")
        if not self.args.skip_ablation and not self.args.mount:
            for label, _ in ([ABLATION[0], ABLATION[-1]] if self.args.quick else ABLATION):
                if not any(r[1] == label and r[4] and r[4] > 0 for r in self.rows):
                    missing.append(f"ablation: {label}")
        if not self.args.skip_baselines:
            for t in BASELINES:
                if not any(r[0] == t and r[4] and r[4] > 0 for r in self.rows):
                    missing.append(t)
        if missing:
            log("steps without numbers: " + "; ".join(missing))
            return 1
        log(f"{len(self.rows)} figures; every step produced numbers")
        return 0


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small files and short runs (seconds); for CI")
    p.add_argument("--size", type=parse_size, default=None, help="file size (default 2G, quick 32M)")
    p.add_argument("--records", type=lambda s: [int(x) for x in s.split(",")], default=[4, 128, 1024],
                   help="IOzone record sizes in KiB (default 4,128,1024)")
    p.add_argument("--runtime", type=int, default=None, help="seconds per timed fio job (default 20, quick 2)")
    p.add_argument("--files", type=int, default=None, help="files for the metadata test (default 10000, quick 1000)")
    p.add_argument("--small-files", type=int, default=None,
                   help="files per small-file set (default 2000, quick 200; each costs rfs a 1 MiB chunk today)")
    p.add_argument("--max-write", default="128K", help="fs-client max_write (the paper used 128K)")
    p.add_argument("--transport", default="tcp", help="auto, verbs or tcp")
    p.add_argument("--replicas", type=int, default=1,
                   help="copies of every chunk (mem-server --replicas), each on a node of its own")
    p.add_argument("--mount", help="measure this existing rfs mount instead of starting one")
    p.add_argument("--rounds", type=int, default=1,
                   help="measure every target this many times, in turn; tables give medians")
    p.add_argument("--skip-ablation", action="store_true")
    p.add_argument("--skip-baselines", action="store_true")
    p.add_argument("--results", default=str(ROOT / "iozone" / "results"))
    p.add_argument("--workdir", default="/tmp/rfsbench")
    a = p.parse_args()
    if os.geteuid() != 0:
        sys.exit("rfsbench: run as root (it mounts tmpfs and drops the page cache)")
    if a.rounds < 1:
        sys.exit("rfsbench: --rounds must be at least 1")
    a.size = a.size or (32 << 20 if a.quick else 2 << 30)
    a.runtime = a.runtime or (2 if a.quick else 20)
    a.files = a.files or (1000 if a.quick else 10000)
    a.small_files = a.small_files or (200 if a.quick else 2000)
    if shutil.which("iozone") is None:
        sys.exit("rfsbench: iozone not found; run through iozone/run.sh, which installs it")
    sys.exit(Bench(a).go())


if __name__ == "__main__":
    main()

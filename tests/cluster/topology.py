"""Hosts as Linux network namespaces, and a Scroll cluster spread over them.

A ``Network`` is a private test subnet (``10.251.0.0/24`` by default) that exists only inside
namespaces this module creates: a *switch* namespace holding a bridge, and one namespace per host
whose ``eth0`` (a veth pair) plugs into the bridge with one address. Nothing is added to the
namespace the caller runs in, so nothing here can reach (or be reached from) any other address.
Partitions take a host's switch port down (its packets, both ways, go nowhere - no reset, as when
a cable is pulled); ``heal`` brings it back. Every name carries a per-run prefix, and ``down``
(run by ``ScrollCluster.stop``, and by the next ``up`` with the same prefix for a crashed run's leftovers)
stops every process and deletes every namespace, which deletes the links and the bridge with them.

A ``ScrollCluster`` runs on a ``Network``: etcd members, bookies (each on its host, with a rack),
Kafka listeners and a Spark standalone master and workers, each a process started with
``ip netns exec <host>`` and addressed by ``host-ip:port``. The test (tests/cluster) and the
by-hand script (scripts/cluster.sh) use the same topology; processes and namespaces are removed by
``stop`` whatever state they are in.

Needs root (``ip netns``), iproute2 and etcd. ``tc netem`` is not used: this machine's kernel has
no ``sch_netem`` (CONFIG_NET_SCH_NETEM is not set); where a bench wants delay between hosts, the
hosts are linked through VDE's user-space switches and ``wirefilter`` instead (``vde_delay_ms``).
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from streams.tools.localcluster import Proc, find_etcd

ROOT = Path(__file__).resolve().parents[2]
CLONE_NEWNET = 0x40000000


class TopologyError(RuntimeError):
    pass


def have_netns() -> str | None:
    """Why network namespaces cannot be used here, or None when they can."""
    if os.geteuid() != 0:
        return "needs root (ip netns)"
    if not shutil.which("ip"):
        return "needs iproute2 (ip)"
    probe = f"scroll-probe-{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"ip netns add failed: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and r.returncode != 0:
        raise TopologyError(f"ip {' '.join(args)}: {r.stderr.strip()}")
    return r


_libc = ctypes.CDLL(None, use_errno=True)


def in_netns(ns: str, fn):
    """Run ``fn()`` on a thread that has entered network namespace ``ns`` (sockets it creates live
    there) and return its result. The calling thread's namespace is untouched."""
    out: dict = {}

    def run():
        try:
            fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
            try:
                if _libc.setns(fd, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns {ns}")
            finally:
                os.close(fd)
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            out["error"] = e

    t = threading.Thread(target=run, name=f"netns-{ns}")
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out.get("value")


@dataclass
class Host:
    name: str
    ns: str
    ip: str
    port: str  # its veth end in the switch namespace

    def prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.ns]


class Network:
    """``vde_delay_ms``: link the hosts through VDE instead of the kernel bridge (bench/cluster.py;
    the kernel here has no netem): every host's ``eth0`` is the tap of a ``vde_switch`` of its own,
    plugged into a central ``vde_switch`` through a ``wirefilter`` adding half the delay each way,
    so host to host is ``vde_delay_ms`` one way. Sockets and logs go to ``vde_dir``."""

    def __init__(self, prefix: str = "scr", subnet: str = "10.251.0", vde_delay_ms: float | None = None,
                 vde_dir: Path | None = None):
        self.prefix = prefix
        self.subnet = subnet
        self.switch = f"{prefix}-sw"
        self.hosts: dict[str, Host] = {}
        self.vde_delay_ms = vde_delay_ms
        self.vde_dir = vde_dir
        self.vde_procs: list[subprocess.Popen] = []

    def _vde(self, ns: str, args: list[str], log: str) -> None:
        """A VDE program in ``ns``; its stdin stays open (vde_switch exits on EOF there)."""
        out = open(self.vde_dir / log, "ab")
        self.vde_procs.append(subprocess.Popen(["ip", "netns", "exec", ns, *args], stdin=subprocess.PIPE,
                                               stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
        out.close()

    def _wait_path(self, path: Path, what: str) -> None:
        deadline = time.monotonic() + 10
        while not path.exists():
            if time.monotonic() > deadline:
                raise TopologyError(f"{what} did not start (no {path})")
            time.sleep(0.05)

    # ---------------------------------------------------------------- lifecycle
    def namespaces(self) -> list[str]:
        out = _ip("netns", "list", check=False).stdout.split("\n")
        names = [line.split()[0] for line in out if line.strip()]
        return [n for n in names if n == self.switch or n.startswith(f"{self.prefix}-h-")]

    def up(self) -> Network:
        self.down()  # leftovers of a crashed run with this prefix
        _ip("netns", "add", self.switch)
        if self.vde_delay_ms is not None:
            if self.vde_dir is None:
                raise TopologyError("VDE needs vde_dir")
            self.vde_dir.mkdir(parents=True, exist_ok=True)
            self._vde(self.switch, ["vde_switch", "-s", str(self.vde_dir / "main")], "vde-main.log")
            self._wait_path(self.vde_dir / "main" / "ctl", "the central vde_switch")
            return self
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        return self

    def add_host(self, name: str) -> Host:
        n = len(self.hosts) + 1
        ns = f"{self.prefix}-h-{name}"
        host = Host(name, ns, f"{self.subnet}.{n}", f"p{n}")
        _ip("netns", "add", ns)
        if self.vde_delay_ms is not None:
            sock = self.vde_dir / name
            self._vde(ns, ["vde_switch", "-s", str(sock), "-t", "eth0"], f"vde-{name}.log")
            self._wait_path(sock / "ctl", f"{name}'s vde_switch")
            half = f"{self.vde_delay_ms / 2:g}"
            self._vde(self.switch, ["wirefilter", "-v", f"{sock}:{self.vde_dir / 'main'}", "-d", half],
                      f"vde-wire-{name}.log")
            deadline = time.monotonic() + 10
            while _ip("-n", ns, "link", "show", "eth0", check=False).returncode != 0:
                if time.monotonic() > deadline:
                    raise TopologyError(f"{name}'s tap did not appear")
                time.sleep(0.05)
            _ip("-n", ns, "addr", "add", f"{host.ip}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            self.hosts[name] = host
            return host
        tmp = f"{self.prefix[:6]}{os.getpid() % 100000}{n}"[:15]
        _ip("link", "add", tmp, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("link", "set", tmp, "netns", self.switch)  # out of the caller's namespace at once
        _ip("-n", self.switch, "link", "set", tmp, "name", host.port)
        _ip("-n", self.switch, "link", "set", host.port, "master", "br0")
        _ip("-n", self.switch, "link", "set", host.port, "up")
        _ip("-n", ns, "addr", "add", f"{host.ip}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        self.hosts[name] = host
        return host

    def down(self) -> None:
        for ns in self.namespaces():
            pids = _ip("netns", "pids", ns, check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            _ip("netns", "del", ns, check=False)
        for proc in self.vde_procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        self.vde_procs.clear()
        self.hosts.clear()

    # ---------------------------------------------------------------- faults
    def cut(self, name: str) -> None:
        """Partition a host away: its switch port goes down (packets both ways are lost)."""
        if self.vde_delay_ms is not None:
            raise TopologyError("partitions are made on the kernel bridge, not through VDE")
        _ip("-n", self.switch, "link", "set", self.hosts[name].port, "down")

    def heal(self, name: str) -> None:
        _ip("-n", self.switch, "link", "set", self.hosts[name].port, "up")

    def reachable(self, src: str, addr: tuple[str, int], timeout_s: float = 0.5) -> bool:
        def probe():
            with socket.socket() as s:
                s.settimeout(timeout_s)
                return s.connect_ex(addr) == 0

        return in_netns(self.hosts[src].ns, probe)

    def wait_listening(self, src: str, addr: tuple[str, int], proc: Proc | None = None,
                       timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc is not None and not proc.alive:
                raise TopologyError(f"{proc.name} exited with {proc.popen.returncode}; see {proc.log}:\n"
                                    f"{_tail(proc.log)}")
            if self.reachable(src, addr):
                return
            time.sleep(0.1)
        raise TopologyError(f"{addr[0]}:{addr[1]} not listening (from {src}) after {timeout_s} s"
                            + (f"; see {proc.log}:\n{_tail(proc.log)}" if proc else ""))


def _tail(path: Path, n: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


# ------------------------------------------------------------------------------------ the cluster
ETCD_CLIENT, ETCD_PEER = 2379, 2380
BOOKIE_PORT, BOOKIE_DATA_PORT = 3181, 3182
KAFKA_PORT = 9092
SPARK_MASTER_PORT, SPARK_MASTER_UI = 7077, 8080

# host -> rack for the five bookie hosts: three racks, as a small real deployment would have
BOOKIE_RACKS = {"b1": "/rack-a", "b2": "/rack-a", "b3": "/rack-b", "b4": "/rack-b", "b5": "/rack-c"}
ETCD_HOSTS = ("b1", "b3", "b5")  # etcd members share hosts with bookies, one per rack


@dataclass
class ScrollCluster:
    """The cluster test's topology: 3 etcd members, bookies on their own hosts in racks, Kafka
    listeners on their own hosts, an optional Spark standalone cluster, and a client host."""

    base: Path
    prefix: str = "scr"
    bookie_hosts: tuple[str, ...] = tuple(BOOKIE_RACKS)
    listeners: int = 2
    spark_workers: int = 0
    lease_ttl_s: float = 4.0
    vde_delay_ms: float | None = None  # hosts linked through VDE with this delay (bench/cluster.py)
    python: str = sys.executable
    net: Network = field(init=False)
    procs: dict[str, Proc] = field(default_factory=dict)
    spark: list = field(default_factory=list)  # spark_stream.standalone processes

    def __post_init__(self):
        self.base = Path(self.base).resolve()
        self.net = Network(self.prefix, vde_delay_ms=self.vde_delay_ms, vde_dir=self.base / "vde")

    # ---------------------------------------------------------------- addresses
    def ip(self, host: str) -> str:
        return self.net.hosts[host].ip

    @property
    def metadata_url(self) -> str:
        return "etcd://" + ",".join(f"{self.ip(h)}:{ETCD_CLIENT}" for h in self.etcd_hosts)

    @property
    def etcd_hosts(self) -> tuple[str, ...]:
        return tuple(h for h in ETCD_HOSTS if h in self.bookie_hosts) or self.bookie_hosts[:1]

    def bootstrap(self) -> str:
        return ",".join(f"{self.ip(f'k{n}')}:{KAFKA_PORT}" for n in range(1, self.listeners + 1))

    def spark_master(self) -> str:
        return f"spark://{self.ip('s0')}:{SPARK_MASTER_PORT}"

    # ---------------------------------------------------------------- processes
    def env(self, **extra: str) -> dict:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        env.pop("SCROLL_METADATA", None)
        env.update(extra)
        return env

    def spawn(self, name: str, host: str, args: list[str], *, port: int = 0, env: dict | None = None,
              parent_death_signal: bool = False) -> Proc:
        old = self.procs.get(name)
        if old is not None and old.alive:
            raise TopologyError(f"{name} is running")
        p = Proc(name, [*self.net.hosts[host].prefix(), *args], port, self.base / "logs" / f"{name}.log",
                 parent_death_signal=parent_death_signal)
        p.extra["host"] = host
        p.start(env if env is not None else self.env())
        self.procs[name] = p
        return p

    def start(self) -> ScrollCluster:
        """Bring the whole topology up (idempotent per process: a running one is left alone)."""
        (self.base / "logs").mkdir(parents=True, exist_ok=True)
        self.net.up()
        for h in self.bookie_hosts:
            self.net.add_host(h)
        for n in range(1, self.listeners + 2):  # one spare host for a listener that joins later
            self.net.add_host(f"k{n}")
        if self.spark_workers:
            for n in range(self.spark_workers + 1):
                self.net.add_host(f"s{n}")
        self.net.add_host("c1")  # clients: producers, consumers, the Spark driver, checks
        for h in self.etcd_hosts:
            self.start_etcd(h)
        for h in self.etcd_hosts:
            self.net.wait_listening("c1", (self.ip(h), ETCD_CLIENT), self.procs[f"etcd-{h}"])
        self.wait_etcd_healthy()
        for h in self.bookie_hosts:
            self.start_bookie(h)
        for h in self.bookie_hosts:
            self.net.wait_listening("c1", (self.ip(h), BOOKIE_PORT), self.procs[f"bookie-{h}"])
        self.wait_bookies(len(self.bookie_hosts))
        for n in range(1, self.listeners + 1):
            self.start_listener(n)
        for n in range(1, self.listeners + 1):
            self.net.wait_listening("c1", (self.ip(f"k{n}"), KAFKA_PORT), self.procs[f"listener-k{n}"])
        return self

    def start_etcd(self, host: str) -> Proc:
        """A member; started again on its data directory it rejoins (etcd ignores the initial-* flags then)."""
        ip = self.ip(host)
        peers = ",".join(f"etcd-{h}=http://{self.ip(h)}:{ETCD_PEER}" for h in self.etcd_hosts)
        d = self.base / host / "etcd"
        d.mkdir(parents=True, exist_ok=True)
        args = [find_etcd(), "--name", f"etcd-{host}", "--data-dir", str(d),
                "--listen-client-urls", f"http://{ip}:{ETCD_CLIENT}",
                "--advertise-client-urls", f"http://{ip}:{ETCD_CLIENT}",
                "--listen-peer-urls", f"http://{ip}:{ETCD_PEER}",
                "--initial-advertise-peer-urls", f"http://{ip}:{ETCD_PEER}",
                "--initial-cluster", peers, "--initial-cluster-state", "new",
                "--initial-cluster-token", f"{self.prefix}-etcd",
                "--heartbeat-interval", "100", "--election-timeout", "1000", "--log-level", "warn"]
        return self.spawn(f"etcd-{host}", host, args, port=ETCD_CLIENT, parent_death_signal=True)

    def restart_etcd(self, host: str) -> Proc:
        p = self.start_etcd(host)
        self.net.wait_listening("c1", (self.ip(host), ETCD_CLIENT), p)
        self.wait_etcd_healthy()
        return p

    def etcd_status(self) -> dict[str, str]:
        """member -> "ok" or why not, from etcd's own ``/health`` (a member without a leader, or
        cut off from the quorum, answers unhealthy), asked from the client host."""
        out = {}
        for h in self.etcd_hosts:
            try:
                got = in_netns(self.net.hosts["c1"].ns, lambda h=h: _get_json(f"http://{self.ip(h)}:{ETCD_CLIENT}/health"))
                out[h] = "ok" if str(got.get("health")) == "true" else f"unhealthy: {got}"
            except Exception as e:  # noqa: BLE001 - reported
                out[h] = f"{type(e).__name__}: {e}"
        return out

    def wait_etcd_healthy(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        status: dict = {}
        while time.monotonic() < deadline:
            status = self.etcd_status()
            running = [h for h in self.etcd_hosts if self.procs.get(f"etcd-{h}") and self.procs[f"etcd-{h}"].alive]
            if running and all(status[h] == "ok" for h in running):
                return
            time.sleep(0.2)
        raise TopologyError(f"etcd not healthy after {timeout_s} s: {status}")

    def start_bookie(self, host: str) -> Proc:
        ip = self.ip(host)
        d = self.base / host / "bookie"
        args = [self.python, "-m", "streams.tools.cli", "bookie", "--data-dir", str(d), "--host", ip,
                "--port", str(BOOKIE_PORT), "--data-port", str(BOOKIE_DATA_PORT), "--bookie-id", f"bookie-{host}",
                "--rack", BOOKIE_RACKS.get(host, "/default-rack"), "--registration-ttl", str(self.lease_ttl_s),
                "--log-level", "WARNING"]
        return self.spawn(f"bookie-{host}", host, args, port=BOOKIE_PORT,
                          env=self.env(SCROLL_METADATA=self.metadata_url))

    def start_listener(self, n: int) -> Proc:
        host = f"k{n}"
        ip = self.ip(host)
        args = [self.python, "-m", "streams.tools.cli", "kafka", "--host", ip, "--advertised-host", ip,
                "--port", str(KAFKA_PORT), "--node-id", str(n), "--lease-ttl", str(self.lease_ttl_s)]
        return self.spawn(f"listener-{host}", host, args, port=KAFKA_PORT,
                          env=self.env(SCROLL_METADATA=self.metadata_url))

    def add_listener(self, n: int) -> Proc:
        p = self.start_listener(n)
        self.net.wait_listening("c1", (self.ip(f"k{n}"), KAFKA_PORT), p)
        return p

    def run(self, host: str, args: list[str], timeout_s: float = 300.0, env: dict | None = None,
            check: bool = True) -> subprocess.CompletedProcess:
        """Run a command on a host to completion (output captured)."""
        r = subprocess.run([*self.net.hosts[host].prefix(), *args], capture_output=True, text=True,
                           timeout=timeout_s, env=env if env is not None else self.env(), cwd=ROOT)
        if check and r.returncode != 0:
            raise TopologyError(f"{' '.join(args)} on {host} exited {r.returncode}:\n{r.stdout[-3000:]}\n"
                                f"{r.stderr[-3000:]}")
        return r

    def scroll(self, *args: str, timeout_s: float = 300.0, check: bool = True) -> subprocess.CompletedProcess:
        """The ``scroll`` CLI, run on the client host against this cluster."""
        return self.run("c1", [self.python, "-m", "streams.tools.cli", *args], timeout_s=timeout_s, check=check,
                        env=self.env(SCROLL_METADATA=self.metadata_url))

    def wait_bookies(self, n: int, timeout_s: float = 60.0) -> list[dict]:
        deadline = time.monotonic() + timeout_s
        live: list = []
        while time.monotonic() < deadline:
            r = self.scroll("bookies", "--json", check=False, timeout_s=60)
            if r.returncode == 0:
                live = json.loads(r.stdout)
                if len(live) >= n:
                    return live
            time.sleep(0.3)
        raise TopologyError(f"{len(live)} of {n} bookies registered after {timeout_s} s: {live}")

    # ---------------------------------------------------------------- Spark
    def start_spark(self) -> None:
        """A standalone master on s0 and a worker on each of s1.., started with pyspark's own
        ``spark-class`` (spark_stream.standalone); workers run executors with this Python (the same
        environment on every host: they share this filesystem) and this checkout's code."""
        from spark_stream import standalone

        logs = self.base / "logs"
        code = {"PYTHONPATH": str(ROOT)}
        master = standalone.start_master(self.ip("s0"), SPARK_MASTER_PORT, SPARK_MASTER_UI, log_dir=logs,
                                         prefix=self.net.hosts["s0"].prefix(), pyspark_python=self.python,
                                         env=code, name="spark-master")
        self.spark.append(master)
        workers = [standalone.start_worker(master.url, self.ip(f"s{n}"), cores=1, memory="1g",
                                           webui_port=SPARK_MASTER_UI + n, work_dir=self.base / f"s{n}" / "work",
                                           log_dir=logs, prefix=self.net.hosts[f"s{n}"].prefix(),
                                           pyspark_python=self.python, env=code, name=f"spark-worker-s{n}")
                   for n in range(1, self.spark_workers + 1)]
        self.spark.extend(workers)
        master.wait_ready(120)
        for w in workers:
            w.wait_registered(120)

    def spark_state(self) -> dict:
        """The master's JSON (applications, workers), fetched from the client host."""
        return in_netns(self.net.hosts["c1"].ns, lambda: _get_json(f"http://{self.ip('s0')}:{SPARK_MASTER_UI}/json/"))

    # ---------------------------------------------------------------- teardown
    def stop(self) -> None:
        if self.spark:
            from spark_stream import standalone

            standalone.stop_all(self.spark)
        for p in list(self.procs.values()):
            try:
                if p.alive:
                    p.popen.send_signal(signal.SIGTERM)
            except Exception:  # noqa: BLE001, S110 - best effort, then SIGKILL below
                pass
        deadline = time.monotonic() + 10
        for p in list(self.procs.values()):
            try:
                p.popen.wait(max(0.1, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001
                try:
                    os.killpg(p.popen.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        self.net.down()  # and whatever else still runs in the namespaces


def _get_json(url: str):
    with urllib.request.urlopen(url, timeout=2) as r:
        return json.loads(r.read())


# ------------------------------------------------------------------------------- by hand
def _state_file(prefix: str) -> Path:
    return Path("/run") / f"scroll-cluster-{prefix}.json"


def main(argv=None) -> int:
    """``up`` (foreground; Ctrl-C tears everything down), ``down`` (leftovers), ``shell HOST``."""
    import argparse

    ap = argparse.ArgumentParser(prog="scripts/cluster.sh", description=main.__doc__)
    ap.add_argument("command", choices=["up", "down", "shell", "status"])
    ap.add_argument("host", nargs="?", default="c1", help="shell: the host to open a shell on (default c1)")
    ap.add_argument("--dir", default="cluster-data", help="data and logs (default ./cluster-data)")
    ap.add_argument("--prefix", default="scroll", help="namespace name prefix (default scroll)")
    ap.add_argument("--bookies", type=int, default=5, help="bookie hosts (1-5; default 5)")
    ap.add_argument("--listeners", type=int, default=2)
    ap.add_argument("--spark-workers", type=int, default=2, help="0: no Spark cluster")
    args = ap.parse_args(argv)
    why = have_netns()
    if why:
        print(f"cannot run: {why}", file=sys.stderr)
        return 2
    state = _state_file(args.prefix)
    if args.command == "down":
        Network(args.prefix).down()
        state.unlink(missing_ok=True)
        print(f"removed every {args.prefix}-* namespace and what ran in it")
        return 0
    if args.command in ("shell", "status"):
        if not state.exists():
            print(f"no cluster with prefix {args.prefix} is up (scripts/cluster.sh up)", file=sys.stderr)
            return 1
        info = json.loads(state.read_text())
        if args.command == "status":
            print(json.dumps(info, indent=2))
            return 0
        env = dict(os.environ, SCROLL_METADATA=info["metadata"], SCROLL_KAFKA_BOOTSTRAP=info["bootstrap"],
                   PS1=f"[{args.host}] \\w\\$ ")
        os.execvpe("ip", ["ip", "netns", "exec", info["hosts"][args.host]["ns"], "bash", "--norc"], env)
    def interrupt(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    c = ScrollCluster(Path(args.dir), prefix=args.prefix, bookie_hosts=tuple(BOOKIE_RACKS)[:args.bookies],
                      listeners=args.listeners, spark_workers=args.spark_workers)
    try:
        t0 = time.monotonic()
        c.start()
        if args.spark_workers:
            c.start_spark()
        info = {"metadata": c.metadata_url, "bootstrap": c.bootstrap(),
                "spark_master": c.spark_master() if args.spark_workers else None,
                "hosts": {h.name: {"ns": h.ns, "ip": h.ip} for h in c.net.hosts.values()},
                "processes": {n: {"host": p.extra["host"], "pid": p.popen.pid, "log": str(p.log)}
                              for n, p in c.procs.items()},
                "spark": {p.log_path.stem: {"pid": p.pid, "log": str(p.log_path)} for p in c.spark}}
        state.write_text(json.dumps(info))
        print(f"up in {time.monotonic() - t0:.0f} s\n")
        for h in c.net.hosts.values():
            runs = [n for n, p in c.procs.items() if p.extra.get("host") == h.name]
            runs += [p.log_path.stem for p in c.spark if p.host == h.ip]
            print(f"  {h.name:<4} {h.ip:<13} ns {h.ns:<16} {', '.join(runs) or '(spare)'}")
        print(f"\nmetadata  {c.metadata_url}\nkafka     {c.bootstrap()}")
        if args.spark_workers:
            print(f"spark     {c.spark_master()}")
        print(f"logs      {c.base / 'logs'}\n\n"
              f"A shell on the client host (SCROLL_METADATA and SCROLL_KAFKA_BOOTSTRAP set):\n"
              f"  scripts/cluster.sh shell c1 --prefix {args.prefix}\n"
              f"then e.g.  .venv/bin/scroll bookies;  kcat -b $SCROLL_KAFKA_BOOTSTRAP -L\n"
              f"Faults by hand: ip -n {c.net.switch} link set <port> down|up  (ports: "
              + ", ".join(f"{h.name}={h.port}" for h in c.net.hosts.values()) + ")\n\n"
              "Ctrl-C stops everything and removes the namespaces.", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        print("stopping...", flush=True)
        c.stop()
        state.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

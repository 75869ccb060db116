"""``scroll standalone``: a whole local platform in the foreground, data under one directory.

How this works. ``Standalone`` starts, in order, an etcd server (``--data-dir``/etcd), three
bookies (``--data-dir``/bookie-N, each with its own Prometheus endpoint) through
``streams.tools.localcluster.LocalCluster``, the Kafka listener as a ``scroll kafka`` child process
and the web console as a ``python -m compat_kafka.console`` one (``--console-port``, ``--no-console``;
docs/console.md).
Everything listens on 127.0.0.1 on fixed ports (so a restart finds the same endpoints and the
fragments that name the bookies still resolve) and each port can be changed. In its own process
it then serves a metrics endpoint (processes up, restarts, streams and their bytes, retention
runs) and runs the retention job on a schedule. The embedded object store (SeaweedFS) starts only
when something needs it (``prepare_object_store``, ``tier_once``). A child that dies is restarted
(with a back-off; the loop sleeps until its next job and learns of an exit from the child's pidfd)
and the restart is counted and logged; Ctrl-C (SIGINT) or SIGTERM stops the Kafka listener, the
bookies and etcd, in that order, and waits for each. Starting again on the same directory keeps
the data. Ports already in use fail fast with a message naming the option that moves them.
SIGHUP (once running) is forwarded to the bookies, the Kafka listener and the console, which reload their TLS
certificates (``reload_certificates``; under ``--secure`` expiring certificates are issued first).

``--secure`` turns on TLS and authentication everywhere (``Secure`` below): a local CA and
certificates under ``<data-dir>/pki`` (``tools/pki.py``), etcd over TLS with auth on, bookies over
TLS requiring a token (``<data-dir>/security/token``), the Kafka listener as SASL_SSL only (SCRAM
and PLAIN, ACLs on, ``admin`` a super user with a random password) and the client settings in
``<data-dir>/client.properties`` (Kafka: kcat -F, librdkafka) and ``<data-dir>/scroll-client.properties``
(the streams API and the Spark connector; it holds etcd's password: mode 0600, like the keys).
Secrets never go on a command line: children get the metadata URL through ``SCROLL_METADATA``.

``--etcd-auth`` (off by default) runs etcd with its auth on: user ``root`` with a random password
kept in ``<data-dir>/etcd/root.password`` (mode 0600, reused on restart); the bookies and the Kafka
listener get a metadata URL carrying it, and the banner shows that URL with the password redacted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import click

from fragments import aioloop
from fragments.security import redact_url

from .localcluster import ClusterError, LocalCluster, Proc, _tail, _wait_port

log = logging.getLogger("scroll.standalone")

READY_LINE = "scroll standalone ready"
CHILD_POLL_S = 0.5  # how often the loop polls its children where pidfds are not available
SWEEP_EVERY_S = 600.0  # how often the offload job also sweeps unreferenced objects (a LIST of the bucket)


@dataclass
class StandaloneConfig:
    data_dir: Path
    kafka_port: int = 9092
    etcd_port: int = 2379
    etcd_peer_port: int = 2380
    bookie_base_port: int = 3181
    metrics_port: int = 9404
    bookies: int = 3
    retention_interval_s: float = 300.0
    compaction_interval_s: float = 60.0
    tier_interval_s: float = 60.0
    object_store: bool = True  # run the embedded S3 server (SeaweedFS) and offload to it
    object_store_port: int = 8333  # its S3 port; its other components take the next 7 ports
    default_partitions: int = 1
    restart_children: bool = True
    extra_kafka_args: list[str] = field(default_factory=list)
    etcd_auth: bool = False  # etcd with auth on: root's password in <data-dir>/etcd/root.password
    secure: bool = False  # TLS and authentication everywhere (implies etcd_auth)
    autorecovery: bool = True  # re-replicate a lost bookie's fragments (streams/tools/autorecovery.py)
    lost_bookie_delay_s: float = 30.0
    # lease TTLs of the bookies' registrations and of autorecovery (keep-alive every TTL/3). One
    # host, children restarted by standalone: longer than a cluster's (5 s, 10 s) for fewer wake-ups
    registration_ttl_s: float = 30.0
    autorecovery_lease_ttl_s: float = 30.0
    # etcd's raft tick for its single member (--heartbeat-interval; --election-timeout 5x, the least
    # etcd allows). etcd's 100 ms default is for members that must notice a dead leader quickly; one
    # member has no peer, but every tick wakes it: 500 ms about halves an idle etcd's CPU. Leases
    # shorter than 1.5 election timeouts (3.75 s) are granted that long (docs/operations.md)
    etcd_heartbeat_ms: int = 500
    console: bool = True  # the web console (compat_kafka/console/) as a child process
    console_port: int = 9400

    @property
    def bookie_ports(self) -> list[int]:
        return [self.bookie_base_port + i for i in range(self.bookies)]

    @property
    def bookie_metrics_ports(self) -> list[int]:
        return [self.metrics_port + 1 + i for i in range(self.bookies)]

    @property
    def kafka_metrics_port(self) -> int:
        """The Kafka listener's metrics (consumer group lag): the port after the bookies'."""
        return self.metrics_port + 1 + self.bookies

    @property
    def metadata_url(self) -> str:
        return f"etcd://127.0.0.1:{self.etcd_port}"

    def ports(self) -> list[tuple[int, str]]:
        out = [(self.etcd_port, "--etcd-port"), (self.etcd_peer_port, "--etcd-peer-port"),
               (self.kafka_port, "--kafka-port"), (self.metrics_port, "--metrics-port")]
        out += [(p, "--bookie-port") for p in self.bookie_ports]
        out += [(p, "--metrics-port (bookie metrics use the next ports)") for p in self.bookie_metrics_ports]
        out.append((self.kafka_metrics_port, "--metrics-port (the Kafka listener's metrics follow the bookies')"))
        if self.console:
            out.append((self.console_port, "--console-port (or --no-console)"))
        if self.object_store:
            out += [(self.object_store_port + i, "--object-store-port (SeaweedFS takes it and the next 7)")
                    for i in range(8)]
        return out


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def etcd_password_file(data_dir: Path) -> Path:
    return data_dir / "etcd" / "root.password"


def _etcd_password(data_dir: Path) -> str:
    """root's etcd password: the one kept under the data directory, or a new random one."""
    path = etcd_password_file(data_dir)
    if path.exists():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    password = secrets.token_urlsafe(24)  # URL-safe: the URL needs no quoting
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(password + "\n")
    return password


ADMIN_USER = "admin"
KAFKA_MECHANISMS = "SCRAM-SHA-256,SCRAM-SHA-512,PLAIN"


def _write_secret_file(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` readable by its owner only (replacing it)."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


class Secure:
    """What ``--secure`` adds: the PKI, the admin user and the client settings files."""

    def __init__(self, data_dir: Path):
        from .pki import LocalPki

        self.dir = data_dir
        self.pki = LocalPki(data_dir / "pki")
        self.kafka_properties = data_dir / "client.properties"
        self.scroll_properties = data_dir / "scroll-client.properties"

    def admin_password(self) -> str:
        """The admin's Kafka password: the one in client.properties, or a new random one."""
        from fragments.security import read_client_properties

        if self.kafka_properties.exists():
            pw = read_client_properties(self.kafka_properties).get("sasl.password")
            if pw:
                return pw
        return secrets.token_urlsafe(18)

    def write_properties(self, kafka_port: int, password: str, metadata_url: str, security) -> None:
        ca = str(self.pki.ca)
        _write_secret_file(self.kafka_properties, "\n".join([
            "# Kafka client settings of this `scroll standalone --secure` (kcat -F, librdkafka, confluent-kafka,",
            "# scroll kafka groups --command-config). The admin user is a super user; add users with",
            "# `scroll kafka user add` and grant them ACLs with `scroll kafka acl add`.",
            f"bootstrap.servers=127.0.0.1:{kafka_port}",
            "security.protocol=SASL_SSL",
            "sasl.mechanism=SCRAM-SHA-256",
            f"sasl.username={ADMIN_USER}",
            f"sasl.password={password}",
            f"ssl.ca.location={ca}",
            ""]))
        _write_secret_file(self.scroll_properties, "\n".join([
            "# Settings of the streams API and the Spark connector for this `scroll standalone --secure`",
            "# (the same names as the Spark options; fragments.security.read_client_properties reads them).",
            f"metadata={metadata_url}",
            f"tls.ca={security.tls_ca}",
            f"token={security.token}",
            ""]))


class Standalone:
    def __init__(self, config: StandaloneConfig):
        self.config = config
        self.dir = config.data_dir.resolve()
        self.secure = Secure(self.dir) if config.secure else None
        password = _etcd_password(self.dir) if (config.etcd_auth or config.secure) else None
        extra = {}
        if self.secure is not None:
            from .localcluster import EtcdTLSFiles

            pki = self.secure.pki.ensure()
            extra = {"etcd_tls": EtcdTLSFiles(cert=str(pki.server_cert), key=str(pki.server_key), ca=str(pki.ca)),
                     "secure_bookies": "token", "bookie_ca": pki}
        self.cluster = LocalCluster(self.dir, bookies=config.bookies, etcd_port=config.etcd_port,
                                    etcd_peer_port=config.etcd_peer_port, bookie_ports=config.bookie_ports,
                                    bookie_metrics_ports=config.bookie_metrics_ports, etcd_password=password,
                                    bookie_args=["--registration-ttl", f"{config.registration_ttl_s:g}"],
                                    etcd_args=["--heartbeat-interval", str(config.etcd_heartbeat_ms),
                                               "--election-timeout", str(5 * config.etcd_heartbeat_ms)], **extra)
        self.kafka: Proc | None = None
        self.console: Proc | None = None
        self.seaweed = self._seaweed() if config.object_store else None
        self._object_store_up = False  # SeaweedFS started (at start, or by the first run that needs it)
        self._object_store_starting: asyncio.Task | None = None
        self._pidfds: dict[int, int] | None = {}  # child pid -> its pidfd on the loop (None: not available)
        self._wake: asyncio.Event | None = None  # set by stop, a child's exit; run_forever waits on it
        self._tier_runs = 0
        self._objects = None  # (TierConfig, ObjectStore) of the offload runs
        self.restarts: dict[str, int] = {}
        self._metrics = None
        self.catalog = None  # the watched StreamCatalog while run_forever runs (streams/catalog.py)
        self._gauged: dict[int, str] = {}  # ledger id -> stream name of every scroll_stream_bytes label set
        self._metrics_server = None
        self._registry = None  # the metrics' CollectorRegistry (autorecovery adds its own to it)
        self.autorecovery = None  # the AutoRecovery instance while run_forever runs

    def _seaweed(self):
        """The embedded S3 server (SeaweedFS, loopback only). Under ``--secure`` it requires signed
        requests (an access key kept in ``<data-dir>/objectstore/s3-credentials.json``, mode 0600,
        reused on restart) and serves HTTPS with a certificate of the local CA."""
        from ..tier.seaweed import SeaweedS3

        base = self.config.object_store_port
        d = self.dir / "objectstore"
        creds = tls = ca = None
        if self.secure is not None:
            creds = _s3_credentials(d / "s3-credentials.json")
            pki = self.secure.pki.ensure()
            tls, ca = (str(pki.server_cert), str(pki.server_key)), str(pki.ca)
        return SeaweedS3(d, s3_port=base, master_port=base + 1, volume_port=base + 2, filer_port=base + 3,
                         master_grpc_port=base + 4, volume_grpc_port=base + 5, filer_grpc_port=base + 6,
                         s3_grpc_port=base + 7, credentials=creds, tls=tls, tls_ca=ca)

    def prepare_object_store(self, timeout_s: float) -> None:
        """Name the embedded S3 server as the cluster's tier (etcd) and start it now only if the
        stored metadata needs it: a stream whose policy turns remote storage on, or (when SeaweedFS
        ran on this directory before) a fragment with a tier state (offloaded: readers and
        retention need its object). Otherwise it stays off until the offload job finds a stream
        that turns remote storage on (``tier_once``). The tier config is saved either way: its
        endpoint is stable (``check_ports`` validated its ports), and readers contact it only for
        an offloaded fragment, which exists only once it has run."""
        from fragments.stores import open_store

        from .tier import save_tier_config

        ran_before = any((self.seaweed.dir / "data").glob("*"))

        async def prepare() -> bool:
            store = await open_store(self.cluster.metadata_url, security=self.cluster.client_security)
            try:
                await save_tier_config(store, self.seaweed.tier_config())
                return await _object_store_needed(store, scan_fragments=ran_before)
            finally:
                await store.close()

        if asyncio.run(prepare()):
            self._start_seaweed(timeout_s)
        else:
            log.info("no stream offloads: the object store (SeaweedFS) starts when a topic turns remote storage on")

    def _start_seaweed(self, timeout_s: float) -> None:
        self.seaweed.start(timeout_s)
        self._object_store_up = True

    # ---------------------------------------------------------------- start and stop
    def check_ports(self) -> None:
        taken = [(p, opt) for p, opt in self.config.ports() if not _port_free(p)]
        if taken:
            lines = "\n".join(f"  127.0.0.1:{p} (move it with {opt})" for p, opt in taken)
            raise ClusterError(f"ports already in use — is another scroll standalone running?\n{lines}")

    def start(self, timeout_s: float = 60.0) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.check_ports()
        try:
            self.cluster.start(timeout_s, before_bookies=self.forget_bookies)
            if self.seaweed is not None:
                self.prepare_object_store(timeout_s)
            if self.secure is not None:
                self._secure_setup()
            self.kafka = self._kafka_proc()
            self._start_kafka(timeout_s)
            if self.config.console:
                self.console = self._console_proc()
                self.console.start(self._kafka_env())
                _wait_port(self.config.console_port, self.console.popen, "the console", timeout_s, self.console.log)
        except BaseException:
            self.stop()
            raise

    def _secure_setup(self) -> None:
        """The admin user (its SCRAM credentials in the metadata store, through ``scroll kafka user
        add``: the password in the environment, never on a command line) and the settings files."""
        password = self.secure.admin_password()
        env = {**self._child_env(), "SCROLL_METADATA": self.cluster.metadata_url, "SCROLL_KAFKA_PASSWORD": password}
        r = subprocess.run([sys.executable, "-m", "streams.tools.cli", "kafka", "user", "add", ADMIN_USER],
                           env=env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
        if r.returncode != 0:
            raise ClusterError(f"could not create the Kafka admin user: {r.stderr.strip()[-500:]}")
        self.secure.write_properties(self.config.kafka_port, password, self.cluster.metadata_url,
                                     self.cluster.client_security)

    def _kafka_proc(self) -> Proc:
        c = self.config
        args = [sys.executable, "-m", "streams.tools.cli", "kafka", "--host", "127.0.0.1",
                "--port", str(c.kafka_port), "--default-partitions", str(c.default_partitions),
                "--metrics-port", str(c.kafka_metrics_port)]
        if self.secure is not None:
            pki = self.secure.pki
            args += ["--listener", f"SASL_SSL://127.0.0.1:{c.kafka_port}", "--ssl-cert", str(pki.server_cert),
                     "--ssl-key", str(pki.server_key), "--sasl-mechanisms", KAFKA_MECHANISMS, "--acls",
                     "--super-users", f"User:{ADMIN_USER}", "--inter-broker-ca", str(pki.ca)]
        return Proc("kafka", [*args, *c.extra_kafka_args], c.kafka_port, self.dir / "kafka" / "kafka.log")

    def _kafka_env(self) -> dict:
        """The listener's environment: the metadata URL (it may hold etcd's password: never on the
        command line) and, when secured, the bookies' CA and token."""
        env = self._child_env()
        env["SCROLL_METADATA"] = self.cluster.metadata_url
        sec = self.cluster.client_security
        if sec is not None:
            env["SCROLL_TLS_CA"] = sec.tls_ca
            env["SCROLL_TOKEN_FILE"] = str(self.dir / "security" / "token")
        return env

    def _start_kafka(self, timeout_s: float) -> None:
        self.kafka.start(self._kafka_env())
        _wait_port(self.config.kafka_port, self.kafka.popen, "the Kafka listener", timeout_s, self.kafka.log)

    def _console_proc(self) -> Proc:
        """The web console (``python -m compat_kafka.console``): the metadata URL and bookie
        credentials in its environment, like the listener; the graphs sample every /metrics here."""
        c = self.config
        sources = [f"standalone=http://127.0.0.1:{c.metrics_port}/metrics",
                   f"kafka=http://127.0.0.1:{c.kafka_metrics_port}/metrics"]
        sources += [f"bookie-{i}=http://127.0.0.1:{p}/metrics" for i, p in enumerate(c.bookie_metrics_ports)]
        args = [sys.executable, "-m", "compat_kafka.console", "--port", str(c.console_port),
                "--bootstrap", f"127.0.0.1:{c.kafka_port}", *(a for src in sources for a in ("--metrics", src))]
        if self.secure is not None:
            pki = self.secure.pki
            args += ["--secure", "--ssl-cert", str(pki.server_cert), "--ssl-key", str(pki.server_key),
                     "--command-config", str(self.secure.kafka_properties), "--super-users", f"User:{ADMIN_USER}"]
        return Proc("console", args, c.console_port, self.dir / "console" / "console.log")

    @property
    def console_url(self) -> str:
        return f"{'https' if self.secure is not None else 'http'}://127.0.0.1:{self.config.console_port}/"

    def _console_line(self) -> str:
        if self.console is None:
            return "  console          off (--no-console)"
        how = f"log in as {ADMIN_USER} (its password is in client.properties)" if self.secure is not None else \
            "no login: loopback only"
        return f"  console          {self.console_url}  ({how})"

    def stop(self) -> None:
        if self.console is not None:
            self.console.stop()
        if self.kafka is not None:
            self.kafka.stop()
        if self.seaweed is not None:
            self.seaweed.stop()
        self.cluster.stop()
        if self._metrics_server is not None:
            with contextlib.suppress(Exception):
                self._metrics_server.server_close()
            self._metrics_server = None

    def reload_certificates(self) -> list[str]:
        """SIGHUP to standalone: under ``--secure``, issue again any certificate that is about to
        expire (``LocalPki.ensure``), then forward SIGHUP to the bookies and the Kafka listener, which
        re-read their certificate files for new handshakes (etcd reads its files at every handshake
        by itself). The children signalled, by name."""
        if self.secure is not None:
            try:
                self.secure.pki.ensure()
            except Exception as exc:  # noqa: BLE001 - the children keep the certificates they have
                log.error("cannot renew the certificates under %s: %s", self.secure.pki.directory, exc)
        sent = []
        for p in [*self.cluster.bookies, self.kafka, self.console]:
            if p is not None and p.alive:
                p.signal(signal.SIGHUP)
                sent.append(p.name)
        log.info("SIGHUP forwarded to %s", ", ".join(sent) or "no child")
        return sent

    def processes(self) -> list[Proc]:
        out = [p for p in [self.cluster.etcd, *self.cluster.bookies, self.kafka, self.console,
                           self.seaweed.proc if self._object_store_up else None] if p is not None]
        return out

    # ---------------------------------------------------------------- supervision
    def children_alive(self) -> bool:
        """Whether every child that should run does (a poll of each, no blocking)."""
        return all(p.alive for p in self._supervised())

    def supervise_once(self) -> list[str]:
        """Restart any child that died; the names restarted."""
        restarted = []
        if not self.config.restart_children:
            return restarted
        if self.cluster.etcd is not None and not self.cluster.etcd.alive:
            log.warning("etcd exited (%s); restarting it. Log: %s", self.cluster.etcd.popen.returncode,
                        self.cluster.etcd.log)
            self.cluster.start_etcd()
            restarted.append("etcd")
        for i, b in enumerate(self.cluster.bookies):
            if not b.alive:
                log.warning("%s exited (%s); restarting it. Log: %s\n%s", b.name, b.popen.returncode, b.log,
                            _tail(b.log, 5))
                self.forget_bookies([i])  # it registers again at once, not a registration TTL later
                self.cluster.start_bookie(i, wait=False)
                restarted.append(b.name)
        if self.kafka is not None and not self.kafka.alive:
            log.warning("the Kafka listener exited (%s); restarting it. Log: %s\n%s", self.kafka.popen.returncode,
                        self.kafka.log, _tail(self.kafka.log, 5))
            self.kafka.start(self._kafka_env())
            restarted.append("kafka")
        if self.console is not None and not self.console.alive:
            log.warning("the console exited (%s); restarting it. Log: %s\n%s", self.console.popen.returncode,
                        self.console.log, _tail(self.console.log, 5))
            self.console.start(self._kafka_env())
            restarted.append("console")
        if self._object_store_up and not self.seaweed.alive:
            log.warning("the object store (SeaweedFS) exited (%s); restarting it. Log: %s\n%s",
                        self.seaweed.proc.popen.returncode, self.seaweed.log, _tail(self.seaweed.log, 5))
            self.seaweed.proc.start()
            restarted.append("seaweedfs")
        for name in restarted:
            self.restarts[name] = self.restarts.get(name, 0) + 1
        return restarted

    def forget_bookies(self, which: list[int] | None = None) -> None:
        """Delete the registrations of our bookies ``which`` (default: all) that are not running:
        left by a bookie that died (kill -9, a crash of the whole tree) they would stay until their
        lease expires (``registration_ttl_s``; etcd renews every lease in full when it restarts), and
        the bookie starting again would wait for that to register. Only standalone runs bookies with
        these ids against its etcd, and it starts them."""
        from fragments.ledgers import bookie_key
        from fragments.stores import open_store

        ids = [f"bookie-{i}" for i in (range(self.config.bookies) if which is None else which)]

        async def forget() -> None:
            store = await open_store(self.cluster.metadata_url, security=self.cluster.client_security)
            try:
                for bookie_id in ids:
                    await store.delete(bookie_key(bookie_id))
            finally:
                await store.close()

        try:
            asyncio.run(forget())
        except Exception as exc:  # noqa: BLE001 - then the bookie waits for the lease to expire
            log.warning("could not delete the stale registrations of %s: %s", ", ".join(ids), exc)

    @staticmethod
    def _child_env() -> dict:
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
        return env

    @staticmethod
    def warm_jobs() -> None:
        """Import what the first retention, compaction and offload runs import (the retention floors'
        entry points: compat_kafka's group coordinator pulls in kio's schemas and hypothesis, ~0.5 s of
        CPU), before the ready line: else that runs 10 s after start, in the middle of the first
        traffic (issue 26: a CPU burst on a 2-core box, in append p99; docs/benchmarks.md)."""
        try:
            from .compaction import run_compaction  # noqa: F401
            from .retention import load_floors
            from .tier import run_tier  # noqa: F401

            load_floors()
        except Exception as exc:  # noqa: BLE001 - the runs themselves report what fails
            log.debug("warming the jobs' imports: %s", exc)

    # ---------------------------------------------------------------- metrics
    def start_metrics(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge

        from fragments.metrics_http import serve_metrics

        reg = CollectorRegistry()
        m = {
            "up": Gauge("scroll_process_up", "1 when the child process runs", ["process"], registry=reg),
            "restarts": Gauge("scroll_process_restarts", "times standalone restarted the child", ["process"],
                              registry=reg),
            "streams": Gauge("scroll_streams", "streams in the metadata store", registry=reg),
            "stream_bytes": Gauge("scroll_stream_bytes", "bytes in a stream's sealed fragments", ["stream"],
                                  registry=reg),
            "bookies": Gauge("scroll_live_bookies", "bookies registered in the metadata store", registry=reg),
            "retention_runs": Counter("scroll_retention_runs", "retention job runs", ["outcome"], registry=reg),
            "retention_bytes": Counter("scroll_retention_removed_bytes", "bytes removed by retention",
                                       registry=reg),
            "retention_fragments": Counter("scroll_retention_removed_fragments", "fragments removed by retention",
                                           registry=reg),
            "compaction_runs": Counter("scroll_compaction_runs", "compaction job runs", ["outcome"], registry=reg),
            "compaction_bytes": Counter("scroll_compaction_reclaimed_bytes",
                                        "bytes compaction reclaimed (per replica)", registry=reg),
            "compaction_dirty": Gauge("scroll_compaction_dirty_ratio",
                                      "dirty share of a compacted stream's cleanable bytes", ["stream"], registry=reg),
            "compaction_lag": Gauge("scroll_compaction_lag_seconds",
                                    "age of the oldest record not yet compacted (the cleaner's lag)", ["stream"],
                                    registry=reg),
            "tier_runs": Counter("scroll_tier_runs", "offload job runs", ["outcome"], registry=reg),
            "tier_offloaded": Counter("scroll_tier_offloaded_bytes", "bytes uploaded to the object store",
                                      registry=reg),
            "tier_offloaded_fragments": Counter("scroll_tier_offloaded_fragments", "fragments offloaded",
                                                registry=reg),
            "tier_released": Counter("scroll_tier_released_bytes",
                                     "bytes of bookie copies released after offload (per replica)", registry=reg),
            "tier_swept": Counter("scroll_tier_swept_objects", "unreferenced objects the sweep deleted",
                                  registry=reg),
            "tier_skipped": Gauge("scroll_tier_stream_stalled",
                                  "1 when a stream's last offload stopped on an error (store down, ...)", ["stream"],
                                  registry=reg),
        }
        self._metrics = m
        self._registry = reg
        self._metrics_server = serve_metrics(self.config.metrics_port, "127.0.0.1", reg)

    def update_process_metrics(self) -> None:
        if self._metrics is None:
            return
        for p in self.processes():
            self._metrics["up"].labels(p.name).set(1 if p.alive else 0)
            self._metrics["restarts"].labels(p.name).set(self.restarts.get(p.name, 0))

    async def update_bookie_metrics(self, client) -> None:
        if self._metrics is None:
            return
        self._metrics["bookies"].set(len(await client.live_bookies()))

    def on_catalog_change(self, ledger_id: int | None) -> None:
        """Keep ``scroll_streams`` and ``scroll_stream_bytes`` from the catalog's watch: one ledger
        changed (``ledger_id``), or everything may have (None: a fresh listing)."""
        if self._metrics is None or self.catalog is None:
            return
        from .compaction import is_data_ledger

        gauge = self._metrics["stream_bytes"]
        ids = list(self._gauged) + [m.ledger_id for m in self.catalog.metas()] if ledger_id is None else [ledger_id]
        for lid in dict.fromkeys(ids):
            meta = self.catalog.meta(lid)
            old = self._gauged.get(lid)
            if meta is None or is_data_ledger(meta.name):
                if old is not None:
                    with contextlib.suppress(KeyError):
                        gauge.remove(old)
                    del self._gauged[lid]
                continue
            if old is not None and old != meta.name:
                with contextlib.suppress(KeyError):
                    gauge.remove(old)
            self._gauged[lid] = meta.name
            gauge.labels(meta.name).set(self.catalog.stream_bytes(lid))
        self._metrics["streams"].set(len(self._gauged))

    async def start_catalog(self, client) -> bool:
        """Start the watched catalog (one listing, then one watch); False (logged) if the store
        cannot be listed now: the jobs list for themselves meanwhile and the next loop tries again."""
        from ..catalog import StreamCatalog

        catalog = StreamCatalog(client.cluster.store)
        try:
            await catalog.start()
        except Exception as exc:  # noqa: BLE001 - retried by the loop; the platform keeps running
            log.warning("stream catalog: cannot list the metadata store yet: %s", exc)
            return False
        self.catalog = catalog
        catalog.subscribe(self.on_catalog_change)
        self.on_catalog_change(None)
        return True

    def _known(self, wanted) -> tuple[list | None, list[str] | None]:
        """(every ledger record, the streams a job can act on) from the catalog; (None, None) when
        there is no catalog yet (the job lists the store itself)."""
        if self.catalog is None:
            return None, None
        metas = self.catalog.metas()
        return metas, [m.name for m in metas if wanted(m)]

    # ---------------------------------------------------------------- the foreground loop
    def banner(self) -> str:
        c = self.config
        bookies = ", ".join(f"127.0.0.1:{p}" for p in c.bookie_ports)
        bmetrics = ", ".join(f"http://127.0.0.1:{p}/metrics" for p in c.bookie_metrics_ports)
        url = c.metadata_url
        metadata = url
        if c.etcd_auth:  # never print the password: say where it is
            pw_file = etcd_password_file(self.dir)
            metadata = f"{redact_url(self.cluster.metadata_url)}  (etcd auth on; root's password in {pw_file})"
            url = f"etcd://root:' + open('{pw_file}').read().strip() + '@127.0.0.1:{c.etcd_port}"
        if self.secure is not None:
            return self._secure_banner(bookies, bmetrics)
        return "\n".join([
            f"{READY_LINE}  (data in {self.dir}; Ctrl-C stops everything)",
            f"  metadata (etcd)  {metadata}",
            f"  bookies          {bookies}",
            f"  kafka            127.0.0.1:{c.kafka_port}",
            self._console_line(),
            f"  metrics          http://127.0.0.1:{c.metrics_port}/metrics  (bookies: {bmetrics}; Kafka "
            f"consumer group lag: http://127.0.0.1:{c.kafka_metrics_port}/metrics)",
            f"  retention        every {c.retention_interval_s:g} s  (scroll retention run --dry-run to preview)",
            f"  compaction       every {c.compaction_interval_s:g} s  (scroll compaction run --dry-run to preview)",
            *self._tier_lines(),
            self._autorecovery_line(),
            f"  logs             {self.dir}/*/*.log",
            "try it:",
            f"  echo hello | kcat -b 127.0.0.1:{c.kafka_port} -t greetings -P && "
            f"kcat -b 127.0.0.1:{c.kafka_port} -t greetings -C -e",
            f"  .venv/bin/python -c \"import streams.sync as s; c = s.connect('{url}'); "
            "print([(r.offset, r.value) for r in c.consumer('greetings').read(10)])\"",
        ])

    def _autorecovery_line(self) -> str:
        if not self.config.autorecovery:
            return "  autorecovery     off (--no-autorecovery): scroll check --fix re-replicates by hand"
        return (f"  autorecovery     a lost bookie's fragments re-replicated after {self.config.lost_bookie_delay_s:g} s "
                "(scroll autorecovery status)")

    def _tier_lines(self) -> list[str]:
        if self.seaweed is None:
            return ["  object store     off (--no-object-store): nothing is offloaded"]
        auth = f"signed requests; key in {self.seaweed.credentials_file}" if self.seaweed.credentials else \
            "anonymous, loopback only"
        when = "running" if self._object_store_up else "starts on demand: when a topic turns remote storage on"
        return [f"  object store     {self.seaweed.endpoint} bucket {self.seaweed.bucket}  (SeaweedFS, {when}; {auth})",
                f"  offload          every {self.config.tier_interval_s:g} s for topics with "
                "remote.storage.enable=true  (scroll tier run --dry-run to preview)"]

    def _secure_banner(self, bookies: str, bmetrics: str) -> str:
        c, s = self.config, self.secure
        kp, sp = s.kafka_properties, s.scroll_properties
        return "\n".join([
            f"{READY_LINE}  (secure; data in {self.dir}; Ctrl-C stops everything)",
            f"  metadata (etcd)  {redact_url(self.cluster.metadata_url)}  (TLS, auth on; the full URL is in {sp})",
            f"  bookies          {bookies}  (TLS, token required)",
            f"  kafka            SASL_SSL 127.0.0.1:{c.kafka_port}  (user {ADMIN_USER}, a super user; ACLs on)",
            self._console_line(),
            f"  client settings  {kp} (Kafka), {sp} (streams API, Spark)  - both mode 0600",
            f"  CA certificate   {s.pki.ca}",
            f"  metrics          http://127.0.0.1:{c.metrics_port}/metrics  (bookies: {bmetrics}; Kafka "
            f"consumer group lag: http://127.0.0.1:{c.kafka_metrics_port}/metrics)",
            f"  retention        every {c.retention_interval_s:g} s",
            f"  compaction       every {c.compaction_interval_s:g} s",
            *self._tier_lines(),
            self._autorecovery_line(),
            f"  logs             {self.dir}/*/*.log",
            "try it:",
            f"  echo hello | kcat -F {kp} -t greetings -P && kcat -F {kp} -t greetings -C -e",
            f"  .venv/bin/python -c \"import streams.sync as s; c = s.connect_properties('{sp}'); "
            "print([(r.offset, r.value) for r in c.consumer('greetings').read(10)])\"",
            f"  Spark: spark.read.format('scroll').options(**read_client_properties('{sp}'))"
            ".option('topics', 'greetings').load()   # from fragments.security import read_client_properties",
            f"  scroll kafka groups list --command-config {kp}",
        ])

    async def run_forever(self, stop: asyncio.Event) -> None:
        from ..client import connect

        client = await connect(self.cluster.metadata_url, security=self.cluster.client_security)
        next_retention = time.monotonic() + min(10.0, self.config.retention_interval_s)
        next_compaction = time.monotonic() + min(10.0, self.config.compaction_interval_s)
        next_tier = time.monotonic() + min(10.0, self.config.tier_interval_s)
        next_bookie_metrics = next_catalog_try = 0.0
        backoff_until = 0.0
        recovery = None
        if self.config.autorecovery:
            from .autorecovery import AutoRecovery, AutoRecoveryConfig

            self.autorecovery = AutoRecovery(client, AutoRecoveryConfig(
                lost_bookie_delay_s=self.config.lost_bookie_delay_s, lease_ttl_s=self.config.autorecovery_lease_ttl_s),
                registry=self._registry)
            recovery = asyncio.create_task(self.autorecovery.run(stop), name="autorecovery")
        self._wake = asyncio.Event()
        stop_waiter = asyncio.create_task(self._wake_on(stop), name="standalone stop")
        try:
            while not stop.is_set():
                self._wake.clear()
                now = time.monotonic()
                if now >= backoff_until and self.config.restart_children and not self.children_alive():
                    # a restart waits for the child: in a thread (an idle check costs no thread hop)
                    restarted = await asyncio.to_thread(self.supervise_once)
                    if restarted:
                        backoff_until = now + 2.0
                self.update_process_metrics()
                if self.catalog is None and now >= next_catalog_try:
                    next_catalog_try = now + 5.0
                    await self.start_catalog(client)
                if now >= next_bookie_metrics:
                    next_bookie_metrics = now + 10.0
                    try:
                        await self.update_bookie_metrics(client)
                    except Exception as exc:  # noqa: BLE001 - metrics must never stop the platform
                        log.debug("bookie metrics: %s", exc)
                if now >= next_retention:
                    next_retention = now + self.config.retention_interval_s
                    await self.retention_once(client)
                if now >= next_compaction:
                    next_compaction = now + self.config.compaction_interval_s
                    await self.compaction_once(client)
                if self.seaweed is not None and now >= next_tier:
                    next_tier = now + self.config.tier_interval_s
                    await self.tier_once(client)
                # asleep until the next job is due, a child exits (its pidfd) or stop is set
                due = [next_retention, next_compaction, next_bookie_metrics]
                if self.seaweed is not None:
                    due.append(next_tier)
                if self.catalog is None:
                    due.append(next_catalog_try)
                if self.config.restart_children and not self.children_alive():
                    due.append(max(backoff_until, now + 0.5))
                if not self._watch_children():
                    due.append(now + CHILD_POLL_S)  # no pidfds here: poll the children
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), max(0.0, min(due) - time.monotonic()))
        finally:
            stop_waiter.cancel()
            self._unwatch_children()
            starting = self._object_store_starting
            if starting is not None:  # stop it: the start's thread then fails fast, and is waited for
                self.seaweed.stop()
                with contextlib.suppress(Exception):
                    await starting
            if recovery is not None:
                if not recovery.done():
                    recovery.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await recovery
            catalog, self.catalog = self.catalog, None
            if catalog is not None:
                await catalog.close()
            with contextlib.suppress(Exception):
                await client.close()

    async def _wake_on(self, stop: asyncio.Event) -> None:
        await stop.wait()
        self._wake.set()

    def _supervised(self) -> list[Proc]:
        """The children the loop restarts when they die."""
        return [p for p in [self.cluster.etcd, *self.cluster.bookies, self.kafka, self.console,
                            self.seaweed.proc if self._object_store_up else None] if p is not None]

    def _watch_children(self) -> bool:
        """A pidfd (``os.pidfd_open``) on the event loop for every running child, so the loop sleeps
        until one exits instead of polling them; False where pidfds are not available (the loop then
        polls every CHILD_POLL_S)."""
        if self._pidfds is None:
            return False
        loop = asyncio.get_running_loop()
        running = {p.popen.pid for p in self._supervised() if p.popen is not None and p.popen.returncode is None}
        for pid in [pid for pid in self._pidfds if pid not in running]:
            self._child_gone(pid, wake=False)
        for pid in running - self._pidfds.keys():
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:  # exited and reaped meanwhile: look again now
                self._wake.set()
                continue
            except (AttributeError, OSError) as exc:  # no pidfd_open (kernel < 5.3, other systems, seccomp)
                log.debug("no pidfds (%s): polling the children every %g s", exc, CHILD_POLL_S)
                self._unwatch_children()
                self._pidfds = None
                return False
            self._pidfds[pid] = fd
            loop.add_reader(fd, self._child_gone, pid)
        return True

    def _child_gone(self, pid: int, wake: bool = True) -> None:
        fd = self._pidfds.pop(pid, None) if self._pidfds is not None else None
        if fd is not None:
            asyncio.get_running_loop().remove_reader(fd)
            os.close(fd)
        if wake:
            self._wake.set()

    def _unwatch_children(self) -> None:
        for pid in list(self._pidfds or ()):
            self._child_gone(pid, wake=False)

    async def retention_once(self, client) -> None:
        try:
            from .retention import run_retention, wanted
        except ImportError:  # pragma: no cover - the job ships with streams
            return
        _metas, names = self._known(wanted)
        try:
            report = await run_retention(client, names=names)
        except Exception as exc:  # noqa: BLE001 - logged and counted; the next run retries
            log.warning("retention run failed: %s", exc)
            if self._metrics:
                self._metrics["retention_runs"].labels("failed").inc()
            return
        if self._metrics:
            self._metrics["retention_runs"].labels("ok").inc()
            self._metrics["retention_bytes"].inc(report.bytes)
            self._metrics["retention_fragments"].inc(report.fragments)
        if report.fragments:
            log.info("retention removed %d fragments (%d records in %d entries, %d bytes)", report.fragments,
                     report.records, report.entries, report.bytes)


    async def compaction_once(self, client) -> None:
        from .compaction import run_compaction, wanted

        metas, names = self._known(wanted)
        try:
            report = await run_compaction(client, metas=metas, names=None if names is None else set(names))
        except Exception as exc:  # noqa: BLE001 - logged and counted; the next run retries
            log.warning("compaction run failed: %s", exc)
            if self._metrics:
                self._metrics["compaction_runs"].labels("failed").inc()
            return
        if self._metrics:
            self._metrics["compaction_runs"].labels("ok").inc()
            self._metrics["compaction_bytes"].inc(report.bytes_reclaimed)
            for s in report.streams:
                self._metrics["compaction_dirty"].labels(s.stream).set(s.dirty_ratio)
                if s.lag_ms is not None:
                    self._metrics["compaction_lag"].labels(s.stream).set(s.lag_ms / 1000)
        for s in report.streams:
            if s.rewritten_fragments:
                log.info("compaction of %s: %d fragments rewritten, %d -> %d records, %d bytes reclaimed",
                         s.stream, len(s.rewritten_fragments), s.records_in, s.records_out, s.bytes_reclaimed)


    def _start_object_store_later(self) -> None:
        """Start SeaweedFS off the event loop (a few seconds: the bucket, its fsync setting); the
        offload job runs again at its next interval. A failed start is logged and tried again."""
        if self._object_store_starting is not None:
            return
        log.info("a stream turns remote storage on: starting the object store (SeaweedFS) at %s",
                 self.seaweed.endpoint)

        def done(task: asyncio.Task) -> None:
            self._object_store_starting = None
            exc = None if task.cancelled() else task.exception()
            if exc is not None:
                log.warning("the object store (SeaweedFS) did not start (tried again at the next offload run): "
                            "%s", exc)
                if self._metrics:
                    self._metrics["tier_runs"].labels("failed").inc()
            elif not task.cancelled():
                log.info("the object store (SeaweedFS) runs at %s", self.seaweed.endpoint)

        self._object_store_starting = asyncio.create_task(asyncio.to_thread(self._start_seaweed, 60.0),
                                                          name="object store start")
        self._object_store_starting.add_done_callback(done)

    async def tier_once(self, client) -> None:
        from ..tier.objstore import ObjectStore
        from .tier import TierReport, load_tier_config, run_tier, wanted

        metas, names = self._known(wanted)
        if self.seaweed is not None and not self._object_store_up:
            if metas is not None and any(_remote_storage_on(m) for m in metas):
                self._start_object_store_later()
            return  # nothing can be offloaded to it, nor swept from it, before it runs
        self._tier_runs += 1
        # the sweep lists every object: once per SWEEP_EVERY_S (its grace is longer anyway)
        sweep = self._tier_runs == 1 or self._tier_runs * self.config.tier_interval_s % SWEEP_EVERY_S < \
            self.config.tier_interval_s
        try:
            if names == [] and not sweep:
                report = TierReport([], False)  # nothing to offload: no store client, no listing
            else:
                # one object store client while its settings hold (building one loads every system
                # CA certificate: ~1,000 files read per run)
                cfg = await load_tier_config(client.cluster.store)
                if cfg is None:
                    self._objects = None
                elif self._objects is None or self._objects[0] != cfg:
                    self._objects = (cfg, ObjectStore(cfg))
                report = await run_tier(client, metas=metas, names=None if names is None else set(names),
                                        sweep_objects=sweep, objects=self._objects and self._objects[1])
        except Exception as exc:  # noqa: BLE001 - logged and counted; the next run retries
            log.warning("offload run failed (bookie copies kept): %s", exc)
            if self._metrics:
                self._metrics["tier_runs"].labels("failed").inc()
            return
        if self._metrics:
            self._metrics["tier_runs"].labels("ok").inc()
            self._metrics["tier_offloaded"].inc(report.bytes_offloaded)
            self._metrics["tier_offloaded_fragments"].inc(sum(len(s.offloaded) + len(s.adopted)
                                                              for s in report.streams))
            self._metrics["tier_released"].inc(sum(s.bytes_released for s in report.streams))
            self._metrics["tier_swept"].inc(len(report.swept))
            for s in report.streams:
                self._metrics["tier_skipped"].labels(s.stream).set(1 if s.skipped else 0)
        for s in report.streams:
            if s.offloaded or s.released:
                log.info("tier of %s: %d fragments offloaded (%d bytes), %d released", s.stream,
                         len(s.offloaded) + len(s.adopted), s.bytes_offloaded, len(s.released))


def _remote_storage_on(meta) -> bool:
    """Whether a stream's policy turns remote storage on (a policy that does not parse: no)."""
    from fragments.tier import InvalidTierPolicy, TierPolicy

    from .compaction import is_data_ledger

    if is_data_ledger(meta.name):
        return False
    try:
        return TierPolicy.from_dict(meta.retention).remote_storage_enable
    except InvalidTierPolicy:
        return False


_SCAN_CONCURRENCY = 32


async def _object_store_needed(store, *, scan_fragments: bool) -> bool:
    """Whether the stored metadata needs the object store running: a stream whose policy turns
    remote storage on, or (``scan_fragments``) a fragment with a tier state (an upload intent or an
    offloaded copy: readers and retention use its object). One listing of the ledger records, and
    with ``scan_fragments`` one fragment listing per ledger (at start only)."""
    from fragments.ledgers import LedgerStore
    from fragments.tier import state

    ledgers = LedgerStore(store)
    metas = await ledgers.list_ledgers()
    if any(_remote_storage_on(m) for m in metas):
        return True
    if not scan_fragments:
        return False
    gate = asyncio.Semaphore(_SCAN_CONCURRENCY)

    async def tiered(lid: int) -> bool:
        async with gate:
            return any(state(f) is not None for f in await ledgers.fragments(lid))

    return any(await asyncio.gather(*(tiered(m.ledger_id) for m in metas)))


def _s3_credentials(path: Path) -> tuple[str, str]:
    """The embedded store's access key: the one kept at ``path`` or a new random one."""
    import json as _json
    import secrets as _secrets

    if path.exists():
        d = _json.loads(path.read_text())
        return d["access_key_id"], d["secret_access_key"]
    creds = ("scroll-" + _secrets.token_hex(6), _secrets.token_urlsafe(24))
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_secret_file(path, _json.dumps({"access_key_id": creds[0], "secret_access_key": creds[1]}))
    return creds


def run(config: StandaloneConfig) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    sa = Standalone(config)
    click.echo(f"starting etcd, {config.bookies} bookies and the Kafka listener (data in {sa.dir}) ...")
    # SIGINT/SIGTERM while starting: stop what started, cleanly.
    stopping = {"now": False}

    def on_signal(signum, frame):  # noqa: ARG001
        stopping["now"] = True
        raise KeyboardInterrupt

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        sa.start()
        sa.start_metrics()
        sa.warm_jobs()
    except KeyboardInterrupt:
        sa.stop()
        click.echo("stopped")
        return
    except ClusterError as exc:
        sa.stop()
        raise click.ClickException(str(exc)) from exc
    finally:
        for s, h in old.items():
            signal.signal(s, h)

    click.echo(sa.banner())
    sys.stdout.flush()

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for s in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(s, stop.set)
        loop.add_signal_handler(signal.SIGHUP, sa.reload_certificates)
        await sa.run_forever(stop)

    try:
        aioloop.run(main())
    finally:
        click.echo("stopping the console, the Kafka listener, the bookies and etcd ...")
        sys.stdout.flush()
        sa.stop()
        click.echo("stopped; data kept in " + str(sa.dir))


@click.command("standalone")
@click.option("--data-dir", default="scroll-data", show_default=True, type=click.Path(file_okay=False, path_type=Path),
              help="Everything lives here (etcd/, bookie-N/, kafka/); starting again keeps the data.")
@click.option("--kafka-port", default=9092, show_default=True, type=click.IntRange(1, 65535))
@click.option("--etcd-port", default=2379, show_default=True, type=click.IntRange(1, 65535))
@click.option("--etcd-peer-port", default=2380, show_default=True, type=click.IntRange(1, 65535))
@click.option("--bookie-port", "bookie_base_port", default=3181, show_default=True, type=click.IntRange(1, 65535),
              help="First bookie's port; the others take the next ones.")
@click.option("--metrics-port", default=9404, show_default=True, type=click.IntRange(1, 65535),
              help="Metrics endpoint; the bookies' endpoints, then the Kafka listener's, take the next ports.")
@click.option("--bookies", default=3, show_default=True, type=click.IntRange(1, 9))
@click.option("--retention-interval", "retention_interval_s", default=300.0, show_default=True, type=float,
              help="Seconds between retention runs.")
@click.option("--compaction-interval", "compaction_interval_s", default=60.0, show_default=True, type=float,
              help="Seconds between compaction runs (streams whose cleanup.policy compacts, when due).")
@click.option("--tier-interval", "tier_interval_s", default=60.0, show_default=True, type=float,
              help="Seconds between offload runs (streams with remote storage on).")
@click.option("--object-store/--no-object-store", default=True, show_default=True,
              help="Run the embedded S3 server (SeaweedFS, loopback) and offload sealed fragments to it.")
@click.option("--object-store-port", default=8333, show_default=True, type=click.IntRange(1, 65528),
              help="The embedded S3 server's port; its other components take the next 7 ports.")
@click.option("--default-partitions", default=1, show_default=True, type=click.IntRange(1, 1000),
              help="Partitions of a Kafka topic created on first use.")
@click.option("--secure", is_flag=True,
              help="TLS and authentication everywhere: a local CA under <data-dir>/pki, etcd with TLS and auth, "
                   "bookies with TLS and a token, Kafka as SASL_SSL with ACLs and an admin user; client settings in "
                   "<data-dir>/client.properties (kcat -F) and <data-dir>/scroll-client.properties.")
@click.option("--etcd-auth", is_flag=True,
              help="Run etcd with its auth on (user root, a random password kept in <data-dir>/etcd/root.password).")
@click.option("--autorecovery/--no-autorecovery", default=True, show_default=True,
              help="Re-replicate the fragments of a bookie that stays gone (scroll autorecovery status).")
@click.option("--lost-bookie-delay", "lost_bookie_delay_s", default=30.0, show_default=True,
              type=click.FloatRange(0), help="Seconds a bookie must be gone before autorecovery re-replicates.")
@click.option("--registration-ttl", "registration_ttl_s", default=30.0, show_default=True,
              type=click.FloatRange(1.0, 300.0),
              help="Lease TTL (s) of the bookies' registrations and of autorecovery: a hung bookie stays in the "
                   "live set this long (a dead one is restarted and registers again at once).")
@click.option("--console-port", default=9400, show_default=True, type=click.IntRange(1, 65535),
              help="The web console's port (its URL is printed at start).")
@click.option("--no-console", is_flag=True, help="Do not run the web console.")
def standalone_command(data_dir: Path, kafka_port: int, etcd_port: int, etcd_peer_port: int, bookie_base_port: int,
                       metrics_port: int, bookies: int, retention_interval_s: float, compaction_interval_s: float,
                       tier_interval_s: float, object_store: bool, object_store_port: int,
                       default_partitions: int, secure: bool, etcd_auth: bool, autorecovery: bool = True,
                       lost_bookie_delay_s: float = 30.0, console_port: int = 9400, no_console: bool = False,
                       registration_ttl_s: float = 30.0) -> None:
    """Run a whole local platform in the foreground: etcd, bookies, the Kafka listener on
    127.0.0.1:9092, scheduled retention and a metrics endpoint. Ctrl-C stops everything.

    \b
    Examples:
      scroll standalone
      scroll standalone --data-dir /var/lib/scroll --kafka-port 19092
      scroll standalone --secure
      scroll standalone --etcd-auth
    """
    if retention_interval_s <= 0:
        raise click.BadParameter("must be > 0", param_hint="--retention-interval")
    if compaction_interval_s <= 0:
        raise click.BadParameter("must be > 0", param_hint="--compaction-interval")
    if tier_interval_s <= 0:
        raise click.BadParameter("must be > 0", param_hint="--tier-interval")
    run(StandaloneConfig(data_dir=data_dir, kafka_port=kafka_port, etcd_port=etcd_port, etcd_peer_port=etcd_peer_port,
                         bookie_base_port=bookie_base_port, metrics_port=metrics_port, bookies=bookies,
                         retention_interval_s=retention_interval_s, compaction_interval_s=compaction_interval_s,
                         tier_interval_s=tier_interval_s, object_store=object_store,
                         object_store_port=object_store_port, default_partitions=default_partitions,
                         etcd_auth=etcd_auth, secure=secure, autorecovery=autorecovery,
                         lost_bookie_delay_s=lost_bookie_delay_s, console=not no_console, console_port=console_port,
                         registration_ttl_s=registration_ttl_s, autorecovery_lease_ttl_s=registration_ttl_s))

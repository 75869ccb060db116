"""A local cluster of real processes: one etcd server and N bookies, all on 127.0.0.1.

Used by ``scroll standalone`` and by the end-to-end tests. Every process it starts is stopped by
``stop()`` (SIGTERM, then SIGKILL after a grace period). Data lives under one directory:
``<dir>/etcd`` and ``<dir>/bookie-<i>``; starting again on the same directory keeps the data.
Bookies keep their id and port across restarts, so the fragments that name them still find them.

etcd security (off by default): ``etcd_password=`` turns etcd's auth on (a ``root`` user with that
password, created through etcd's own gRPC Auth API, then ``AuthEnable``), and ``etcd_tls=`` (an
``EtcdTLSFiles``) makes etcd serve TLS with the given certificate (and, with client files,
require client certificates). ``metadata_url`` then carries the credentials
(``etcds://root:<password>@127.0.0.1:<port>?ca=...``), and the bookies get it (through the
``SCROLL_METADATA`` environment variable: never on a command line).

``secure_bookies`` starts the bookies secured: ``"token"`` (or True) puts both their ports on TLS
and requires a token; ``"mtls"`` also requires client certificates. The CA (``bookie_ca``, a
``trustme.CA`` or a ``tools.pki.LocalPki``; else a ``LocalPki`` under ``<dir>/security``), the
bookies' certificate, a client certificate and the token file are written under ``<dir>/security``
(kept across restarts); ``client_security`` is the ``ClientSecurity`` a client passes to
``streams.connect(..., security=...)``.
"""

from __future__ import annotations

import collections
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path


class ClusterError(RuntimeError):
    pass


_PORTS_FROM = 26000  # free_port's ports; tests' port blocks take 20000-25999 (tests/ports.py)
_HANDED_OUT: collections.deque = collections.deque(maxlen=4000)  # recent free_port answers, this process
_HANDED_LOCK = threading.Lock()


def _ephemeral_low() -> int:
    """The first port the kernel hands out to outgoing connections (32768 by default)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A loopback port free now, for a server started a little later. Taken below the kernel's
    ephemeral range when there is room: a port the kernel handed out (bind to 0) can be taken
    meanwhile as the local port of an outgoing connection, and the server then fails to bind (seen
    in CI). Not one this process handed out lately (it may not be bound yet)."""
    hi = _ephemeral_low()
    if hi - _PORTS_FROM >= 2000:
        with _HANDED_LOCK:
            for _ in range(200):
                port = random.randrange(_PORTS_FROM, hi)
                if port in _HANDED_OUT:
                    continue
                with socket.socket() as s:
                    try:
                        s.bind(("127.0.0.1", port))
                    except OSError:
                        continue
                _HANDED_OUT.append(port)
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def find_etcd() -> str:
    for cand in (os.environ.get("SCROLL_ETCD"), shutil.which("etcd"), "/usr/bin/etcd"):
        if cand and os.path.exists(cand):
            return cand
    raise ClusterError("no etcd server binary found: install etcd-server (make setup does) or set SCROLL_ETCD")


def _wait_port(port: int, proc: subprocess.Popen, what: str, timeout_s: float, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ClusterError(f"{what} exited with {proc.returncode}; see {log}:\n{_tail(log)}")
        with socket.socket() as s:
            s.settimeout(0.2)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise ClusterError(f"{what} not listening on 127.0.0.1:{port} after {timeout_s}s; see {log}:\n{_tail(log)}")


def _tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


@dataclass(frozen=True)
class EtcdTLSFiles:
    """PEM files for an etcd that serves TLS: its certificate and key, the CA that signed it
    (clients verify etcd with it), and optionally a client certificate and key: then etcd runs
    with ``--client-cert-auth --trusted-ca-file ca`` and clients present that certificate."""

    cert: str
    key: str
    ca: str
    client_cert: str | None = None
    client_key: str | None = None


ETCD_ROOT = "root"


@dataclass
class Proc:
    name: str
    args: list[str]
    port: int
    log: Path
    popen: subprocess.Popen | None = None
    extra: dict = field(default_factory=dict)
    log_offset: int = 0  # where this incarnation's output starts in the (appended) log
    parent_death_signal: bool = False  # not one of our Python servers (they watch SCROLL_PARENT_PID)

    def start(self, env: dict | None = None) -> None:
        """Start it in a session of its own (a terminal's Ctrl-C reaches only our process, which
        stops the children in order), but tied to us: it stops if we die, even by SIGKILL. Our
        Python servers watch ``SCROLL_PARENT_PID``; other programs (etcd) get a parent-death signal
        through ``setpriv`` when we fork from the main thread (the signal follows the forking
        thread, and a worker thread may end before we do)."""
        self.log.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ if env is None else env)
        env["SCROLL_PARENT_PID"] = str(os.getpid())
        args = list(self.args)
        setpriv = shutil.which("setpriv")
        if self.parent_death_signal and setpriv and threading.current_thread() is threading.main_thread():
            args = [setpriv, "--pdeathsig", "TERM", "--", *args]
        out = open(self.log, "ab")
        self.log_offset = out.tell()
        self.popen = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        out.close()

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive:
            os.kill(self.popen.pid, sig)

    def output(self) -> str:
        """What this incarnation has written to its log so far (a restart appends to the same file,
        so an earlier run's "ready" line must not count)."""
        try:
            with open(self.log, "rb") as f:
                f.seek(self.log_offset)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def stop(self, grace_s: float = 10.0) -> None:
        if not self.alive:
            return
        self.popen.send_signal(signal.SIGTERM)
        try:
            self.popen.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(5)

    def kill(self) -> None:
        if self.alive:
            self.popen.kill()
            self.popen.wait(5)


class LocalCluster:
    def __init__(self, data_dir: str | Path, bookies: int = 3, *, etcd_port: int | None = None,
                 bookie_ports: list[int] | None = None, python: str | None = None, bookie_args: list[str] | None = None,
                 etcd_peer_port: int | None = None, bookie_metrics_ports: list[int] | None = None,
                 etcd_password: str | None = None, etcd_tls: EtcdTLSFiles | None = None,
                 etcd_auth_token_ttl: int | None = None, etcd_args: list[str] | None = None,
                 secure_bookies: bool | str = False, bookie_ca=None, etcd_compaction_retention: str = "1h"):
        self.dir = Path(data_dir).resolve()
        self.n = bookies
        self.python = python or sys.executable
        self.etcd_port = etcd_port or free_port()
        self.etcd_peer_port = etcd_peer_port or free_port()
        self.bookie_ports = bookie_ports or [free_port() for _ in range(bookies)]
        self.bookie_metrics_ports = bookie_metrics_ports
        self.bookie_args = bookie_args or []
        self.etcd_password = etcd_password  # not None: etcd runs with auth on, user "root"
        self.etcd_tls = etcd_tls
        self.etcd_auth_token_ttl = etcd_auth_token_ttl  # etcd's --auth-token-ttl (s); tests shorten it
        self.etcd_args = etcd_args or []
        # etcd keeps every revision of every key until compacted; each compare-and-set leaves one, so
        # without compaction its db grows until the 2 GiB quota refuses every write (NOSPACE). A
        # watch that resumes from a compacted revision lists again (fragments.etcdstore).
        self.etcd_compaction_retention = etcd_compaction_retention
        self.etcd: Proc | None = None
        self.bookies: list[Proc] = []
        mode = "token" if secure_bookies is True else (secure_bookies or None)
        if mode not in (None, "token", "mtls"):
            raise ValueError(f"secure_bookies must be False, True, 'token' or 'mtls', not {secure_bookies!r}")
        self.secure_bookies = mode
        self.bookie_ca = bookie_ca
        self._client_security = None
        self._security_args: list[str] | None = None

    @property
    def metadata_url(self) -> str:
        """The URL clients use; with auth it carries root's password (redact it before showing:
        ``fragments.security.redact_url``)."""
        scheme = "etcds" if self.etcd_tls else "etcd"
        creds = ""
        if self.etcd_password is not None:
            creds = f"{ETCD_ROOT}:{urllib.parse.quote(self.etcd_password, safe='')}@"
        query = ""
        if self.etcd_tls:
            files = {"ca": self.etcd_tls.ca}
            if self.etcd_tls.client_cert:
                files.update(cert=self.etcd_tls.client_cert, key=self.etcd_tls.client_key)
            query = "?" + urllib.parse.urlencode(files)
        return f"{scheme}://{creds}127.0.0.1:{self.etcd_port}{query}"

    def start(self, timeout_s: float = 30.0, before_bookies=None) -> LocalCluster:
        """etcd, then the bookies (``before_bookies()`` runs in between, etcd up)."""
        try:
            self.start_etcd(timeout_s)
            if before_bookies is not None:
                before_bookies()
            for i in range(self.n):
                self.bookies.append(self._bookie_proc(i))
                self.start_bookie(i, wait=False)
            for i in range(self.n):
                self.wait_bookie(i, timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def start_etcd(self, timeout_s: float = 30.0) -> None:
        d = self.dir / "etcd"
        d.mkdir(parents=True, exist_ok=True)
        tls = self.etcd_tls
        url = f"{'https' if tls else 'http'}://127.0.0.1:{self.etcd_port}"
        peer = f"http://127.0.0.1:{self.etcd_peer_port}"
        args = [find_etcd(), "--name", "scroll", "--data-dir", str(d / "data"),
                "--listen-client-urls", url, "--advertise-client-urls", url,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"scroll={peer}", "--log-level", "warn",
                "--auto-compaction-mode", "periodic", "--auto-compaction-retention", self.etcd_compaction_retention]
        if tls:
            args += ["--cert-file", tls.cert, "--key-file", tls.key]
            if tls.client_cert:
                args += ["--client-cert-auth", "--trusted-ca-file", tls.ca]
        if self.etcd_auth_token_ttl is not None:
            args += ["--auth-token-ttl", str(self.etcd_auth_token_ttl)]
        args += self.etcd_args
        self.etcd = Proc("etcd", args, self.etcd_port, d / "etcd.log", parent_death_signal=True)
        self.etcd.start()
        _wait_port(self.etcd_port, self.etcd.popen, "etcd", timeout_s, self.etcd.log)
        if self.etcd_password is not None:
            self._enable_etcd_auth(timeout_s)

    def _etcd_channel(self):
        import grpc

        target = f"127.0.0.1:{self.etcd_port}"
        tls = self.etcd_tls
        if not tls:
            return grpc.insecure_channel(target)
        read = lambda p: None if p is None else Path(p).read_bytes()  # noqa: E731
        creds = grpc.ssl_channel_credentials(read(tls.ca), read(tls.client_key), read(tls.client_cert))
        return grpc.secure_channel(target, creds)

    def _enable_etcd_auth(self, timeout_s: float) -> None:
        """Create ``root`` with ``etcd_password`` and turn auth on, through etcd's gRPC Auth API
        (what ``etcdctl user add root; etcdctl auth enable`` do; etcdctl is often not installed).
        On a data directory where auth is already on, only checks that the password works."""
        import grpc
        from aetcd import rpc

        password = self.etcd_password
        deadline = time.monotonic() + timeout_s
        with self._etcd_channel() as channel:
            auth = rpc.AuthStub(channel)
            while True:
                try:
                    auth.Authenticate(rpc.AuthenticateRequest(name=ETCD_ROOT, password=password), timeout=5)
                    return  # auth is already on (a restart) and the password is right
                except grpc.RpcError as e:
                    detail = e.details() or ""
                    if "authentication is not enabled" in detail:
                        break
                    if "authentication failed" in detail:
                        raise ClusterError(f"etcd in {self.dir / 'etcd'} already has auth on with another root "
                                           "password") from None
                    if time.monotonic() > deadline:
                        raise ClusterError(f"etcd did not answer to enable auth: {e.code().name}: {detail}; "
                                           f"see {self.etcd.log}:\n{_tail(self.etcd.log)}") from None
                    time.sleep(0.1)  # not ready yet (no leader)
            try:
                auth.UserAdd(rpc.AuthUserAddRequest(name=ETCD_ROOT, password=password), timeout=5)
            except grpc.RpcError as e:
                if "user name already exists" not in (e.details() or ""):
                    raise
                auth.UserChangePassword(rpc.AuthUserChangePasswordRequest(name=ETCD_ROOT, password=password),
                                        timeout=5)
            auth.UserGrantRole(rpc.AuthUserGrantRoleRequest(user=ETCD_ROOT, role="root"), timeout=5)
            auth.AuthEnable(rpc.AuthEnableRequest(), timeout=5)

    def _bookie_proc(self, i: int) -> Proc:
        port = self.bookie_ports[i]
        d = self.dir / f"bookie-{i}"
        args = [self.python, "-m", "streams.tools.cli", "bookie", "--data-dir", str(d), "--port", str(port),
                "--bookie-id", f"bookie-{i}", "--log-level", "WARNING",
                *self._bookie_security_args(), *self.bookie_args]
        if self.bookie_metrics_ports:
            args += ["--metrics-port", str(self.bookie_metrics_ports[i])]
        return Proc(f"bookie-{i}", args, port, d / "bookie.log")

    def _bookie_security_args(self) -> list[str]:
        """The secured bookies' flags (none unless ``secure_bookies``); writes the files once."""
        if self.secure_bookies is None:
            return []
        if self._security_args is None:
            from fragments.security import ClientSecurity

            f = write_bookie_security_files(self.dir / "security", self.bookie_ca)
            args = ["--tls-cert", f["bookie_cert"], "--tls-key", f["bookie_key"], "--auth-token-file", f["tokens"]]
            client = {"tls_ca": f["ca"], "token": Path(f["token"]).read_text().strip()}
            if self.secure_bookies == "mtls":
                args += ["--tls-client-ca", f["ca"], "--tls-client-auth", "required"]
                client.update(tls_cert=f["client_cert"], tls_key=f["client_key"])
            self._security_args = args
            self._client_security = ClientSecurity(**client)
        return self._security_args

    @property
    def client_security(self):
        """The ``ClientSecurity`` for this cluster's bookies (None unless ``secure_bookies``)."""
        self._bookie_security_args()
        return self._client_security

    def start_bookie(self, i: int, wait: bool = True, timeout_s: float = 30.0) -> None:
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
        env["SCROLL_METADATA"] = self.metadata_url  # it may carry etcd's password: not on the command line
        self.bookies[i].start(env)
        if wait:
            self.wait_bookie(i, timeout_s)

    def wait_bookie(self, i: int, timeout_s: float = 30.0) -> None:
        b = self.bookies[i]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not b.alive:
                raise ClusterError(f"{b.name} exited with {b.popen.returncode}; see {b.log}:\n{_tail(b.log)}")
            out = b.output()
            if "bookie ready" in out and "registered" in out:
                return
            time.sleep(0.05)
        raise ClusterError(f"{b.name} not ready after {timeout_s}s; see {b.log}:\n{_tail(b.log)}")

    def kill_bookie(self, i: int) -> None:
        self.bookies[i].kill()

    def stop(self) -> None:
        for b in self.bookies:
            b.stop()
        if self.etcd is not None:
            self.etcd.stop()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def write_bookie_security_files(d: Path, ca=None) -> dict[str, str]:
    """A CA, a bookie certificate for 127.0.0.1 and localhost, a client certificate and a token
    file (mode 600) under ``d``; files already there are kept (a restarted cluster keeps its
    credentials). ``ca``: a ``tools.pki.LocalPki`` whose certificates to use (``scroll standalone
    --secure`` shares one CA for everything), a ``trustme.CA`` (tests), or None: a ``LocalPki`` in
    ``d``. Returns the paths by name."""
    import secrets

    from .pki import LocalPki

    d.mkdir(parents=True, exist_ok=True)
    names = {"ca": "ca.pem", "bookie_cert": "bookie.pem", "bookie_key": "bookie.key", "client_cert": "client.pem",
             "client_key": "client.key", "token": "token", "tokens": "tokens"}
    paths = {k: str(d / v) for k, v in names.items()}
    if ca is None or isinstance(ca, LocalPki):
        pki = (ca or LocalPki(d)).ensure()
        paths.update(ca=str(pki.ca), bookie_cert=str(pki.server_cert), bookie_key=str(pki.server_key),
                     client_cert=str(pki.client_cert), client_key=str(pki.client_key))
    elif not all(Path(paths[k]).is_file() for k in ("ca", "bookie_cert", "bookie_key", "client_cert", "client_key")):
        ca.cert_pem.write_to_path(paths["ca"])  # a trustme.CA (tests)
        server = ca.issue_cert("127.0.0.1", "localhost")
        server.private_key_and_cert_chain_pem.write_to_path(paths["bookie_cert"])
        server.private_key_pem.write_to_path(paths["bookie_key"])
        client = ca.issue_cert("scroll-client")
        client.cert_chain_pems[0].write_to_path(paths["client_cert"])
        client.private_key_pem.write_to_path(paths["client_key"])
        for name in ("bookie_key", "client_key"):
            os.chmod(paths[name], 0o600)
    if not (Path(paths["token"]).is_file() and Path(paths["tokens"]).is_file()):
        token = secrets.token_urlsafe(32)
        for name, text in (("token", token + "\n"), ("tokens", f"# accepted bookie tokens\n{token}\n")):
            fd = os.open(paths[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as fh:
                fh.write(text)
    return paths

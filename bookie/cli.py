"""``scroll bookie``: run one bookie until SIGTERM/SIGINT.

How this works: the options build a validated ``BookieConfig`` (``--set key=value`` overrides any
field, e.g. ``--set min_free_bytes=0``); ``_serve`` opens storage (replaying the journal), binds
gRPC (127.0.0.1 unless ``--host`` says otherwise; ``--port 0`` picks a free port) and the binary
data plane (``--data-port``, any free port by default: clients learn it from Info), optionally starts
the Prometheus endpoint, and prints one readiness line once serving::

    bookie ready id=127.0.0.1:3181 address=127.0.0.1:3181 data_dir=/var/scroll metrics=none data_port=41234

Security (docs/security.md, "Bookies"): ``--tls-cert/--tls-key`` put both ports on TLS;
``--tls-client-ca`` with ``--tls-client-auth requested|required`` adds mutual TLS (a verified client
certificate authenticates its caller); ``--auth-token-file`` lists accepted tokens. With a token file
or required client certificates, unauthenticated callers are refused. Files are read at start;
SIGHUP re-reads the certificate, key and client CA (not the token file): new TLS handshakes on
both ports use them, connected clients carry on, and files that cannot be used are logged at
ERROR while the certificate in use stays (docs/security.md, "Rotating certificates").

On SIGTERM or SIGINT it stops taking calls, lets in-flight calls finish, syncs the journal,
checkpoints and exits 0, printing ``bookie stopped``.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import time
from pathlib import Path

import click

from fragments import aioloop
from fragments.registry import BookieRegistration, register_bookie
from fragments.security import CLIENT_AUTH_MODES, BookieSecurity, SecurityConfigError, redact_url
from fragments.store import MetadataError
from fragments.stores import open_store

from .config import BookieConfig, ConfigError
from .errors import BookieError
from .metrics import BookieMetrics
from .runtime import tune_malloc
from .server import BookieServer

log = logging.getLogger(__name__)


def _parse_overrides(pairs: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"expected KEY=VALUE, got {pair!r}", param_hint="--set")
        out[key.strip()] = value.strip()
    return out


@click.command("bookie")
@click.option("--data-dir", required=True, type=click.Path(file_okay=False, path_type=Path), help="Entry logs and index.")
@click.option("--port", default=3181, show_default=True, type=click.IntRange(0, 65535), help="gRPC port (0: any free port).")
@click.option("--data-port", default=0, show_default=True, type=click.IntRange(0, 65535),
              help="Binary data-plane port for adds and reads (0: any free port; clients learn it from Info).")
@click.option("--journal-dir", type=click.Path(file_okay=False, path_type=Path), help="Journal directory (ideally its own disk).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=None, help="Prometheus endpoint port (on --host).")
@click.option("--bookie-id", default="", help="Name reported in Info (default host:port).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a config field.")
@click.option("--log-level", default="INFO", show_default=True, type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"]))
@click.option("--metadata", default=None, envvar="SCROLL_METADATA",
              help="Register in this metadata store (etcd://host:port) under a lease, so clients find this bookie.")
@click.option("--rack", default="/default-rack", show_default=True, help="Rack or zone label used by placement.")
@click.option("--registration-ttl", default=5.0, show_default=True, type=float,
              help="Lease TTL (s): a dead bookie leaves the live set this long after it stops refreshing.")
@click.option("--tls-cert", type=click.Path(dir_okay=False), default=None,
              help="PEM certificate chain: the gRPC and data ports speak TLS (with --tls-key).")
@click.option("--tls-key", type=click.Path(dir_okay=False), default=None, help="PEM private key of --tls-cert.")
@click.option("--tls-client-ca", type=click.Path(dir_okay=False), default=None,
              help="CA bundle that client certificates must chain to (mutual TLS).")
@click.option("--tls-client-auth", type=click.Choice(CLIENT_AUTH_MODES), default=None,
              help="none | requested | required (default: required with --tls-client-ca, else none).")
@click.option("--auth-token-file", type=click.Path(dir_okay=False), default=None,
              help="Accepted tokens, one per line (a secret: chmod 600): callers must present one "
                   "(or a verified client certificate).")
def bookie_command(
    data_dir: Path, port: int, data_port: int, journal_dir: Path | None, host: str, metrics_port: int | None,
    bookie_id: str, overrides: tuple[str, ...], log_level: str, metadata: str | None, rack: str,
    registration_ttl: float, tls_cert: str | None = None, tls_key: str | None = None, tls_client_ca: str | None = None,
    tls_client_auth: str | None = None, auth_token_file: str | None = None,
) -> None:
    """Run one bookie (storage server)."""
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        config = BookieConfig(data_dir=data_dir, journal_dir=journal_dir, bookie_id=bookie_id)
        config = config.with_overrides(_parse_overrides(overrides))
    except ConfigError as exc:
        raise click.BadParameter(str(exc)) from exc
    try:
        auth = tls_client_auth or ("required" if tls_client_ca else "none")
        security = BookieSecurity(tls_cert=tls_cert, tls_key=tls_key, client_ca=tls_client_ca, client_auth=auth,
                                  token_file=auth_token_file)
        security.server_ssl_context()  # unreadable or mismatched files fail here, with the reason
    except SecurityConfigError as exc:
        raise click.UsageError(str(exc)) from exc
    tune_malloc()
    try:
        aioloop.run(_serve(config, host, port, metrics_port, metadata, rack, registration_ttl, data_port, security))
    except (BookieError, OSError, MetadataError) as exc:
        click.echo(f"bookie failed: {exc}", err=True)
        sys.exit(1)


async def _serve(config: BookieConfig, host: str, port: int, metrics_port: int | None,
                 metadata: str | None = None, rack: str = "/default-rack", ttl_s: float = 5.0,
                 data_port: int = 0, security: BookieSecurity | None = None) -> None:
    metrics = BookieMetrics()
    server = BookieServer(config, host=host, port=port, metrics=metrics, data_port=data_port, security=security)
    await server.start()
    http = None
    if metrics_port is not None:
        http = metrics.serve(metrics_port, host)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, server.reload_certificates)
    shown = f"{host}:{http.server_port}" if http is not None else "none"
    sec = server.security
    secured = ("tls" if sec.tls else "plaintext") + (f" client_auth={sec.client_auth}" if sec.tls else "") \
        + (" auth=required" if sec.auth_required else "")
    click.echo(f"bookie ready id={server.bookie_id} address={server.address} data_dir={config.data_dir} metrics={shown} "
               f"data_port={server.data_port} security={secured.replace(' ', ',')} loop={aioloop.loop_name()}")
    sys.stdout.flush()
    registrar = await _register(server, metadata, rack, ttl_s) if metadata else None
    reporter = asyncio.create_task(_report_space(server, registrar, ttl_s)) if registrar else None
    await stop.wait()
    if registrar is not None:
        reporter.cancel()
        await registrar.close()  # leave the live set first, so clients stop placing new fragments here
    log.info("stopping: draining in-flight calls")
    await server.stop()
    if http is not None:
        http.shutdown()
    click.echo("bookie stopped")
    sys.stdout.flush()


async def _register(server: BookieServer, metadata: str, rack: str, ttl_s: float):
    """Register under a lease and keep the free/used bytes current."""
    store = await open_store(metadata)
    info = server.service.engine
    reg = BookieRegistration(
        server.bookie_id, server.address, rack=rack, free_bytes=info.free_bytes(), started_at=time.time(),
    )
    registrar = await register_bookie(store, reg, ttl_s=ttl_s)
    click.echo(f"bookie registered id={server.bookie_id} in {redact_url(metadata)}")
    sys.stdout.flush()
    return registrar


async def _report_space(server: BookieServer, registrar, interval_s: float) -> None:
    """Keep free/used bytes and the read-only flag in the registration current (placement and
    ``scroll bookies`` read them)."""
    engine = server.service.engine
    while True:
        await asyncio.sleep(interval_s)
        now = dict(free_bytes=engine.free_bytes(), used_bytes=engine.used_bytes(),
                   read_only=engine.read_only_reason is not None)
        if not _space_changed(registrar.registration, now):
            continue  # an idle bookie writes nothing (a put is a raft write and an fsync in etcd)
        try:
            await registrar.update(**now)
        except MetadataError as exc:
            log.warning("could not update the registration: %s", exc)


SPACE_CHANGE_MIN = 1 << 20  # bytes; free/used are published when they moved by this much, or by 1%


def _space_changed(reg, now: dict) -> bool:
    """Whether the registration's space figures are worth a write: the read-only flag changed, or
    free or used bytes moved by at least 1 MiB and 1% (they are shown by ``scroll bookies``)."""
    if reg.read_only != now["read_only"]:
        return True
    for field in ("free_bytes", "used_bytes"):
        old, new = getattr(reg, field), now[field]
        if abs(new - old) >= max(SPACE_CHANGE_MIN, abs(old) // 100):
            return True
    return False

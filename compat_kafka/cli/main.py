"""``scroll kafka``: run the Kafka-protocol shim in front of a Scroll cluster.

Several shims can serve one cluster: each registers as a broker (``--node-id``, unique among live
shims; by default one is allocated from the metadata store) advertising ``--advertised-host`` and
its port, and serves the partitions it owns (see ``compat_kafka.ownership``). ``--lease-ttl`` is how
long a dead shim keeps its partitions before the others take them over. A shim that joins later
gets its share of the partitions: the others hand them over, ``--rebalance-batch`` at a time, once
the live shims have been stable for ``--rebalance-delay`` (``--no-rebalance``: ownership stays
sticky). ``--metrics-port`` serves Prometheus metrics (consumer group lag, ``metrics.py``).
``scroll kafka groups ...`` is the operators' view of consumer groups (``group_cli.py``), a client
of a running listener.
``--sasl-mechanisms`` turns on Kafka SASL (``sasl.py``); ``scroll kafka user add|remove|list``
manages the SCRAM credentials in the metadata store.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
from collections.abc import Callable

import click

from fragments import aioloop

from ..broker import Broker, BrokerConfig
from ..quotas import QuotaConfig
from ..security import sasl
from ..security.acls import parse_super_users
from ..server import KafkaServer, ListenerConfig, ServerConfig, TlsConfig
from .acl_cli import acl_command
from .group_cli import groups_command
from .quota_cli import quotas_command


async def serve(metadata_url: str, server_config: ServerConfig, broker_config: BrokerConfig,
                started: asyncio.Event | None = None, stop: asyncio.Event | None = None,
                on_start: Callable[[KafkaServer], None] | None = None, metrics=None, security=None) -> None:
    """Run until ``stop`` is set (or SIGINT/SIGTERM when it is None; then SIGHUP reloads the TLS
    listeners' certificates); ``on_start`` is given the server once it listens (tests look inside)."""
    from streams.client import connect

    logging.getLogger(__name__).info("Kafka listener node %s: event loop %s", broker_config.node_id,
                                     aioloop.loop_name())
    # security: towards secured bookies; batch_metadata: a first produce to (or a take-over of) many
    # partitions sends its metadata reads and compare-and-sets together (fragments/batching.py)
    client = await connect(metadata_url, security=security, batch_metadata=True)
    server = KafkaServer(Broker(client, broker_config), server_config)
    try:
        await server.start()
        if metrics is not None:
            await _point_metrics(metrics, server)
        if on_start is not None:
            on_start(server)
        if stop is None:
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                with contextlib.suppress(NotImplementedError):
                    loop.add_signal_handler(sig, stop.set)
            with contextlib.suppress(NotImplementedError):  # SIGHUP: new handshakes use the re-read certificates
                loop.add_signal_handler(signal.SIGHUP, server.reload_certificates)
        if started is not None:
            started.set()
        await stop.wait()
    finally:
        await server.stop()
        await client.close()


def _bookie_security():
    """The bookie credentials of ``scroll``'s global options (``--tls-ca``, ``--token-file``, ... or
    ``SCROLL_TLS_CA``, ``SCROLL_TOKEN_FILE``, ...), None without any."""
    from streams.tools.cli import _security

    return _security()


async def _point_metrics(metrics, server: KafkaServer) -> None:
    """The lag metrics scrape this listener over Kafka: through a PLAINTEXT listener if there is
    one, else as the brokers' own identity over the first listener (interbroker.py)."""
    metrics.overload.server = server  # connection limits, quota throttling, produce backpressure
    ports = server.ports
    listeners = server.config.listeners
    li = next((li for li in listeners if li.protocol == "PLAINTEXT"), listeners[0])
    host = "127.0.0.1" if li.host in ("0.0.0.0", "::", "") else li.host
    security = None
    if li.protocol != "PLAINTEXT":
        try:
            security = await server.broker.inter_broker.client_config(li.protocol)
        except Exception as exc:  # noqa: BLE001 - metrics must not stop the listener
            logging.getLogger(__name__).warning("group lag metrics are off: %s", exc)
            return
    metrics.use(f"{host}:{ports[li.name]}", security)


@click.group("kafka", invoke_without_command=True)
@click.option("--metadata", "metadata_url", default=None, envvar="SCROLL_METADATA",
              help="metadata store URL, e.g. etcd://127.0.0.1:2379 (or SCROLL_METADATA: keeps a password "
                   "off the command line)")
@click.option("--host", default="127.0.0.1", show_default=True, help="address to listen on")
@click.option("--port", default=9092, show_default=True, type=click.IntRange(1, 65535))
@click.option("--advertised-host", default="127.0.0.1", show_default=True,
              help="host name clients are told to connect to (in Metadata and FindCoordinator)")
@click.option("--node-id", default=None, type=click.IntRange(0, 2**31 - 1),
              help="broker node id, unique among live shims [default: allocate one]")
@click.option("--lease-ttl", default=10.0, show_default=True, type=click.FloatRange(1.0, 300.0),
              help="seconds: registration/ownership lease; a dead shim's partitions move after it")
@click.option("--no-rebalance", is_flag=True,
              help="keep partitions where they are when listeners join (by default a listener hands the partitions "
                   "that now prefer another live listener over to it)")
@click.option("--rebalance-batch", default=8, show_default=True, type=click.IntRange(1, 10_000),
              help="partitions a listener hands over at once when rebalancing")
@click.option("--rebalance-delay", default=3.0, show_default=True, type=click.FloatRange(0.0, 3600.0),
              help="seconds the live listeners must stay unchanged before partitions move")
@click.option("--test-drop-produce-response-every", default=0, hidden=True, type=click.IntRange(0),
              help="test-only fault injection: drop the connection instead of answering every Nth idempotent produce")
@click.option("--default-partitions", default=1, show_default=True, type=click.IntRange(1, 1000),
              help="partitions of an auto-created topic (and of CreateTopics with -1)")
@click.option("--no-auto-create", is_flag=True, help="do not create unknown topics on Metadata requests")
@click.option("--max-frame-bytes", default=64 << 20, show_default=True, type=click.IntRange(1024, 1 << 30))
@click.option("--metrics-port", default=None, type=click.IntRange(1, 65535),
              help="serve Prometheus metrics (consumer group lag) over HTTP on this port [default: none]")
@click.option("--metrics-host", default="127.0.0.1", show_default=True, help="address of the metrics endpoint")
@click.option("--no-fetch-sessions", is_flag=True, help="decline KIP-227 incremental fetch sessions")
@click.option("--ssl-cert", default=None, type=click.Path(dir_okay=False),
              help="PEM certificate chain: the listener speaks TLS (Kafka's SSL security protocol)")
@click.option("--ssl-key", default=None, type=click.Path(dir_okay=False), help="PEM private key of --ssl-cert")
@click.option("--ssl-client-ca", default=None, type=click.Path(dir_okay=False),
              help="PEM CA bundle that signs accepted client certificates")
@click.option("--ssl-client-auth", type=click.Choice(["none", "requested", "required"]), default="none",
              show_default=True, help="required: mutual TLS, a client without a trusted certificate is refused")
@click.option("--sasl-mechanisms", default=None,
              help="turn on SASL: comma-separated PLAIN,SCRAM-SHA-256,SCRAM-SHA-512 (users: `scroll kafka user add`)")
@click.option("--listener", "listeners", multiple=True, metavar="PROTOCOL://HOST:PORT",
              help="a listener (repeatable; PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL), e.g. --listener "
                   "PLAINTEXT://127.0.0.1:9092 --listener SASL_SSL://127.0.0.1:9093; SSL ones use --ssl-*, SASL "
                   "ones --sasl-mechanisms [default: one on --host/--port, its protocol from --ssl-cert/--sasl-mechanisms]")
@click.option("--inter-broker-ca", default=None, type=click.Path(dir_okay=False),
              help="PEM CA that issued the other listeners' certificates, to call them over SSL (transaction "
                   "markers) when they have no PLAINTEXT listener [default: --ssl-client-ca]")
@click.option("--acls", is_flag=True, help="enforce Kafka ACLs (CreateAcls/DeleteAcls; without any, only super users)")
@click.option("--super-users", default="", help="principals that bypass the ACLs, e.g. 'User:admin;User:ops'")
@click.option("--connections-max-reauth-ms", default=0, show_default=True, type=click.IntRange(0),
              help="KIP-368: SASL sessions last this long; a connection not re-authenticated is closed (0: off)")
@click.option("--max-connections", default=1000, show_default=True, type=click.IntRange(1),
              help="connections per listener; more are closed at once (Kafka's max.connections)")
@click.option("--max-connections-per-ip", default=0, show_default=True, type=click.IntRange(0),
              help="connections per client address; more are closed at once (0: no limit)")
@click.option("--max-connections-per-ip-overrides", default="", metavar="IP:N,...",
              help="per-address limits overriding --max-connections-per-ip, e.g. 10.0.0.5:500,127.0.0.1:0")
@click.option("--max-inflight-produce-bytes", default=256 << 20, show_default=True, type=click.IntRange(0),
              help="produce request bytes read and not yet answered, all connections together; further produces "
                   "wait (backpressure). 0: no limit")
@click.option("--quota-window-num", default=11, show_default=True, type=click.IntRange(2, 1000),
              help="client quotas: samples in a rate window (Kafka's quota.window.num)")
@click.option("--quota-window-size", default=1.0, show_default=True, type=click.FloatRange(0.01, 3600.0),
              help="client quotas: seconds per sample (Kafka's quota.window.size.seconds)")
@click.pass_context
def kafka_command(ctx: click.Context, metadata_url: str | None, host: str, port: int, advertised_host: str,
                  node_id: int | None, lease_ttl: float, no_rebalance: bool, rebalance_batch: int,
                  rebalance_delay: float, test_drop_produce_response_every: int,
                  default_partitions: int, no_auto_create: bool, max_frame_bytes: int, metrics_port: int | None,
                  metrics_host: str, no_fetch_sessions: bool, ssl_cert: str | None, ssl_key: str | None,
                  ssl_client_ca: str | None, ssl_client_auth: str, sasl_mechanisms: str | None,
                  listeners: tuple[str, ...], inter_broker_ca: str | None, max_connections: int,
                  max_connections_per_ip: int, max_connections_per_ip_overrides: str, max_inflight_produce_bytes: int,
                  quota_window_num: int, quota_window_size: float, **security_options) -> None:
    """Serve the Kafka wire protocol on HOST:PORT; topic partitions are Scroll streams.

    \b
    Without a subcommand it serves (--metadata is then required):
      scroll kafka --metadata etcd://127.0.0.1:2379 --port 9092 [--metrics-port 9405]
    With one it is a client of a running listener:
      scroll kafka groups list|describe|reset-offsets|delete --bootstrap 127.0.0.1:9092
    """
    if ctx.invoked_subcommand is not None:
        return
    if metadata_url is None:
        raise click.UsageError("--metadata is required to serve (or give a subcommand, e.g. `groups`)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        tls = None
        if ssl_cert or ssl_key:
            if not (ssl_cert and ssl_key):
                raise ValueError("--ssl-cert and --ssl-key go together")
            tls = TlsConfig(ssl_cert, ssl_key, ssl_client_ca if ssl_client_auth != "none" else None,
                            ssl_client_auth == "required")
            tls.server_context()  # unreadable files: a clear error now, not at the first connection
        elif ssl_client_ca or ssl_client_auth != "none":
            raise ValueError("--ssl-client-ca and --ssl-client-auth need --ssl-cert and --ssl-key")
        mechanisms = sasl.parse_mechanisms(sasl_mechanisms) if sasl_mechanisms is not None else ()
        parsed = tuple(ListenerConfig.parse(spec, tls, mechanisms) for spec in listeners)
        if parsed:
            port = parsed[0].port
            if tls is not None and not any(li.tls_on for li in parsed):
                raise ValueError("--ssl-cert is given but no listener is SSL or SASL_SSL")
            if mechanisms and not any(li.sasl_on for li in parsed):
                raise ValueError("--sasl-mechanisms is given but no listener is SASL_PLAINTEXT or SASL_SSL")
        server_config = ServerConfig(host=host, port=port, max_frame_bytes=max_frame_bytes, tls=tls,
                                     sasl_mechanisms=mechanisms, listeners=parsed, max_connections=max_connections,
                                     max_connections_per_ip=max_connections_per_ip,
                                     max_connections_per_ip_overrides=_ip_overrides(max_connections_per_ip_overrides),
                                     max_inflight_produce_bytes=max_inflight_produce_bytes)
        broker_config = BrokerConfig(host=advertised_host, port=port, node_id=node_id, lease_ttl_s=lease_ttl,
                                     default_partitions=default_partitions, auto_create_topics=not no_auto_create,
                                     drop_produce_response_every=test_drop_produce_response_every,
                                     fetch_sessions=not no_fetch_sessions, rebalance=not no_rebalance,
                                     rebalance_batch=rebalance_batch, rebalance_delay_s=rebalance_delay,
                                     inter_broker_ca=inter_broker_ca or ssl_client_ca,
                                     quotas=QuotaConfig(quota_window_num, quota_window_size))
        server_config, broker_config = _with_security(server_config, broker_config, **security_options)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc
    metrics = None
    if metrics_port is not None:
        from .metrics import ListenerMetrics

        connect_host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
        metrics = ListenerMetrics(f"{connect_host}:{port}")
        try:
            metrics.serve(metrics_port, metrics_host)
        except OSError as exc:
            raise click.BadParameter(f"cannot serve metrics on {metrics_host}:{metrics_port}: {exc}") from exc
    try:
        aioloop.run(serve(metadata_url, server_config, broker_config, metrics=metrics, security=_bookie_security()))
    finally:
        if metrics is not None:
            metrics.close()


kafka_command.add_command(groups_command, "groups")
kafka_command.add_command(quotas_command, "quotas")


def _ip_overrides(spec: str) -> tuple[tuple[str, int], ...]:
    out = []
    for item in filter(None, (x.strip() for x in spec.split(","))):
        ip, colon, n = item.rpartition(":")
        if not colon or not n.isdigit():
            raise ValueError(f"--max-connections-per-ip-overrides takes IP:N,..., not {item!r}")
        out.append((ip.strip("[]"), int(n)))
    return tuple(out)


def _with_security(server_config: ServerConfig, broker_config: BrokerConfig, acls: bool, super_users: str,
                   connections_max_reauth_ms: int) -> tuple[ServerConfig, BrokerConfig]:
    """The ACL and re-authentication options applied to the configs (ValueError when invalid)."""
    users = parse_super_users(super_users)
    if users and not acls:
        raise ValueError("--super-users needs --acls")
    if connections_max_reauth_ms and not server_config.sasl_mechanisms:
        raise ValueError("--connections-max-reauth-ms needs --sasl-mechanisms")
    return (dataclasses.replace(server_config, connections_max_reauth_ms=connections_max_reauth_ms),
            dataclasses.replace(broker_config, acls=acls, super_users=users))


# ---------------------------------------------------------------- scroll kafka user
def _with_store(metadata_url: str, fn):
    from fragments.stores import open_store

    async def main():
        store = await open_store(metadata_url)
        try:
            return await fn(store)
        finally:
            await store.close()

    return aioloop.run(main())


_metadata_option = click.option("--metadata", "metadata_url", required=True, envvar="SCROLL_METADATA",
                                help="metadata store URL, e.g. etcd://127.0.0.1:2379 (or SCROLL_METADATA)")


@click.group("user")
def user_command() -> None:
    """SASL/SCRAM users of the Kafka listener (salted credentials in the metadata store)."""


@user_command.command("add")
@click.argument("name")
@click.option("--password", prompt=True, hide_input=True, confirmation_prompt=True, envvar="SCROLL_KAFKA_PASSWORD",
              help="the password (prompted for without it; or SCROLL_KAFKA_PASSWORD: keeps it off the command line)")
@click.option("--mechanism", "mechanisms", multiple=True, type=click.Choice(sasl.SCRAM_MECHANISMS),
              help="credential to store (repeatable) [default: both; PLAIN uses SCRAM-SHA-256]")
@click.option("--iterations", default=sasl.DEFAULT_ITERATIONS, show_default=True, type=click.IntRange(4096, 10**6))
@_metadata_option
def user_add(name: str, password: str, mechanisms: tuple[str, ...], iterations: int, metadata_url: str) -> None:
    """Add NAME (or replace its password)."""
    try:
        sasl.check_user_name(name)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc
    mechs = mechanisms or sasl.SCRAM_MECHANISMS
    _with_store(metadata_url, lambda store: sasl.add_user(store, name, password, mechs, iterations))
    click.echo(f"user {name}: {', '.join(mechs)}")


@user_command.command("remove")
@click.argument("name")
@_metadata_option
def user_remove(name: str, metadata_url: str) -> None:
    """Remove NAME's credentials."""
    if not _with_store(metadata_url, lambda store: sasl.remove_user(store, name)):
        raise click.ClickException(f"no user {name}")
    click.echo(f"removed user {name}")


@user_command.command("list")
@_metadata_option
def user_list(metadata_url: str) -> None:
    """User names and their mechanisms (never a credential)."""
    for name, mechs in _with_store(metadata_url, sasl.list_users).items():
        click.echo(f"{name}\t{','.join(mechs)}")


kafka_command.add_command(user_command, "user")
kafka_command.add_command(acl_command, "acl")

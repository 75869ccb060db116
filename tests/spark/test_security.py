"""The Spark connector against a secured cluster: etcd over TLS with auth on (the credentials in the
metadata URL, or as the ``user``/``password`` options), bookies over TLS requiring a token
(``tls.ca`` plus ``token`` or ``token.file``). The sink writes and the source reads back, in
batch and streaming; without the token the query fails with the bookies' refusal, and the
secrets do not show in the plan."""

from __future__ import annotations

import urllib.parse

import pytest

from streams.tools.localcluster import EtcdTLSFiles, LocalCluster
from streams.tools.pki import LocalPki


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    d = tmp_path_factory.mktemp("secured-spark")
    pki = LocalPki(d / "pki").ensure()
    c = LocalCluster(d / "cluster", bookies=3, etcd_password="s3cret-root",
                     etcd_tls=EtcdTLSFiles(cert=str(pki.server_cert), key=str(pki.server_key), ca=str(pki.ca)),
                     secure_bookies="token", bookie_ca=pki)
    c.start()
    yield c
    c.stop()


def _plain_url(cluster) -> str:
    """The metadata URL without user and password (given as options instead)."""
    parts = urllib.parse.urlsplit(cluster.metadata_url)
    return urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


def test_sink_and_source_over_tls_with_a_token(spark, secured, tmp_path):
    sec = secured.client_security
    token_file = tmp_path / "token"
    token_file.write_text(sec.token + "\n")
    creds = {"tls.ca": sec.tls_ca, "user": "root", "password": "s3cret-root"}
    rows = [(f"k{i}", f"v{i}") for i in range(50)]
    df = spark.createDataFrame(rows, "key string, value string")
    (df.write.format("scroll").option("metadata", _plain_url(secured)).option("stream", "secure-out")
       .option("createStream", "true").options(**creds).option("token", sec.token).mode("append").save())
    back = (spark.read.format("scroll").option("metadata", secured.metadata_url).option("streams", "secure-out")
            .option("tls.ca", sec.tls_ca).option("token.file", str(token_file)).load())
    got = sorted((r.key.decode(), r.value.decode()) for r in back.select("key", "value").collect())
    assert got == sorted(rows)
    # streaming, through the same credentials
    q = (spark.readStream.format("scroll").option("metadata", _plain_url(secured)).option("streams", "secure-out")
         .option("startingOffsets", "earliest").options(**creds).option("token", sec.token).load()
         .writeStream.format("memory").queryName("secure_mem").option("checkpointLocation", str(tmp_path / "ck"))
         .trigger(availableNow=True).start())
    q.awaitTermination(180)
    assert q.exception() is None
    assert spark.sql("select count(*) as n from secure_mem").collect()[0].n == 50
    plan = back._jdf.queryExecution().toString()
    assert sec.token not in plan and "s3cret-root" not in plan


def test_without_the_token_the_query_fails_clearly(spark, secured):
    sec = secured.client_security
    reader = (spark.read.format("scroll").option("metadata", secured.metadata_url).option("streams", "secure-out")
              .option("tls.ca", sec.tls_ca))
    with pytest.raises(Exception) as err:
        reader.load().collect()
    assert "authentication" in str(err.value).lower() or "token" in str(err.value).lower(), str(err.value)[-2000:]
    with pytest.raises(Exception) as err:
        (spark.read.format("scroll").option("metadata", secured.metadata_url).option("streams", "secure-out")
         .option("tls.cert", sec.tls_ca).load().collect())
    assert "tls.cert and tls.key go together" in str(err.value)

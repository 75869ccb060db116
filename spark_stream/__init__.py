"""PySpark data source for Scroll streams: ``spark.read``/``readStream``/``write``/``writeStream``
with ``format("scroll")``.

    import spark_stream
    spark_stream.register(spark)
    df = (spark.readStream.format("scroll")
          .option("metadata", "etcd://127.0.0.1:2379").option("streams", "orders")
          .option("startingOffsets", "earliest").option("maxRecordsPerTrigger", 10000).load())
    (df.writeStream.format("scroll").option("metadata", "etcd://127.0.0.1:2379")
       .option("stream", "orders-copy").option("checkpointLocation", "/tmp/ck").start())

Built on Spark's Python Data Source API (``pyspark.sql.datasource``, Spark >= 4.2 for admission
control). The reading side is in ``spark_stream.source``, the exactly-once writing side in
``spark_stream.sink``, options in ``spark_stream.options``. See docs/spark.md.
"""

from __future__ import annotations

from pyspark.sql.datasource import DataSource

from .options import ReadOptions, ScrollOptionError, WriteOptions
from .sink import ScrollBatchWriter, ScrollStreamWriter, check_schema, ensure_target
from .source import ScrollBatchReader, ScrollDataLossError, ScrollStreamReader, schema_for

__all__ = ["ScrollDataSource", "ScrollDataLossError", "ScrollOptionError", "register"]

FORMAT = "scroll"


class ScrollDataSource(DataSource):
    """The ``scroll`` format. Options: see ``spark_stream.options`` and docs/spark.md."""

    @classmethod
    def name(cls) -> str:
        return FORMAT

    def _include_headers(self) -> bool:
        v = self.options.get("includeHeaders")
        return str(v).strip().lower() in ("true", "1", "yes") if v is not None else False

    def schema(self):
        return schema_for(self._include_headers())

    def reader(self, schema):
        return ScrollBatchReader(ReadOptions.parse(self.options, streaming=False))

    def streamReader(self, schema):
        return ScrollStreamReader(ReadOptions.parse(self.options, streaming=True))

    def writer(self, schema, overwrite: bool):
        opts = WriteOptions.parse(self.options)
        cols = check_schema(schema)
        ensure_target(opts)
        return ScrollBatchWriter(opts, cols)

    def streamWriter(self, schema, overwrite: bool):
        opts = WriteOptions.parse(self.options)
        cols = check_schema(schema)
        ensure_target(opts)
        return ScrollStreamWriter(opts, cols)


def register(spark) -> None:
    """Make ``format("scroll")`` available in ``spark`` (a SparkSession)."""
    spark.dataSource.register(ScrollDataSource)

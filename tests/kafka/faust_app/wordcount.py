"""A Faust word count, run by tests/kafka/test_real_tools.py as its own process in its own venv
(``.venv-faust``: faust-streaming pins click<8.4, which our venv is past). Everything comes from the
environment:

- ``FAUST_BROKER`` (host:port of a Scroll Kafka listener), ``FAUST_APP_ID``, ``FAUST_DATADIR``
- ``FAUST_INPUT`` (words: raw values), ``FAUST_OUTPUT`` (key = word, value = its new count)
- ``FAUST_GUARANTEE`` (``exactly_once`` or ``at_least_once``)

The table ``counts`` (a changelog topic ``<app id>-counts-changelog``, compacted, created by Faust
with CreateTopics) lives in a memory store: at every start it is rebuilt from the changelog alone.
An input value ``?dump`` makes the agent send the whole table, JSON, under the key ``?dump``.
"""

import json
import logging
import os

import faust

logging.getLogger("aiokafka").setLevel(logging.WARNING)

app = faust.App(
    os.environ["FAUST_APP_ID"],
    broker=f"kafka://{os.environ['FAUST_BROKER']}",
    store="memory://",
    datadir=os.environ["FAUST_DATADIR"],
    processing_guarantee=os.environ.get("FAUST_GUARANTEE", "at_least_once"),
    topic_partitions=1,
    topic_replication_factor=1,
    web_enabled=False,
    broker_commit_interval=0.5,
    table_standby_replicas=0,
    consumer_auto_offset_reset="earliest",
)

words = app.topic(os.environ["FAUST_INPUT"], key_type=bytes, value_type=bytes, value_serializer="raw",
                  key_serializer="raw")
output = app.topic(os.environ["FAUST_OUTPUT"], key_type=bytes, value_type=bytes, value_serializer="raw",
                   key_serializer="raw")
counts = app.Table("counts", default=int, partitions=1)


@app.agent(words)
async def count(stream):
    async for value in stream:
        word = value.decode()
        if word == "?dump":
            await output.send(key=b"?dump", value=json.dumps(dict(counts.items()), sort_keys=True).encode())
            continue
        counts[word] += 1
        await output.send(key=word.encode(), value=str(counts[word]).encode())


@app.task
async def announce():
    print("FAUST-APP-STARTED", flush=True)


if __name__ == "__main__":
    app.main()

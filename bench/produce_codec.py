"""The Produce codec alone: time per request decoded and per answer encoded, the hand-written
codec (``compat_kafka/wire/produce.py``) against kio's generic path in the same run, and
``split_batches`` of one batch against main's version (``git show main:...``, when given).

    .venv/bin/python bench/produce_codec.py [--old-batches /tmp/oldbatches.py]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import sys
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aiokafka.record.default_records import DefaultRecordBatchBuilder  # noqa: E402
from kio.index import load_request_schema, load_response_schema  # noqa: E402
from kio.schema.errors import ErrorCode  # noqa: E402

from compat_kafka.wire import batches, codec  # noqa: E402


def per_call_us(fn, n: int) -> float:
    return min(timeit.repeat(fn, number=n, repeat=3)) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=20_000)
    ap.add_argument("--value-bytes", type=int, default=1024)
    ap.add_argument("--old-batches", default=None, help="a copy of main's compat_kafka/wire/batches.py")
    args = ap.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f}")
    b = DefaultRecordBatchBuilder(magic=2, compression_type=0, is_transactional=False, producer_id=5,
                                  producer_epoch=0, base_sequence=0, batch_size=1 << 20)
    b.append(0, timestamp=1000, key=None, value=b"x" * args.value_bytes, headers=[])
    blob = bytes(b.build())
    for v in (7, 12):  # kafka-python / older librdkafka; librdkafka 2.16
        req_cls = load_request_schema(0, v)
        m = sys.modules[req_cls.__module__]
        body = req_cls(transactional_id=None, acks=-1, timeout=datetime.timedelta(seconds=30), topic_data=(
            m.TopicProduceData(name="bench", partition_data=(m.PartitionProduceData(index=3, records=blob),)),))
        data = codec.encode_request(body, 1, "rdkafka")[4:]
        new = per_call_us(lambda data=data: codec.decode_request(data), args.n)
        old = per_call_us(lambda data=data, v=v: codec.decode_request_generic(data, 0, v, 1), args.n)
        resp_cls = load_response_schema(0, v)
        rm = sys.modules[resp_cls.__module__]
        part = codec.build(rm.PartitionProduceResponse, index=3, error_code=ErrorCode.none, base_offset=100,
                           log_append_time=None, log_start_offset=0, record_errors=(), error_message=None)
        resp = codec.build(resp_cls, throttle_time=codec.ZERO_MS,
                           responses=(rm.TopicProduceResponse(name="bench", partition_responses=(part,)),))
        enc_new = per_call_us(lambda resp=resp: codec.encode_response(1, resp), args.n)
        enc_old = per_call_us(lambda resp=resp: codec.encode_response_generic(1, resp), args.n)
        print(f"Produce v{v}, one partition: decode {new:.2f} / kio {old:.2f} µs = {new / old:.2f}; "
              f"encode {enc_new:.2f} / kio {enc_old:.2f} µs = {enc_new / enc_old:.2f}")
    if args.old_batches:
        spec = importlib.util.spec_from_file_location("old_batches", args.old_batches)
        old_mod = importlib.util.module_from_spec(spec)
        sys.modules["old_batches"] = old_mod
        spec.loader.exec_module(old_mod)
        new = per_call_us(lambda: batches.split_batches(blob), args.n)
        old = per_call_us(lambda: old_mod.split_batches(blob), args.n)
        print(f"split_batches, one batch: {new:.2f} / main's {old:.2f} µs = {new / old:.2f}")


if __name__ == "__main__":
    main()

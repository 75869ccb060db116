"""Kafka broker protocol shim: unmodified Kafka clients produce to and consume from Scroll streams.

A topic partition is the stream ``<topic>-<partition>``; one produce record batch is one stream
entry. See docs/kafka.md for the mapping, the metadata keys and the supported API versions.
"""

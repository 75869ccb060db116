"""Kafka broker protocol shim: unmodified Kafka clients produce to and consume from Scroll streams.

Topics are the streams API's topics: partition ``p`` of topic ``t`` is the stream ``t`` (p = 0) or
``t:p``, and one produce record batch is one stream entry, stored as it came with its baseOffset
set to the stream's record offset. See docs/kafka.md for the mapping, the metadata keys and the
supported API versions.
"""

"""The client library: the producer/consumer API, topics, and the drivers for the protocol core.
Operator tools (the ``scroll`` CLI, admin, the retention job, standalone) are in ``streams.tools``."""

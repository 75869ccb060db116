"""The client side: producer/consumer API, drivers for the protocol core, and the ``scroll`` CLI."""

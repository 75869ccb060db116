"""Idempotence and transactions (KIP-98): producer id blocks and per-partition producer state,
the transaction coordinator and the per-partition transaction index."""

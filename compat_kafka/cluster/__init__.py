"""Listeners as a cluster: registration, partition/coordinator ownership under leases, and the
calls one listener makes to another (WriteTxnMarkers)."""

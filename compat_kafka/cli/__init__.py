"""`scroll kafka`: the listener command, users, ACLs, groups, and the Prometheus metrics it serves."""

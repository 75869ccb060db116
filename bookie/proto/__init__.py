"""Generated gRPC code for the bookie protocol (see bookie.proto; regenerate with generate.py)."""

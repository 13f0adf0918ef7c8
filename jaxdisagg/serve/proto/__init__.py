"""Generated protobuf and gRPC modules of the serving API (see generate.py)."""

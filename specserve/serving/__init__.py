"""What every service runs on: the gRPC server, the batcher, TLS, tracing, metrics and logs."""

"""Generated gRPC stubs for the specserve.v1 protocol (`specserve gen-protos`). Do not edit."""

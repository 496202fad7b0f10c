"""The gateway: the OpenAI-compatible HTTP API, each request's token sequence and its rounds."""

"""The draft service: draft models and their per-session draft KV caches."""

"""The verify service: the target model, per-session target KV caches, batched verification."""

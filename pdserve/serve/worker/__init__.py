"""The worker process: one engine behind a ZeroMQ socket (`pdserve prefill | decode |
colocated`), its request gateway and the prefill -> decode KV hand-off."""

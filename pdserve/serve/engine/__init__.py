"""The engine: requests, the token scheduler, the block manager, sampling and what a request's
two ends do (roles, detokenizing, structured outputs, n > 1, speculative decoding)."""

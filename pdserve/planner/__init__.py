"""Capacity planning: the goodput simulator (shared with the router's controller), the latency
profile it reads, and the offline `pdserve profile` / `pdserve plan` commands."""

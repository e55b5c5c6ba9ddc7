"""Capacity planning's library: the per-phase step-latency models and the goodput simulator
(shared with the router's controller), the latency profile they read, and the split search.
The commands that measure and size with it (`pdserve profile`, `pdserve plan`) live on top,
in pdserve/app/."""

"""The layers a model is built from: the parallel linears and their weight loaders (TP / EP
sharding lives here, never in a model file), attention and its metadata, the small
per-token layers (norm, rotary, SiLU-and-mul), the pipeline stage a model builds into, FP8
weights, the collectives' groups, the kernel-op choice for this process, and the CPU fused
decode loop over a decoder's layers. Imports the config and the kernels; no model, no runner."""

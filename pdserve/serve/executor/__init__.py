"""The executor: runs one scheduled step on every rank. The model runner and its rank
processes, the weight loader (the MTP layer's too), the paged KV pool and its sizing, decode
graphs, context parallelism, which rows get logits, and the CPU path chosen by measurement.
Builds models (pdserve/serve/models/) from layers (pdserve/serve/layers/); knows no request."""

"""The executor: runs one scheduled step on every rank. The model runner, the parallel layers
(TP / PP / CP / EP), attention dispatch, the paged KV pool and the weight loader."""

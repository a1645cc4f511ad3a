"""Tensor parallelism: the rank group and its collectives, the vocab-parallel row rule, and the parallel layers."""

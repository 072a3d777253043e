"""Leaf helpers: the private tensor, autograd, allocator, profiler and compiler internals of torch the
library reads, each behind one function. Nothing here imports anything of the library."""

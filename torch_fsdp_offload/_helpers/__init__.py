"""Leaf helpers: the private tensor, autograd, allocator and profiler internals of torch the library
reads, each behind one function. Nothing here imports anything of the library."""

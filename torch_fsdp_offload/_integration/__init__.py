"""Every use of torch's private internals in torch_fsdp_offload lives in this package.

The rest of the library uses public torch API, and reaches these internals only through the small
functions exported here (see docs/design.md, "Patch points per torch version").
"""

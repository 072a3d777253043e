"""torch_fsdp_offload: CPU offloading for PyTorch FSDP that runs at the speed of the link."""

__version__ = "0.1.0"

"""``OffloadOptimizer`` and the parts it is built of; import it from ``torch_fsdp_offload.optim``.

- ``offload_optimizer``: the ``torch.optim.Optimizer`` wrapper (``step``, ``zero_grad``, state
  dicts, pickling);
- ``arguments``: what it refuses, checked before it builds or changes anything;
- ``groups``: what it needs of an offloaded parameter group, and how the FSDP integration hands
  groups over;
- ``overlap``: when groups may step during backward, and the checks ``step()`` makes;
- ``host_steps``: a group's step on the CPU;
- ``streamed_steps``: a group's step on the GPU, pipelined over runs of parameters;
- ``step_worker``: the thread that runs steps in the order gradients land;
- ``hyperparameters``: hyperparameters flowing from the wrapper's groups to its inner optimizers.

This file imports none of them, so the FSDP integration can import ``groups`` alone.
"""

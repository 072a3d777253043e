"""``OffloadOptimizer`` and the parts it is built of; import it from ``torch_fsdp_offload.optim``.

- ``offload_optimizer``: the ``torch.optim.Optimizer`` wrapper (``step``, ``zero_grad``, state
  dicts), owning the parts below;
- ``arguments``: what it refuses, checked before it builds or changes anything;
- ``groups``: what it needs of an offloaded parameter group, and how the FSDP integration hands
  groups over;
- ``inner_optimizers``: the wrapped class, one optimizer per offloaded group;
- ``overlap``: when groups may step during backward, and the checks ``step()`` makes;
- ``host_steps``: a group's step on the CPU, and the gradient norms computed as they land;
- ``streamed_steps``: a group's step on the GPU, pipelined over runs of parameters;
- ``finishing_steps``: the steps that run on after ``step()`` returned;
- ``step_worker``: the thread that runs steps in the order gradients land;
- ``pending_updates`` and ``dtensor_grads``: reads that wait for a step, and gradients watched for
  changes (the DTensor internals they take);
- ``hyperparameters``: hyperparameters flowing from the wrapper's groups to its inner optimizers.

This file imports none of them, so the FSDP integration can import ``groups`` alone.
"""

"""The data path of one offloaded FSDP parameter group: where its shards live (:mod:`.group_offload`),
the states it moves through (:mod:`.group_state`), and the prefetch schedule that issues its copies
ahead of use (:mod:`.prefetch_schedule`). The FSDP glue in ``_integration`` drives it."""

"""Tensor parallelism over ``torch.distributed`` (``EngineConfig.tensor_parallel_size``).

``sharding``: how a model splits (valid sizes, shard configurations and weights); ``tp``: a shard,
the step broadcast and the workers' loop; ``launch``: starting the ranks and rank 0's model.
"""

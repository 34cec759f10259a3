"""A scheduled step run on the devices: the executors (one rank or a tensor-parallel group),
the step's wire format between ranks, the KV pool, the model runner and the sampler."""

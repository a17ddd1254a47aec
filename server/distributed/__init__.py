"""Tensor parallelism (Megatron's split) over ``torch.distributed``: gloo on the CPU, NCCL on CUDA.

- ``parallel_state.py``: this rank's place (``TensorParallel``: rank, size, group) and the check that a
  model splits across N ranks.
- ``collectives.py``: the few collectives the model needs (all-reduce, gather of the logits to the driver).
- ``messages.py``: what the driver sends the other ranks each step (a command and its tensors).
- ``driver.py``: rank 0, in the engine process: starts the other ranks, sends them each step, watches them.
- ``worker.py``: the entry of every other rank's process: its shard of the model and of every KV block.
"""

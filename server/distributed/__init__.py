"""Tensor parallelism (Megatron's split) and pipeline parallelism (the layers cut into stages) over
``torch.distributed``: gloo on the CPU, NCCL on CUDA.

- ``parallel_state.py``: this rank's place (``TensorParallel``: rank, size, group; ``PipelineStage``:
  its stage and layers) and the check that a model splits across N ranks.
- ``collectives.py``: the few collectives the model needs (all-reduce, gather of the logits to the driver,
  activations from one stage to the next).
- ``messages.py``: what the driver sends the other ranks each step (a command and its tensors).

The ranks' processes are started and driven by server/executor/tp_driver.py (rank 0, in the engine
process) and server/executor/tp_worker.py (every other rank).
"""

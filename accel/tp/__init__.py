"""Tensor parallelism over torch.distributed (Megatron-LM's split of a Llama decoder over N ranks).

    group.py    the process group: spawned from the CLI or joined under torchrun; gloo on CPU, nccl on CUDA
    shard.py    which slice of each checkpoint tensor a rank keeps (heads, KV heads, hidden units, vocabulary)
    load.py     reading one rank's slices from safetensors, never the whole model
    model.py    one rank's eager forward with its all-reduces and the gathered logits; RankSplit, the collectives
                the one-GPU fused decode step (accel.model.decode_step) takes on a rank
    engine.py   rank 0 drives generation, the other ranks follow its broadcasts
    launch.py   `tp_engine`: what a CLI command opens
    batch.py    the batched engine (accel.batch) over the group: rank 0 drives, every rank runs each step's forward
    batch_launch.py  `tp_batch_engine`: what `llama32 batch` and `serve` open
"""

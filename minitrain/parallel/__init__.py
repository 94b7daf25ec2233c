"""Several processes: torchrun's process group, FSDP2's sharding, and a checkpoint's tensors as one part per rank.

One concern, several processes: a run with one process imports these too, and every function here
is a plain call there (one rank, no collective).

Modules, in reading order:
    distributed        torchrun: the process group, the few collectives, their tracing, a dead peer
    fsdp               parallel=fsdp: shard the model, each rank reads its rows, save file by file
    checkpoint_shards  a checkpoint's tensors on disk: whole files or one part per rank, read by rows
"""

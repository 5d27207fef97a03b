"""The distributed floor of train/: the process group, the device mesh, FSDP2 sharding and the
reductions (parallel.py), and SLURM's task variables as torchrun's (slurm.py). It imports no
other module of train/."""

"""Training: the loop, data parallelism (FSDP2), checkpoints, metrics and plots."""

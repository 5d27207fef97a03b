"""Training: the loop, data parallelism (FSDP2), checkpoints, metrics and plots.

Floors, lowest first; a module imports its own folder's modules and those of lower floors
(tests/test_layers.py `TRAIN_FLOORS`): distributed/ (the process group, FSDP2, SLURM), setup/
(the model a run trains: memory plan, preparation, the stack), run/ (what a run writes and
reads: checkpoints, export, metrics, trackers, plots, profiles, the held-out evaluation), then
the loop's parts here (epochs.py, optim.py, resume.py, step.py), trainer.py, and command.py
(`vlpack train`)."""

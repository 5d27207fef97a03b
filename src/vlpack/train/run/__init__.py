"""The run floor of train/: what a run writes and reads back. Checkpoints (checkpoint.py), the
exported folder and its serving files (export.py, serving.py), per-step metrics, trackers, the
live view and plots (metrics.py, tracking.py, progress.py, plot.py), step profiles (profile.py),
the output folder's lock (runlock.py) and the held-out evaluation (generate.py,
answer_metrics.py). It imports train/distributed/ and train/setup/, never the loop above it."""

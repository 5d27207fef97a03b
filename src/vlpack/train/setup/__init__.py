"""The setup floor of train/: the model a run trains, from the config (as data/setup.py builds the
run's encoder). The memory plan (memory.py), the FLOPs of a step (flops.py), the dtype each
parameter is held in (precision.py), the root module (module.py), the one preparation
(prepare.py), the kernel caches and fla's tuned configurations (kernel_cache.py, fla_configs/)
and the stack that builds through them (stack.py). It imports train/distributed/ and nothing
else of train/."""

"""`vlpack check`: proves on a model that a packed row keeps its samples apart.

command.py is the command (its flags as a config, the model built through train/setup/stack.py's
`build_check_model`, exit codes, collective errors, the data-parallel replicas of `--cp N`);
run.py runs the comparison on the built model (packed vs stock, tolerances, the report);
data.py picks and encodes the samples of `--data`; encoding.py compares that encoding with
transformers' processor (built by processor.py; the presets' templates are in templates.py);
vision.py compares the vision features and self-tests the vision positions.

The package sits above train/ (it builds through train/setup/stack.py) and below the CLI; nothing in
model/ or train/ imports it.
"""

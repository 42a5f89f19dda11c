"""The built-in training loop: config, data, models, optimiser, state, snapshots, checkpoints, metrics."""

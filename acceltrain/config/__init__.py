"""The run's settings: option groups, the one-line error, the training config and its parser (free of torch)."""

"""The loop and what it trains with: prepare, progress, the hooks' view, tasks, optimizers, speed, export."""

"""What a launch runs on: processes and engines, the run folder, preemption, logs, honest metrics."""

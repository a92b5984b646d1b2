"""Training: the one loop, the one loss, schedules, checkpoints, distributed set-up."""

"""Training: the one loop (`trainer`) and its objectives (token, DPO, RL), the time budget,
optimizers, schedules, checkpoints and resume checks, health, distributed set-up; the loss
itself is `lmforge.model.loss`."""

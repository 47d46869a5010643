"""Fine-tuning: the training loop (loop.py), its checkpoints (checkpoints.py) and the `xattn train` command
(command.py)."""

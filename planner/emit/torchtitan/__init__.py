"""The plan as torchtitan settings: 0.3's flags or a 0.2 TOML job file (job.py), with the stage split in
torchtitan's own terms (split.py)."""

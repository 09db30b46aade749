"""Trainers as data (table.py) and what each means for a request, the search and a configuration (rules.py)."""

from planner.trainers.rules import (kernel_sets, model_for, narrow_space, refusal, resolve_trainer, search_space,
                                    trainer_for_artifact, trainer_kernel_refusal, trainer_named, with_trainer_defaults)
from planner.trainers.table import DEFAULT_TRAINER, TRAINERS, Trainer

__all__ = ["Trainer", "TRAINERS", "DEFAULT_TRAINER", "trainer_named", "trainer_for_artifact", "resolve_trainer",
           "with_trainer_defaults", "model_for", "kernel_sets", "narrow_space", "search_space", "refusal",
           "trainer_kernel_refusal"]

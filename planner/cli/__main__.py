"""`python -m planner.cli ...` is `fsdp-plan ...`."""

from planner.cli import main

main()

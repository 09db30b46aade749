"""What the CLI prints about a plan: the tables (table*.py), the formula walk-through (explain*.py), the
memory/time chart (plot.py) and the step as a Chrome trace (timeline.py)."""

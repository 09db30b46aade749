"""The one width, in columns, that every line fsdp-plan prints fits: the plan table and its prose
(planner/reports/table.py) and every line of emitted code and config (planner/emit/format.py). 100: a normal
terminal shows them unwrapped (issue 19 item 1)."""

LINE_WIDTH = 100  # columns

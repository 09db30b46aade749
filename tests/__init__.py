"""The suite as a package: verl's wheel (installed --no-deps by the README's test command for its config files
and validation) ships a top-level `tests` package into site-packages, which would otherwise shadow this
directory's namespace package (`tests.distributed.*` imports in workers and test modules)."""

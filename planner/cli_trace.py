"""`fsdp-plan trace`: the real FSDP2 step on fake tensors (registered onto the app by planner.cli)."""


def register(app) -> None:
    """Add the trace command to the typer app."""

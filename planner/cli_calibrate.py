"""`fsdp-plan calibrate`: short real FSDP runs, fitted back into the cost model (registered by planner.cli)."""


def register(app) -> None:
    """Add the calibrate command to the typer app."""

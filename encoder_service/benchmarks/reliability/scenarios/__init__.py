"""One module per scenario; each has ``run(...) -> ScenarioResult`` (see ../__init__.py)."""

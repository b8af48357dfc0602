"""One module per scenario; each has ``run(...) -> ScenarioResult`` (see bench/reliability/__init__.py)."""

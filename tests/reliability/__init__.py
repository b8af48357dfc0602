"""The reliability suite (a package, so that its conftest does not shadow tests/conftest.py)."""

"""The reliability scenarios, shared by ``tests/reliability`` (short runs in CI) and the soak (``soak.py``,
``encoder-service bench reliability``: long runs). Each scenario module has one ``run(...)`` that starts
real server processes, drives them with real clients and returns a ``ScenarioResult``: its figures and
its pass/fail checks. Nothing here imports the server package: it is driven only through its CLI, gRPC and /metrics; nor
does the server import this. The fuzz inputs and scenario need hypothesis (the ``test`` extra).
"""

"""The security stack of the gRPC ports: TLS and the sink side's credentials (``tls.py``), bearer
tokens (``auth.py``), per-client concurrency limits (``client_limits.py``), and ``settings.py``,
which builds them all once at start-up from the flags for the main port and the SGLang port.

A package of its own so that what guards the ports is read in one place, apart from what they serve.
"""

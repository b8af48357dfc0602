"""The SGLang-compatible front end (``--sglang-compat-port``): SGLang's own encoder protocol
(``front_end.py``), its pushed header (``header.py``), its ``mm_items`` (``media.py``, fetching
URLs with ``url_fetch.py``) and where the embeddings go over ZMQ (``zmq_push.py``).

A package of its own because it needs the optional ``sglang`` extra (``smg-grpc-proto``, ``zmq``),
imported only when the port is on, and because it is a second front end beside VisionEncoder: it
reaches the engine through ``api/engine_gate.py``, never through the VisionEncoder servicer.
"""

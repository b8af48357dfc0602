"""What ``encoder-service bench`` runs: ``forward`` (the ViT's throughput on a GPU against transformers),
``service`` with ``service_clients`` and ``report`` (the whole service as users run it, ``bench --service``),
and ``reliability`` (the scenarios of tests/reliability and bench/soak.py). Tools, not serving paths:
nothing of the server imports this package."""

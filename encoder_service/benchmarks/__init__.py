"""What ``encoder-service bench {forward,service,video}`` runs, one module each with its own ``main(argv)``:
``forward`` (the ViT's throughput on a GPU against transformers), ``service`` with ``service_clients`` and
``report`` (the whole service as users run it) and ``video`` (clips against images through that service);
and ``reliability`` (the scenarios of tests/reliability and bench/soak.py). Tools, not serving paths:
nothing of the server imports this package."""

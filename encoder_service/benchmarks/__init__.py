"""What ``encoder-service bench {forward,service,video,reliability,profile}`` runs, each with its own ``main(argv)``:
``forward`` (the ViT's throughput on a GPU against transformers), ``service`` with ``service_clients`` and
``report`` (the whole service as users run it) and ``video`` (clips against images through that service);
and ``reliability`` (the scenarios of tests/reliability, and ``reliability/soak.py``, which runs them for
long). Tools, not serving paths: nothing of the server imports this package."""

"""Optional integrations of the client with serving engines.

Each one is a module of its own that imports its engine only when it is loaded, so
``import encoder_client`` stays free of torch and of every engine:

- ``encoder_client.integrations.vllm``: ``EncoderServiceECConnector``, vLLM's encoder-cache
  connector (``--ec-transfer-config``), fed by this service by content hash.
- ``encoder_client.integrations.proxy``: ``encoder-client proxy``, an OpenAI-compatible HTTP front
  before vLLM that has the encoder encode each image and sends vLLM its content hash as the image
  part's ``uuid`` (aiohttp, the ``proxy`` extra; the rewriting is ``.proxy_rewrite``, I/O-free).
- ``encoder_client.integrations.staging`` and ``.stager``: what it is built on, free of torch and
  vLLM (node-local shared-memory staging; the scheduler-side fetch and bookkeeping).
"""

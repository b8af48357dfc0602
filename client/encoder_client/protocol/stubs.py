"""The generated protobuf/gRPC code of ``encoder.v1``, re-exported.

``scripts/gen_protos.py`` writes it into ``encoder_client._proto``; this is the only module that
imports from there (tests/test_architecture.py checks it). Everyone else imports
``from encoder_client.protocol import encoder_pb2, encoder_pb2_grpc``.
"""

from encoder_client._proto.encoder.v1 import encoder_pb2, encoder_pb2_grpc

__all__ = ["encoder_pb2", "encoder_pb2_grpc"]

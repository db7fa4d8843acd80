"""gRPC: the protocol's messages, generated from ``inference.proto``
(``inference_pb2``), and the servicer that every interpreter's front end runs on the port
they share (``server``).
"""

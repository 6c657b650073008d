"""Generated protobuf and gRPC code. Do not edit: change protos/ and run `python -m specpool.services.protogen`."""

"""meshlm.v1: generated protobuf and gRPC stubs of protos/meshlm/v1 (see _gen.py)."""

from meshlm.v1._gen import ensure_generated

ensure_generated()

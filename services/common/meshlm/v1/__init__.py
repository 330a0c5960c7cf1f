"""meshlm.v1: the generated protobuf and gRPC stubs of protos/meshlm/v1 (see _gen.py).

Importing checks that every stub matches its .proto and raises ImportError naming the command that
regenerates them (`python3 scripts/gen_protos.py`); it never runs protoc and never writes a file.
"""

from meshlm.v1._gen import check

check()

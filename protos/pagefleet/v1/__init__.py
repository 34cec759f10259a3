"""`pagefleet.v1`: the gRPC API (`pagefleet.proto`) and its generated modules (`protos/generate.py`)."""

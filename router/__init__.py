"""Floor 4: the front door: placement policy, router, gRPC server and client."""

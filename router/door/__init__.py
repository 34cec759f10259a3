"""The front door: the gRPC server (`FrontDoor`), its messages and checks (`api`), and its
Prometheus metrics."""

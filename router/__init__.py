"""Floor 4: the router over many worker groups, its doors (gRPC, HTTP) and placement."""

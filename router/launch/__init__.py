"""`pagefleet serve`: a `ServeConfig` (config.py) becomes the server's parts (build.py, with
the torch side in local.py), which run until a signal stops them (run.py)."""

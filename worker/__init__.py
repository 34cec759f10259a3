"""Floor 2: the engine of one tensor-parallel worker group."""

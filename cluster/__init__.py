"""Floor 3: worker groups in a Ray cluster, the shared prefix index, capacity planning."""

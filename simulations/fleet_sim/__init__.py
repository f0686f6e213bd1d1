"""The fleet simulator (`kvplane sim`): policies compared on one workload, in simulated time."""

"""Inside MPI: bootstrap, the Dist collectives, fail fast, stop, watch; the public API and `run SCRIPT`."""

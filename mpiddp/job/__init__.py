"""Inside MPI: bootstrap, the Dist collectives, fail fast, stop, watch. It knows nothing of its users (the trainer, the
script front door) nor of the elastic engine."""

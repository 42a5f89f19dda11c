"""In-job recovery and growing back: the survivors of a failed rank carry on in the same processes, and spare ranks
join them again. decide (pure: can we recover, how to split, when to grow), membership (MPI fault tolerance: the
failure watch, agree, shrink), spawning (MPI's side of growing back: spawn and merge, hot spares), engine (the one
recovery, for the trainer's policy and a script's), survivors (following the shrunk or grown job), grow (both
sides), api (the scripts' API and policy). MPI's fault-tolerance calls live in this package only."""

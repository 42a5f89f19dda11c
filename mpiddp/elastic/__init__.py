"""In-job recovery and growing back: the survivors of a failed rank carry on in the same processes, and spare ranks
join them again. decide (pure: can we recover, how to split, when to grow), membership (the only MPI
fault-tolerance code), engine (the one recovery, for the trainer's policy and a script's), survivors (following the
shrunk or grown job), grow (both sides), api (the scripts' API and policy)."""

"""Tools beside and after a job: `check` (under mpirun) and `report RUN_DIR`."""

"""The launch layer, outside MPI: host lists, launcher command lines, the restart policy and the supervisor.

Never imports mpi4py or torch.distributed, nor the job modules that do: it talks to the job through the exit
status, RUN_DIR/failures/ (every rank's record, the placement) and the launcher's output.
"""

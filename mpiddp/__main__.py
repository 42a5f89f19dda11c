"""`python -m mpiddp`: run the job, ending the whole MPI job if any rank fails."""

from mpiddp.main import main_cli

main_cli()

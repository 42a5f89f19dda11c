"""Imported first by the DataLoader's forkserver (never by a rank): the forkserver, and every worker it forks,
ignores stop signals, so a signal sent to the rank's process group leaves them alive; and the forkserver dies with
its rank (each worker, with the forkserver: mpiddp.trainer.data's worker_init)."""

from mpiddp.job.helper_signals import die_with_parent, ignore_stop_signals, mark_helper_parent

ignore_stop_signals()
die_with_parent()
mark_helper_parent()  # the workers it forks die with it

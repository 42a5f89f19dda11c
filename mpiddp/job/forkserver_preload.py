"""Imported first by the DataLoader's forkserver (never by a rank): the forkserver, and every worker it forks,
ignores stop signals, so a signal sent to the rank's process group leaves them alive."""

from mpiddp.job.helper_signals import ignore_stop_signals

ignore_stop_signals()

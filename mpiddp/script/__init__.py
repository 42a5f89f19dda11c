"""The script front door: `python -m mpiddp run train.py` (run.py) and `mpiddp.init()` under a plain mpirun (api.py).

It sits beside the trainer, above the job layer and the elastic engine, so `job/` never imports either."""

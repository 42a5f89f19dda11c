"""mpiddp's version: one place for the package face, the metadata (setup.cfg), --version and summary.json."""

__version__ = "0.1.0"

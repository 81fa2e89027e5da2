"""Diagnostics a user runs on their own stack (``timlab check``, ``timlab analyze``, ``timlab
probe``, the exactness search) and the one answer they print, "is my mismatch a problem?"
(``harm_prediction``, from the lab's measured cells through ``studies.predictor``). They draw their
HTML pages with ``timlab.experiments.reports.page``."""

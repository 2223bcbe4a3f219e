"""Evaluation programs: speed and quality of PPD against baselines (run with ``python -m eval.NAME``)."""

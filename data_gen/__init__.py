"""Programs that make the training datasets (run with ``python -m data_gen.generate``)."""

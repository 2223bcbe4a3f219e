"""Training prompt tokens (run with ``accelerate launch -m train.train`` or ``python -m train.train``)."""

"""Programs for trying ppd: ``python -m application.generate`` (one prompt) and the chat app."""

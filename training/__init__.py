"""Trains the bundled demo pair from scratch: `python -m training.demo --out DIR` (see demo.py)."""

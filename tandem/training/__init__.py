"""Trains the bundled demo pair from scratch: `python -m tandem.training.demo --out DIR` (see demo.py)."""

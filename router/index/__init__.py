"""The location index: which worker holds which block (see base.py for the contract)."""

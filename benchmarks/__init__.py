"""The modes of bench.py, one file each (see bench.py for the commands)."""

"""Checkpoint internals: state layout and JSON encoding, the safe DCP reader, the SIGTERM flag."""

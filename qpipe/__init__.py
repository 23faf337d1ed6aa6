"""qpipe."""

"""Building blocks of the served models: linear layers per weight format, attention, norms, rope."""

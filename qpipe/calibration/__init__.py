"""Calibration sets: the user's samples read, rendered, selected and tokenized into fixed windows.

Split by job: readers.py (files -> raw samples), render.py (samples -> text, chat template applied),
selection.py (dedup, seeded order, length filters), token_set.py (rows, hash, file), stats.py,
builder.py (the whole flow, used by the calibrate stage), seq_len.py (the window against the
model's context).
"""

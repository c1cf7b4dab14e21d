"""The box's own checkpoint dir: what is in it and when each entry is complete, and putting a committed checkpoint
back into it.

  detect.py     candidates in the local checkpoint dir and when each is complete (by marker, format or quiet)
  restore.py    the newest committed checkpoint that verifies, put where the trainer reads it; set_aside

May import: the shared leaves, onbox.checkpoints (the base), onbox.checkpoints.formats and onbox.checkpoints.durable.
"""

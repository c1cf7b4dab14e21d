"""The box's own checkpoint dir: what is in it and when each entry is complete, and putting a committed checkpoint
back into it.

  detect.py     the candidates in the local checkpoint dir (files, dirs, groups of files), their fingerprints, the
                bounded scan, --ckpt-pattern and --ckpt-ignore (Selection), the durable name of each
  completion.py  when each candidate is complete (by marker, format, rename or close, quiet), its step and metrics
  watch.py      which entries the trainer finished, as inotify saw it (renamed in, closed after writing)
  restore.py    the newest committed checkpoint that verifies, put where the trainer reads it; set_aside
  whynone.py    why nothing in the dir counts as a checkpoint, in words (what is there, why, the fix), and when
                the trainer first finished something save-like there (the `no_checkpoint` warning is due)

May import: the shared leaves, onbox.checkpoints (the base), onbox.checkpoints.formats and onbox.checkpoints.durable.
"""

"""Example trainers that follow onbox's contract and run as they are.

  charlm.py   a tiny character-level transformer (the demo's trainer): checkpoints, resume, preemption
"""

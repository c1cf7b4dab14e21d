"""Thin click commands of `onbox`, one module per concept; each is imported only when used."""

"""Thin click commands of `onboxctl`."""

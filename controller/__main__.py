"""`python -m controller` runs onboxctl (tests and the demo use it to run this checkout's code)."""
from controller.cli import main

main()

"""`python -m controller` runs onboxctl."""
from controller.cli import main

if __name__ == "__main__":
    main()

"""`python -m onbox` and the zipapp entry point."""
from onbox.cli import main

if __name__ == "__main__":
    main()

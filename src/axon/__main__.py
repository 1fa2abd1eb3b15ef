"""`python -m axon` runs the `axon` command line."""

from axon.cli import main

if __name__ == "__main__":
    raise SystemExit(main())

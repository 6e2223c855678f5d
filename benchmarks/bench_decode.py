"""Decode benchmark entry point: see :mod:`attnplan.bench` (also ``attnplan bench``)."""

from attnplan.bench import main

if __name__ == "__main__":
    main()
